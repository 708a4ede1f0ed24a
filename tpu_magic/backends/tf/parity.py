"""The first-step parity check on TensorFlow: replica 0's state as host arrays, the same
steps and inference on a copy of the model outside every strategy (on a thread of its own:
the cell's is inside its strategy), the replicas' inference as they compute it, and
`evaluate`'s left-out samples on one device."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Iterator

import numpy as np

from tpu_magic.backends.tf.variables import reading, replica_values
from tpu_magic.core.deps import require_tensorflow
from tpu_magic.core.steps import StepState, frozen_variables, host_copy, state_groups


def step_state(model: Any) -> StepState:
    """Replica 0's values (a replica's own BatchNorm statistics are its own)."""
    frozen = frozen_variables(model)
    with reading(model):
        return StepState(*(tuple(None if id(v) in frozen else
                                 host_copy(replica_values(v)[0]) for v in group)
                           for group in state_groups(model)))


def one_device_steps(model: Any, before: StepState, batches: list,
                     one_device_copy: Callable[[], Any]) -> tuple[dict, StepState]:
    """Keras's own `train_on_batch` on a copy of the model outside every strategy (built
    on a thread of its own: this one is inside the cell's strategy), from `before`."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_one_device_steps, model, before, batches,
                           one_device_copy).result()


def _one_device_steps(model: Any, before: StepState, batches: list,
                      one_device_copy: Callable[[], Any]) -> tuple[dict, StepState]:
    copy = one_device_copy()
    with reading(model):
        for ours, theirs, host in zip(state_groups(copy)[:2], state_groups(model)[:2],
                                      before.groups[:2]):
            for variable, live, value in zip(ours, theirs, host):
                variable.assign(value if value is not None else
                                np.asarray(replica_values(live)[0]))
    if before.optimizer:
        copy.optimizer.build(copy.trainable_variables)
        if len(copy.optimizer.variables) != len(before.optimizer):
            raise ValueError("the copy's optimizer does not hold the model's state")
        for variable, value in zip(copy.optimizer.variables, before.optimizer):
            variable.assign(value)
    import keras

    # Keras's own `fit` over exactly these batches, as it hands them to a step ((x, y)
    # without a weight: a custom `train_step` may unpack two), and its epoch's logs; not a
    # class's own `fit` (a KerasHub task's would prepare the prepared batches again)
    history = keras.Model.fit(copy, _replayed(batches), steps_per_epoch=len(batches),
                              epochs=1, verbose=0)
    logs = {key: values[-1] for key, values in history.history.items()}
    after = StepState(*(tuple(None if h is None else host_copy(v.value)
                              for h, v in zip(host, group))
                        for host, group in zip(before.groups, state_groups(copy))))
    return {key: float(np.asarray(value)) for key, value in logs.items()}, after


def step_logs(model: Any, logs: dict) -> dict:
    # a batch-end `logs` holds replica 0's own metric values (Keras reduces a step's
    # outputs by taking the first replica's); the metrics read here sum every replica's
    with reading(model):
        return dict(model.get_metrics_result())


def distributed_inference(model: Any, batch: Any) -> dict | None:
    """`batch`'s logs in inference mode as the replicas compute them: each its own
    contiguous 1/R of the rows (as the input pipelines split a batch), Keras's own
    `test_step`, the loss tracker and metrics reduced over the replicas. The model's
    metric states are put back as they were, per replica, so the epoch's logs are
    untouched. None where the batch does not split evenly."""
    tf = require_tensorflow()
    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    rows = len(np.asarray(_first_input(batch)))
    if replicas < 2 or rows % replicas:
        return None
    share = rows // replicas
    parts = tuple(part for part in _unpacked(batch) if part is not None)

    def replica_rows(context: Any) -> Any:
        first = context.replica_id_in_sync_group * share
        return tf.nest.map_structure(lambda a: tf.constant(np.asarray(a)[first:first + share]),
                                     parts)

    values = strategy.experimental_distribute_values_from_function(replica_rows)
    metric_variables = model.metrics_variables
    saved = [[host_copy(part) for part in replica_values(v)] for v in metric_variables]
    try:
        with strategy.scope():
            model.reset_metrics()

            @tf.function
            def distributed(values: Any) -> None:
                strategy.run(model.test_step, args=(values,))

            distributed(values)
            logs = model.get_metrics_result()
    finally:
        for variable, parts_saved in zip(metric_variables, saved):
            for part, value in zip(replica_values(variable), parts_saved):
                part.assign(value)
    return {key: float(np.asarray(value)) for key, value in logs.items()}


def one_device_inference(model: Any, batch: Any,
                         one_device_copy: Callable[[], Any]) -> dict:
    """`batch`'s logs in inference mode on one device: Keras's own `test_on_batch` of a
    copy holding the model's weights now (built on a thread of its own: this one is
    inside the cell's strategy)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_one_device_inference, model, batch,
                           one_device_copy).result()


def _one_device_inference(model: Any, batch: Any,
                          one_device_copy: Callable[[], Any]) -> dict:
    copy = _copy_holding_weights(model, one_device_copy)
    logs = copy.evaluate(_replayed([batch]), steps=1, return_dict=True, verbose=0)
    return {key: float(np.asarray(value)) for key, value in logs.items()}


def evaluate_rest(model: Any, rest: tuple,
                  one_device_copy: Callable[[], Any]) -> dict | None:
    """`evaluate`'s logs with the samples the replicas left out (`rest`: x, y, weight)
    evaluated on one device and added to the metrics' states (None: the states differ)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # outside the cell's strategy
        states = pool.submit(_rest_states, model, rest, one_device_copy).result()
    mine = model.metrics_variables
    if len(states) != len(mine) or any(
            tuple(state.shape) != tuple(variable.shape)
            for state, variable in zip(states, mine)):
        return None
    with reading(model):
        # a metric variable is summed over the replicas when read; assigning its sum
        # gives each replica a share of it (Keras reads the sum again)
        for variable, state in zip(mine, states):
            variable.assign(variable.numpy() + state)
        logs = model.get_metrics_result()
    return {key: _plain(value) for key, value in logs.items()}


def _rest_states(model: Any, rest: tuple,
                 one_device_copy: Callable[[], Any]) -> list:
    copy = _copy_holding_weights(model, one_device_copy)
    import keras

    x, y, weight = rest
    copy.evaluate(x, y, sample_weight=weight, batch_size=len(keras.tree.flatten(x)[0]),
                  verbose=0)
    return [variable.numpy() for variable in copy.metrics_variables]


def _replayed(batches: list) -> Iterator[Any]:
    """The batches again, each as Keras's `fit` packs one: (x, y) without a weight."""
    import keras

    for batch in batches:
        yield keras.utils.pack_x_y_sample_weight(*_unpacked(batch))


def _unpacked(batch: Any) -> tuple:
    import keras

    return keras.utils.unpack_x_y_sample_weight(batch)


def _plain(value: Any) -> Any:
    """A result as Keras's `evaluate` returns it: a float where it is one number."""
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError):
        return np.asarray(value)


def _first_input(batch: Any) -> Any:
    """A batch's first input array (its rows are the batch's)."""
    import keras

    return keras.tree.flatten(_unpacked(batch)[0])[0]


def _copy_holding_weights(model: Any, one_device_copy: Callable[[], Any]) -> Any:
    """A one-device copy of `model` holding its weights now (replica 0's: they agree)."""
    copy = one_device_copy()
    with reading(model):
        for variable, live in zip(copy.weights, model.weights):
            variable.assign(np.asarray(replica_values(live)[0]))
    return copy
