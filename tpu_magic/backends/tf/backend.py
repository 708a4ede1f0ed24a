"""Keras on TensorFlow: `tf.distribute` strategies, tf.data inputs, mirrored variables.

`TPUStrategy` on a TPU (a TPU VM's `local` or a TPU node), `MirroredStrategy` over
several GPUs or over N logical CPUs (`--simulate N`), `OneDeviceStrategy` on one GPU,
the default strategy on the CPU. TensorFlow is imported by the methods, never here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from tpu_magic.backends.protocol import Named
from tpu_magic.core import process
from tpu_magic.core.devices import DeviceView, chip_named, device_name, host_memory, memory_of, \
    runs_per_second
from tpu_magic.core.deps import require_tensorflow
from tpu_magic.core.errors import ConnectError, ShardError
from tpu_magic.core.session import Connection
from tpu_magic.core.target import Target, no_tpu_fix
from tpu_magic.core.flops import counted_training_flops
from tpu_magic.core.steps import StepState, frozen_variables, host_copy, state_groups as _state_groups
from tpu_magic.core.variables import variables_of


class TpuRuntime:
    """The TensorFlow calls that need a real TPU; tests replace this object."""

    def initialize(self, address: str) -> Any:
        tf = require_tensorflow()
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return resolver

    def strategy(self, resolver: Any) -> Any:
        tf = require_tensorflow()
        return tf.distribute.TPUStrategy(resolver)


tpu_runtime = TpuRuntime()


def configure_logical_cpus(n: int) -> None:
    """Splits the CPU into `n` logical devices (before TensorFlow's runtime starts).

    Raises:
        ConnectError: the runtime already started with another split.
    """
    tf = require_tensorflow()
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise ConnectError(
                f"--simulate {n} needs {n} logical CPU devices, but TensorFlow's runtime already "
                f"started with {have}. Restart the runtime and run `%tpu_connect --simulate {n}` "
                "before anything else uses TensorFlow."
            ) from None


def mirrored_strategy(tf: Any, devices: tuple[str, ...]) -> Any:
    """The process's MirroredStrategy over `devices` (made once: see `process`)."""
    return process.strategy_for(devices, lambda: tf.distribute.MirroredStrategy(list(devices)))


def measure_matmul(tf: Any, device: str, dtype: str, n: int, min_seconds: float = 0.3) -> float:
    """TFLOP/s of repeated n×n matmuls on one device, after a warm-up run."""
    with tf.device(device):
        a = tf.random.uniform((n, n), dtype=tf.float32)
        a = tf.cast(a, dtype)
        b = tf.identity(a)
        tf.linalg.matmul(a, b).numpy()  # warm-up: kernel selection, transfers
        rate = runs_per_second(lambda: tf.linalg.matmul(a, b), lambda c: c.numpy(), min_seconds)
    return 2.0 * n ** 3 * rate / 1e12


class TensorFlowBackend(Named):
    """The `Backend` for Keras on TensorFlow."""

    name = "tf"
    label = "TensorFlow"
    static_batch_is_global = False  # Keras gives each replica the Input's fixed batch
    step_sees_global_batch = False
    evaluates_rest = True  # see evaluate_rest

    # -- connecting ------------------------------------------------------------------------

    def refuses(self, chosen: Target, simulate: int | None) -> str | None:
        return None  # TensorFlow reaches TPU nodes, TPU VMs (with tensorflow-tpu), GPUs, CPUs

    def connect(self, chosen: Target, simulate: int | None, *, explicit_gpu: bool,
                compile_cache: str | None, env: Mapping[str, str],
                probe_node: Callable[[Target], Any] = lambda chosen: None
                ) -> tuple[Connection, Target]:
        if chosen.kind == "tpu" and process.tpu_system() not in (None, chosen.address):
            raise ConnectError(
                f"this process is already connected to TPU {process.tpu_system()}; TensorFlow cannot "
                f"switch to {chosen.address} in the same process. Restart the runtime "
                f"(Runtime > Restart session), then `%tpu_connect {chosen.address}`."
            )
        if chosen.is_tpu_node and process.tpu_system() is None:
            probe_node(chosen)
        tf = require_tensorflow()
        if simulate is not None:
            return self._simulated(tf, simulate), chosen
        if chosen.kind == "tpu":
            return self._tpu(tf, chosen, env), chosen
        if chosen.kind == "gpu":
            return self._gpu(tf, chosen, explicit_gpu)
        return self._connection(target="cpu", kind="cpu", replicas=1,
                                strategy=tf.distribute.get_strategy(), devices=("/cpu:0",)), chosen

    def _connection(self, **fields: Any) -> Connection:
        return Connection(backend=self, **fields)

    def _simulated(self, tf: Any, n: int) -> Connection:
        configure_logical_cpus(n)
        devices = tuple(f"/cpu:{i}" for i in range(n))
        return self._connection(target=f"simulate:{n}", kind="cpu", replicas=n,
                                strategy=mirrored_strategy(tf, devices), simulated=True,
                                devices=devices)

    def _tpu(self, tf: Any, chosen: Target, env: Mapping[str, str]) -> Connection:
        address = chosen.address
        try:
            resolver = tpu_runtime.initialize(address)
        except tf.errors.NotFoundError as exc:
            if address == "local":
                raise ConnectError(f"{no_tpu_fix(env)} (TensorFlow said: {_said(exc)})") from None
            raise ConnectError(f"TPU {address} could not be initialised: {exc}") from None
        except ValueError as exc:
            raise ConnectError(f"TPU {address} could not be resolved: {exc}") from None
        process.set_tpu_system(address)
        strategy = tpu_runtime.strategy(resolver)
        devices = tuple(d.name for d in tf.config.list_logical_devices("TPU"))
        return self._connection(target=address, kind="tpu",
                                replicas=strategy.num_replicas_in_sync, strategy=strategy,
                                devices=devices)

    def _gpu(self, tf: Any, chosen: Target, explicit: bool) -> tuple[Connection, Target]:
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            fix = (
                "TensorFlow sees no GPU: in Colab choose Runtime > Change runtime type > a GPU; "
                "elsewhere install a CUDA build (`pip install \"tensorflow[and-cuda]\"`; "
                "tensorflow-cpu has no GPU support)."
            )
            if explicit:
                raise ConnectError(fix)
            chosen = Target("cpu", None, chosen.reason + ", but " + fix, chosen.notes)
            return self._connection(target="cpu", kind="cpu", replicas=1,
                                    strategy=tf.distribute.get_strategy(),
                                    devices=("/cpu:0",)), chosen
        devices = tuple(f"/gpu:{i}" for i in range(len(gpus)))
        strategy = (tf.distribute.OneDeviceStrategy(devices[0]) if len(gpus) == 1
                    else mirrored_strategy(tf, devices))
        return self._connection(target="gpu", kind="gpu", replicas=len(gpus), strategy=strategy,
                                devices=devices), chosen

    def device_view(self, connection: Connection, env: Mapping[str, str]) -> DeviceView:
        tf = require_tensorflow()
        device = connection.devices[0] if connection.devices else "/cpu:0"
        runtime_name = ""
        if connection.kind == "gpu":
            details = tf.config.experimental.get_device_details(
                tf.config.list_physical_devices("GPU")[0])
            runtime_name = details.get("device_name", "GPU")
        name = device_name(connection.kind, runtime_name, connection.simulated, env)
        chip = chip_named(connection.kind, name, env)
        memory = host_memory() if connection.kind == "cpu" else None
        if connection.kind in ("gpu", "tpu"):
            try:
                info = tf.config.experimental.get_memory_info(device.lstrip("/").upper())
                memory = memory_of(info["current"], None, info["peak"], chip, name)
            except (ValueError, RuntimeError, tf.errors.OpError):
                memory = memory_of(None, None, None, chip, name)
        return DeviceView(name, chip, memory,
                          lambda dtype, n: measure_matmul(tf, device, dtype, n))

    # -- inputs ----------------------------------------------------------------------------

    def inputs(self) -> Any:
        from tpu_magic.backends.tf import data as pipeline

        return pipeline

    def runs_short_batches(self) -> bool:
        return False  # MirroredStrategy splits a short batch unevenly, or leaves replicas empty

    def repeats_input(self, steps_per_execution: int, steps_given: bool) -> bool:
        # tf.data repeats (no stall at each epoch start), except where Keras would run whole
        # executions of K steps on an endless dataset and so overshoot the epoch.
        return steps_per_execution == 1 or steps_given

    def user_batches(self, data: Any, strategy: Any, note: Callable[[str], None],
                     masked: bool = True, *, batch: int | None = None, shuffle: bool = False,
                     class_weight: Any = None, steps: int | None = None,
                     keep: int = 1) -> tuple[Any, bool]:
        """A tf.data dataset split per replica with its batches made whole (`tf_data`;
        Keras maps class weights into one itself). A `PyDataset` read by Keras's own
        adapter, one batch for one, as a tf.data dataset of whole batches Keras distributes
        (`keras_inputs.whole_batches`): short batches padded and masked, or cut to a whole
        number of rows per replica where the loss takes no mask (a replica cannot run an
        uneven share). A generator or a grain dataset goes to Keras's own adapter as it is
        (a one-shot generator lost batches to Keras's build-time peek through the wrapper)."""
        import keras

        if hasattr(data, "element_spec"):
            if class_weight:
                return data, False
            return self._whole_dataset(data, batch, strategy, note, masked), False
        from tpu_magic.backends.keras_inputs import whole_batches

        replicas = getattr(strategy, "num_replicas_in_sync", 1)
        if replicas < 2 or not isinstance(data, keras.utils.PyDataset):
            return data, False
        return whole_batches(data, replicas, masked, shuffle=shuffle, class_weight=class_weight,
                             steps=steps, keep=keep, cut=True), True

    def _whole_dataset(self, data: Any, batch: int | None, strategy: Any,
                       note: Callable[[str], None], masked: bool) -> Any:
        from tpu_magic.backends.tf import data as pipeline

        replicas = getattr(strategy, "num_replicas_in_sync", 1)
        if not (masked and batch and pipeline.labelled(data)):
            return pipeline.equal_shares(data, replicas) if replicas > 1 else data
        if getattr(strategy, "num_replicas_in_sync", 1) > 1 and pipeline.unseeded_shuffle(data):
            note("the dataset shuffles without a seed, so it cannot be split into one "
                 "pipeline per replica (each would shuffle its own way) and Keras "
                 "distributes it: freeing its iterator can make fit wait seconds to "
                 "minutes after the last step. Seed the shuffle, `shuffle(n, seed=1)`, "
                 "or call keras.utils.set_random_seed(...) before building the dataset.")
        return pipeline.whole_batches(data, batch, strategy)

    def dataset_batch_size(self, data: Any) -> int | None:
        from tpu_magic.backends.tf.data import dataset_batch_size

        return dataset_batch_size(data)

    def steps_per_execution_note(self, connection: Connection, steps: int) -> str | None:
        if steps > 1 and connection.replicas > 1 and \
                type(connection.strategy).__name__ == "MirroredStrategy":
            return (f"steps_per_execution {steps} fails in Keras 3 under MirroredStrategy with "
                    f"{connection.replicas} replicas (keras-team/keras#19246): running 1 step "
                    "per execution here; on a TPU it applies.")
        return None

    def jit_compile_note(self, connection: Connection, model: Any) -> str | None:
        if getattr(model, "jit_compile", False) is True and _mirrored_replicas(connection):
            return (f"jit_compile=True fails in TensorFlow under MirroredStrategy with "
                    f"{connection.replicas} replicas (XLA cannot place the replicas' variables "
                    "on one device): model runs without it here; on a TPU, XLA compiles every "
                    "step anyway.")
        return None

    def leads(self) -> bool:
        return True  # one process

    def shard_writer(self, model: Any) -> Any:
        return None  # one process, its variables whole in it: one HDF5 file

    def replica_sum(self, value: Any) -> Any:
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return value
        return context.all_reduce(tf.distribute.ReduceOp.SUM, value)

    @contextlib.contextmanager
    def replica_steps(self, model: Any, connection: Connection) -> Iterator[None]:
        """Keras on TensorFlow divides every `Loss` result and `add_loss` total computed in a
        replica by the replica count, sums the replicas' gradients, and multiplies the
        loss back only inside its own `train_step`/`test_step`. A custom step (or a layer
        calling a loss object and `add_loss`) then logs 1/R of its loss, or trains on 1/R of
        it. Here, instead, a replica's losses stay its own batch's mean (scaling is off while
        the model's steps are traced) and the model's optimizers average the gradients: the
        same numbers on every path as on one device.

        An optimizer a custom `compile` keeps (a GAN's two) would build its slots inside the
        first step, in a replica, which TensorFlow cannot run ("You must feed a value for
        placeholder tensor"): it is built here first, over all the model's trainable
        variables (it updates only those its step gives it; the others' slots stay unused).
        """
        if not _mirrored_replicas(connection):
            yield
            return
        from keras.src.losses import loss as loss_module

        for optimizer in _optimizers_of(model):
            _average_gradients(optimizer)
            if not optimizer.built and model.trainable_variables:
                optimizer.build(model.trainable_variables)
        scale, unscale = (loss_module.scale_loss_for_distribution,
                          loss_module.unscale_loss_for_distribution)
        loss_module.scale_loss_for_distribution = loss_module.unscale_loss_for_distribution = \
            _unchanged
        try:
            yield
        finally:
            loss_module.scale_loss_for_distribution = scale
            loss_module.unscale_loss_for_distribution = unscale

    def model_parallel(self, connection: Connection, rows: int, columns: int) -> Connection:
        raise ShardError(
            "--shard model needs Keras on JAX: Keras's model parallelism "
            "(keras.distribution.ModelParallel) exists only there. Restart the runtime and run "
            "`%tpu_connect --backend jax` (add `--simulate 8` to rehearse on the CPU) before "
            "anything imports keras.")

    # -- the first-step parity check ----------------------------------------------------

    def step_state(self, model: Any) -> StepState:
        """Replica 0's values (a replica's own BatchNorm statistics are its own)."""
        frozen = frozen_variables(model)
        with self.reading(model):
            return StepState(*(tuple(None if id(v) in frozen else
                                     host_copy(self.replica_values(v)[0]) for v in group)
                               for group in _state_groups(model)))

    def one_device_steps(self, model: Any, before: StepState, batches: list,
                         one_device_copy: Callable[[], Any]) -> tuple[dict, StepState]:
        """Keras's own `train_on_batch` on a copy of the model outside every strategy (built
        on a thread of its own: this one is inside the cell's strategy), from `before`."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(self._one_device_steps, model, before, batches,
                               one_device_copy).result()

    def _one_device_steps(self, model: Any, before: StepState, batches: list,
                          one_device_copy: Callable[[], Any]) -> tuple[dict, StepState]:
        import keras

        copy = one_device_copy()
        with self.reading(model):
            for ours, theirs, host in zip(_state_groups(copy)[:2], _state_groups(model)[:2],
                                          before.groups[:2]):
                for variable, live, value in zip(ours, theirs, host):
                    variable.assign(value if value is not None else
                                    np.asarray(self.replica_values(live)[0]))
        if before.optimizer:
            copy.optimizer.build(copy.trainable_variables)
            if len(copy.optimizer.variables) != len(before.optimizer):
                raise ValueError("the copy's optimizer does not hold the model's state")
            for variable, value in zip(copy.optimizer.variables, before.optimizer):
                variable.assign(value)
        # `fit` over exactly these batches, as Keras's own fit hands them to a step ((x, y)
        # without a weight: a custom `train_step` may unpack two), and its epoch's logs
        history = copy.fit(_replayed(batches), steps_per_epoch=len(batches), epochs=1,
                           verbose=0)
        logs = {key: values[-1] for key, values in history.history.items()}
        after = StepState(*(tuple(None if h is None else host_copy(v.value)
                                  for h, v in zip(host, group))
                            for host, group in zip(before.groups, _state_groups(copy))))
        return {key: float(np.asarray(value)) for key, value in logs.items()}, after

    def step_logs(self, model: Any, logs: dict) -> dict:
        # a batch-end `logs` holds replica 0's own metric values (Keras reduces a step's
        # outputs by taking the first replica's); the metrics read here sum every replica's
        with self.reading(model):
            return dict(model.get_metrics_result())

    def distributed_inference(self, model: Any, batch: Any) -> dict | None:
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
        saved = [[host_copy(part) for part in self.replica_values(v)] for v in metric_variables]
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
                for part, value in zip(self.replica_values(variable), parts_saved):
                    part.assign(value)
        return {key: float(np.asarray(value)) for key, value in logs.items()}

    def one_device_inference(self, model: Any, batch: Any,
                             one_device_copy: Callable[[], Any]) -> dict:
        """`batch`'s logs in inference mode on one device: Keras's own `test_on_batch` of a
        copy holding the model's weights now (built on a thread of its own: this one is
        inside the cell's strategy)."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(self._one_device_inference, model, batch,
                               one_device_copy).result()

    def _one_device_inference(self, model: Any, batch: Any,
                              one_device_copy: Callable[[], Any]) -> dict:
        copy = one_device_copy()
        with self.reading(model):
            for variable, live in zip(copy.weights, model.weights):
                variable.assign(np.asarray(self.replica_values(live)[0]))
        logs = copy.evaluate(_replayed([batch]), steps=1, return_dict=True, verbose=0)
        return {key: float(np.asarray(value)) for key, value in logs.items()}

    def evaluate_rest(self, model: Any, rest: tuple,
                      one_device_copy: Callable[[], Any]) -> dict | None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # outside the cell's strategy
            states = pool.submit(self._rest_states, model, rest, one_device_copy).result()
        mine = model.metrics_variables
        if len(states) != len(mine) or any(
                tuple(state.shape) != tuple(variable.shape)
                for state, variable in zip(states, mine)):
            return None
        with self.reading(model):
            # a metric variable is summed over the replicas when read; assigning its sum
            # gives each replica a share of it (Keras reads the sum again)
            for variable, state in zip(mine, states):
                variable.assign(variable.numpy() + state)
            logs = model.get_metrics_result()
        return {key: _plain(value) for key, value in logs.items()}

    def _rest_states(self, model: Any, rest: tuple,
                     one_device_copy: Callable[[], Any]) -> list:
        copy = one_device_copy()
        with self.reading(model):
            for variable, live in zip(copy.weights, model.weights):
                variable.assign(np.asarray(self.replica_values(live)[0]))
        import keras

        x, y, weight = rest
        copy.evaluate(x, y, sample_weight=weight, batch_size=len(keras.tree.flatten(x)[0]),
                      verbose=0)
        return [variable.numpy() for variable in copy.metrics_variables]

    def shard_rows(self, model: Any) -> list:
        return []

    def step_memory(self, model: Any, batch: Any, connection: Connection | None = None) -> None:
        return None  # planned on JAX, where Keras's model parallelism is

    def reshard(self, model: Any, connection: Connection) -> None:
        self.model_parallel(connection, 1, 1)  # says that it needs JAX

    def compile_counts(self) -> None:
        return None  # TensorFlow keeps no persistent compilation cache for Keras's steps

    def training_flops(self, model: Any) -> tuple[float, str] | None:
        flops = counted_training_flops(model)
        return None if flops is None else (flops, "counted from the layers")

    # -- variables -------------------------------------------------------------------------

    def built_outside(self, model: Any, strategy: Any) -> bool:
        own = getattr(model, "_distribute_strategy", None)  # Keras sets it when made in a scope
        if own is not None and own is not strategy:
            return True
        return bool(self.outside_variables(model, strategy))

    def outside_variables(self, model: Any, strategy: Any) -> list:
        return [v for v in variables_of(model)
                if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))]

    def users_distribution(self, connection: Connection) -> tuple[Connection, str] | None:
        return None  # Keras's distribution API is JAX's; tf.distribute strategies are ours

    def keep_in_force(self, distribution: Any) -> None:
        return None

    def place(self, model: Any, connection: Connection) -> list | None:
        """Nothing moves: a variable belongs to the strategy it was made in. A model made
        outside every strategy and not built yet (a subclassed model compiled in a plain
        cell) is given this one, so that Keras builds it symbolically inside the strategy
        before its first step, as it does a model made in the scope (otherwise it builds it
        inside a replica's step, which TensorFlow cannot run: "You must feed a value for
        placeholder tensor")."""
        if not model.weights and getattr(model, "_distribute_strategy", None) is None:
            model._distribute_strategy = connection.strategy
        return None

    def built_for(self, model: Any, strategy: Any) -> bool:
        if not model.weights:
            return False
        return getattr(model, "_distribute_strategy", None) is strategy and \
            not self.built_outside(model, strategy)

    def reading(self, model: Any) -> Any:
        own = getattr(model, "_distribute_strategy", None)
        return own.scope() if own is not None else contextlib.nullcontext()

    def replica_values(self, variable: Any) -> list[Any]:
        variable = getattr(variable, "value", variable)
        return list(getattr(variable, "values", (variable,)))

    @contextlib.contextmanager
    def on_the_cpu(self) -> Iterator[None]:
        tf = require_tensorflow()
        if tf.distribute.has_strategy():
            raise ConnectError("%tpu_sync builds the CPU copy outside every strategy: run it in "
                               "its own cell, not inside %%tpu_train")
        with tf.device("/cpu:0"):
            yield


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


