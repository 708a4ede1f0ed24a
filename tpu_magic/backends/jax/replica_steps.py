"""How Keras's steps run on the devices while tpu_magic runs them: a batch the mesh's data
rows do not divide goes whole to every device, and across processes a prediction's outputs
are gathered inside the step. Keras on JAX computes a step over the global batch (sharded
arrays): its losses and gradients are one device's already."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from tpu_magic.backends.jax import build_pass, placement, step_types
from tpu_magic.core.deps import require_jax
from tpu_magic.core.overrides import ProcessSwap, overridden
from tpu_magic.core.session import Connection
from tpu_magic.core.steps import state_groups


@contextlib.contextmanager
def replica_steps(model: Any, connection: Connection) -> Iterator[None]:
    """The context the model's steps run in: ragged batches go whole to every device, one
    compiled step serves every fit (`step_types`), a model is built without a pass of
    tpu_magic's own pipeline (`build_pass`), and its state is on the mesh when Keras makes
    a step (`_state_on_the_mesh`). Across processes (several hosts) each
    holds only its rows of a prediction, which Keras cannot read back: there the outputs are
    gathered onto every device inside the step."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_values_kept(model))
        stack.enter_context(_state_on_the_mesh(model, connection))
        stack.enter_context(build_pass.from_upcoming_batches(model))
        stack.enter_context(_RAGGED_BATCHES_WHOLE.during())
        stack.enter_context(step_types.one_program(model))
        if require_jax().process_count() > 1:
            stack.enter_context(_outputs_gathered(model, connection.strategy))
        yield


@contextlib.contextmanager
def _state_on_the_mesh(model: Any, connection: Connection) -> Iterator[None]:
    """Every variable of the model's state laid out on the connection's mesh before Keras
    makes a step function (`placement.place`). Keras fixes a step's output layouts from its
    state's layouts as it makes the function, after its build pass; that pass can bring in
    variables made outside the mesh's distribution: a metric object the model was compiled
    with in a plain cell has its variables from its construction, on one device, and they
    join the state only when Keras builds the compiled metrics. A step with one-device
    output layouts beside the mesh's is refused by JAX."""
    with contextlib.ExitStack() as stack:
        for kind in ("train", "test", "predict"):
            keras_own = getattr(model, f"make_{kind}_function")

            def make(force: bool = False, keras_own: Callable[..., Any] = keras_own) -> Any:
                placement.place(model, connection)
                return keras_own(force=force)

            stack.enter_context(overridden(model, f"make_{kind}_function", make))
        yield


@contextlib.contextmanager
def _values_kept(model: Any) -> Iterator[None]:
    """A call that fails leaves the model's variables as the call found them. Keras's JAX
    `fit`, `evaluate` and `predict` take the values out of the variables for their steps
    and put them back when they end or once a step has run; one that fails before (the
    step refuses the batch as it is traced, a callback raises at the start) leaves them
    empty, and every later use of the model fails (`'NoneType' object is not callable`).
    Every value Keras takes out is noted as it does (`_purge_model_variables`); one a step
    did not consume (a step that ran gave Keras the new values, which it puts back itself)
    goes back where the call failed."""
    held: list = []
    purge = model._purge_model_variables

    def noted(**which: bool) -> None:
        groups = dict(zip(("trainable_variables", "non_trainable_variables",
                           "optimizer_variables", "metrics_variables"), state_groups(model)))
        held.extend((variable, variable._value) for name, group in groups.items()
                    if which.get(name) for variable in group)
        purge(**which)

    try:
        with overridden(model, "_purge_model_variables", noted):
            yield
    except BaseException:
        for variable, value in held:
            if variable._value is None and value is not None and \
                    not getattr(value, "is_deleted", lambda: False)():
                variable._value = value
        raise


@contextlib.contextmanager
def _outputs_gathered(model: Any, distribution: Any) -> Iterator[None]:
    """`model.predict_step` with its outputs replicated (an all-gather in the step), while a
    call runs across processes; Keras then reads each process's copy as the whole batch."""
    jax = require_jax()
    everywhere = jax.sharding.NamedSharding(distribution.device_mesh.backend_mesh,
                                            jax.sharding.PartitionSpec())
    own = type(model).predict_step.__get__(model)

    def predict_step(state: Any, data: Any) -> Any:
        outputs, rest = own(state, data)
        return jax.tree_util.tree_map(
            lambda out: jax.lax.with_sharding_constraint(out, everywhere), outputs), rest

    model.predict_function = None
    try:
        with overridden(model, "predict_step", predict_step):
            yield
    finally:
        model.predict_function = None


def _whole_where_indivisible(keras_own: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's `distribute_data_input`, except that a batch the layout's axes do not divide
    goes to every device whole (replicated) instead of failing."""
    from tpu_magic.backends.jax.data import WholeRows

    def distribute_data_input(per_process_batch: Any, layout: Any, batch_dim_name: str) -> Any:
        jax = require_jax()
        sharding = getattr(layout, "backend_layout", layout)
        shape = tuple(getattr(per_process_batch, "shape", ()))
        one_process = jax.process_count() == 1
        if shape and isinstance(sharding, jax.sharding.NamedSharding) and \
                (isinstance(per_process_batch, WholeRows) or
                 (one_process and not _divides(sharding, shape))):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        if one_process and isinstance(sharding, jax.sharding.Sharding):
            if sharding.num_devices == 1:  # the step's own call moves it, in C++
                return per_process_batch
            # the process's batch is the global batch: one transfer, where Keras's own path
            # (`make_array_from_process_local_data`) costs a step's dispatch again on the host
            return jax.device_put(per_process_batch, sharding)
        return keras_own(per_process_batch, sharding, batch_dim_name)

    return distribute_data_input


def _divides(sharding: Any, shape: tuple) -> bool:
    try:
        sharding.shard_shape(shape)
    except Exception:  # noqa: BLE001 - jax's IndivisibleError (a private class)
        return False
    return True


def _distribution_lib() -> Any:
    from keras.src.backend.jax import distribution_lib

    return distribution_lib


# While tpu_magic runs a model's steps: a batch the mesh's data rows do not divide (the last,
# short batch of a model whose loss cannot be masked, a dataset's short batch,
# `train_on_batch` of 12 rows on 8 devices) is given to every device whole, where Keras
# would fail (jax IndivisibleError). Each device then computes the whole batch: one
# device's computation exactly, repeated. Process-wide while any call is inside.
_RAGGED_BATCHES_WHOLE = ProcessSwap(_distribution_lib, "distribute_data_input",
                                    _whole_where_indivisible)