def _said(exc: BaseException, limit: int = 160) -> str:
    """The first line of an error, cut at a word (never mid-word) if long."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(first) <= limit:
        return first
    return first[:limit].rsplit(" ", 1)[0] + " …"


def _mirrored_replicas(connection: Connection) -> bool:
    return connection.replicas > 1 and type(connection.strategy).__name__ == "MirroredStrategy"


def _unchanged(value: Any) -> Any:
    return value


def _optimizers_of(model: Any) -> list[Any]:
    """The model's optimizers: `model.optimizer` and any a custom `compile` kept (a GAN's
    two), with the inner optimizer of a loss-scale optimizer."""
    import keras

    found = [v for v in [getattr(model, "optimizer", None), *vars(model).values()]
             if isinstance(v, keras.optimizers.Optimizer)]
    found += [o.inner_optimizer for o in found if hasattr(o, "inner_optimizer")]
    unique: dict[int, Any] = {}
    for optimizer in found:
        unique.setdefault(id(optimizer), optimizer)
    return list(unique.values())


_AVERAGED = "_tpu_magic_averages_gradients"


def _average_gradients(optimizer: Any) -> None:
    """The optimizer all-reduces gradients to their mean over the replicas (Keras: the sum)."""
    if getattr(optimizer, _AVERAGED, False):
        return
    tf = require_tensorflow()
    summed = optimizer._all_reduce_sum_gradients

    def all_reduce_mean(grads_and_vars):
        reduced = summed(grads_and_vars)
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context is not None else 1
        if replicas == 1:
            return reduced
        return [(None if g is None else _divided(tf, g, replicas), v) for g, v in reduced]

    object.__setattr__(optimizer, "_all_reduce_sum_gradients", all_reduce_mean)
    object.__setattr__(optimizer, _AVERAGED, True)


def _divided(tf: Any, gradient: Any, n: int) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values / n, gradient.indices, gradient.dense_shape)
    return gradient / n


BACKEND = TensorFlowBackend()
