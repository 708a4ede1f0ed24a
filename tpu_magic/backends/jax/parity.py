"""The first-step parity check on JAX: the model's state as host arrays, and the same steps
(or inference) on one device with no distribution in force.

The one-device step is traced and compiled on a thread of its own (`one_device_ahead`,
`beside`) as early as its shapes are known: before the memory plan compiles the
distributed step, where the fit is known to be checked (the two compiles side by side), or
else before the fit's first step; once a model and batch type (a second ask for the same
types finds it). The check then adds its run, not its compile, to the first step; the step
run after is that compiled program (kept in the model's record).

What it holds on that device. A first execution of one step (the check's usual case) is
compared by the sizes of its change of the state (`core.steps.Update`), so its step
returns those sizes, not a new state: where its compile is done before the fit's first
step, it runs then (`one_device_update`) from the model's own buffers on that device (the
state before the step, a replicated array's copy there: nothing moved), and holds no
state of its own; else it runs after the step from the state copied to the host, one copy
on that device beside the model's. Steps of several (a user's K) return their new state
to run the next from: the copy is donated to the first, each one's new state takes its
place. A frozen layer's weights are never copied: the step reads the model's own buffers
there and returns nothing for them (returned, they would be new buffers: a second copy of
every frozen weight on that device, a LoRA model's whole base; docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import numpy as np

from tpu_magic.backends.jax import step_forms
from tpu_magic.backends.jax.beside import Beside
from tpu_magic.core import record
from tpu_magic.core.deps import require_jax
from tpu_magic.core.steps import (StepForm, StepState, Update, frozen_variables, host_copy,
                                  state_groups)


def step_state(model: Any) -> StepState:
    """The model's state now, as host arrays (a frozen variable's as None)."""
    frozen = frozen_variables(model)
    live = _live_state(model)
    return StepState(*(tuple(None if id(v) in frozen else host_copy(a)
                             for v, a in zip(variables, arrays))
                       for variables, arrays in zip(state_groups(model), live)))


def one_device_ahead(model: Any, batch: Any, parts: int = 1, steps: int = 1
                     ) -> Callable[[], bool]:
    """The one-device step `one_device_steps` will run for `steps` batches like `batch` (in
    `parts` micro-batches where they give its numbers: `reference_form`; for one step, the
    step returning its update's sizes), traced now (with no distribution in force, from
    the model's state as it is: a step's state has its shapes) and compiled on a thread of
    its own while the cell goes on; once a model and batch type (asked again for the same
    types, the compile already started). Returns a callable telling whether that compile
    is done (the check compares once it is, not waiting for it)."""
    jax = require_jax()
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    state = tuple([jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=one) for a in arrays]
                  for arrays in _live_state(model))
    data = jax.tree_util.tree_map(  # the types JAX takes (NumPy's int64 labels as int32)
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.dtypes.canonicalize_dtype(
            a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype), sharding=one), batch)
    frozen = frozen_variables(model)
    kept = tuple(id(v) not in frozen for v in state_groups(model)[1])
    program = (kept, reference_form(model, batch, parts), steps == 1)
    reference, types = _reference_step(model), _types(program, state, data)
    if not reference.started(types):
        with _no_distribution():
            lowered = reference.program(*program).lower(*state, data)
        reference.compile_ahead(model, lowered, types)
    return lambda: reference.ready(types)


def reference_form(model: Any, batch: Any, parts: int) -> StepForm:
    """How the check's one-device step runs `batch`: as `parts` micro-batches (the devices'
    own share of it, `parts` the replicas times the distributed step's own micro-batches),
    so that its activations on that device are a distributed step's, not the whole global
    batch's (on a chip, `parts` times more: a step that fits a device split would not fit
    it whole), where micro-batches give the whole batch's numbers (`step_forms.not_exact`,
    no BatchNormalization, rows that `parts` divide, no padding's packed weight); else as
    written, Keras's own step on the whole batch."""
    import keras

    if parts <= 1:
        return StepForm()
    x, _, weights = keras.utils.unpack_x_y_sample_weight(batch)
    rows = int(np.shape(keras.tree.flatten(x)[0])[0])
    if rows % parts or isinstance(weights, dict) or step_forms.not_exact(model) or \
            step_forms.normalizes_parts(model):
        return StepForm()
    return StepForm(micro=parts)


# XLA:CPU's LLVM passes at their lowest: the check's step runs once, and on CPU devices (a
# rehearsal, where its compile takes the cores the steps run on) optimizing its code costs
# more than it saves (docs/benchmarks.md); its numbers differ by rounding alone
CPU_OPTIONS = {"xla_backend_optimization_level": 0}


class _Reference:
    """The check's one-device step for one model: jitted once; compiled ahead for the
    types asked (the state's and a batch's), each on a thread of its own."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._programs: dict[tuple, Any] = {}  # which non-trainable values kept -> jitted
        self._ahead: dict[Any, Beside] = {}  # types -> its compile, started
        self._compiled: dict[Any, Any] = {}  # types -> its executable, once compiled

    def program(self, kept: tuple, form: StepForm, sizes: bool = False) -> Any:
        """Keras's train step in `form` (`reference_form`), jitted. `sizes`: returning its
        logs and each variable's sum of squared changes (the trainable ones', and the
        non-trainable ones' `kept` marks: `_squares`), nothing donated (it may read the
        model's own buffers). Else returning its new state, the non-trainable values
        `kept` marks (True) and nothing for the others (a frozen layer's weights, which no
        step changes): the caller puts the ones it gave back (`_restored`)."""
        found = self._programs.get((kept, form, sizes))
        if found is None:
            step = step_forms.train_step(self._model, form, on_one_device=True)

            def train_step(trainable: Any, fixed: Any, slots: Any, metrics: Any,
                           batch: Any) -> Any:
                logs, (new, changed, new_slots, new_metrics) = step(
                    (trainable, fixed, slots, metrics), batch)
                if sizes:
                    return logs, (_squares(trainable, new),
                                  _squares(*([a for a, keep in zip(values, kept) if keep]
                                             for values in (fixed, changed))))
                changed = [value for value, keep in zip(changed, kept) if keep]
                return logs, (new, changed, new_slots, new_metrics)

            # the trainable values, the optimizer's and the metrics' are the check's copies
            found = self._programs[kept, form, sizes] = require_jax().jit(
                train_step, donate_argnums=() if sizes else (0, 2, 3))
        return found

    def started(self, types: Any) -> bool:
        return types in self._ahead

    def compile_ahead(self, model: Any, lowered: Any, types: Any) -> None:
        on_cpu = require_jax().default_backend() == "cpu"

        def compile_it() -> None:
            self._compiled[types] = lowered.compile(CPU_OPTIONS if on_cpu else None)

        self._ahead[types] = Beside(model, compile_it)

    def ready(self, types: Any) -> bool:
        """Whether `step` would return at once for these types (nothing left to compile
        that was started)."""
        found = self._ahead.get(types)
        return found is None or found.done()

    def step(self, types: Any) -> Callable[..., Any]:
        """The program for these types: compiled ahead (waited for), else the jitted one
        (compiled where it first runs)."""
        found = self._ahead.get(types)
        if found is not None:
            found.wait()
        return self._compiled.get(types, self.program(*types[0]))


def _types(program: tuple, state: Any, data: Any) -> tuple:
    """A program's types: which program (`_Reference.program`'s non-trainable values kept
    and form), the state's and a batch's types."""
    jax = require_jax()
    leaves, tree = jax.tree_util.tree_flatten((state, data))
    return program, tree, tuple((tuple(a.shape), jax.dtypes.canonicalize_dtype(a.dtype))
                             for a in leaves)


def _squares(before: list, after: list) -> Any:
    """Each floating-point variable's sum of squared changes, in float32 (two floats of a
    step's before and after lie close, so their difference is exact in their own type)."""
    import jax.numpy as jnp

    found = [jnp.sum(jnp.square((b - a).astype(jnp.float32))) for a, b in zip(before, after)
             if jnp.issubdtype(a.dtype, jnp.floating)]
    return jnp.stack(found) if found else jnp.zeros((0,), jnp.float32)


def _restored(fixed: list, changed: list, kept: tuple) -> list:
    """The non-trainable values after a step: those it returned (`changed`, where `kept`),
    and the ones it was given where it returned nothing (a frozen layer's)."""
    returned = iter(changed)
    return [next(returned) if keep else given for given, keep in zip(fixed, kept)]


def _reference_step(model: Any) -> _Reference:
    kept = record.of(model)
    if kept.reference is None:
        kept.reference = _Reference(model)
    return kept.reference


def one_device_steps(model: Any, before: StepState, batches: list, parts: int = 1
                     ) -> tuple[dict, Update]:
    """Keras's own `train_step` of the model (each batch in `parts` micro-batches where
    they give its numbers: `reference_form`), compiled for one device (the first local
    one) with no distribution in force (ahead, where `one_device_ahead` was asked), from
    `before` (a frozen layer's weights read from the model: the replicated copy already on
    that device, nothing moved): the last step's logs and the sizes of the steps' change."""
    jax = require_jax()
    device = jax.local_devices()[0]
    live = _live_state(model)
    state = tuple([jax.device_put(h, device) if h is not None else _on_device(a, device)
                   for h, a in zip(host, arrays)]
                  for host, arrays in zip(before.groups, live))
    kept = tuple(h is not None for h in before.non_trainable)
    with _no_distribution():
        if len(batches) == 1:
            return _sized(model, kept, state, batches[0], parts, waited=True)
        reference, logs = _reference_step(model), {}
        for batch in batches:
            data = jax.device_put(batch, device)
            program = (kept, reference_form(model, batch, parts), False)
            step = reference.step(_types(program, state, data))
            try:
                logs, out = step(*state, data)
            except TypeError:  # an executable takes its types exactly (a weak type, a
                # layout): the jitted program takes what the check has, nothing donated yet
                logs, out = reference.program(*program)(*state, data)
            state = (out[0], _restored(state[1], out[1], kept), out[2], out[3])
    after = StepState(*(tuple(None if h is None else host_copy(a)
                              for h, a in zip(host, arrays))
                        for host, arrays in zip(before.groups, state)))
    return _floats(logs), Update.between(before, after)


def one_device_update(model: Any, batch: Any, parts: int = 1) -> tuple[dict, Update] | None:
    """`one_device_steps` of one batch, run now, before the fit's first step, from the
    model's own state on the first device (its buffers there hold the state before the
    step: a replicated array's own copy, nothing moved or kept), where its compile ahead
    is done; None where it is not (nothing waited for: the check runs it after the step,
    from the copied state) or the compiled step does not take these arrays."""
    jax = require_jax()
    device = jax.local_devices()[0]
    state = tuple([_on_device(a, device) for a in arrays] for arrays in _live_state(model))
    frozen = frozen_variables(model)
    kept = tuple(id(v) not in frozen for v in state_groups(model)[1])
    with _no_distribution():
        return _sized(model, kept, state, batch, parts, waited=False)


def _sized(model: Any, kept: tuple, state: tuple, batch: Any, parts: int, waited: bool
           ) -> tuple[dict, Update] | None:
    """One step of `batch` from `state` (on the first device) returning its logs and its
    update's sizes: its compile ahead waited for (`waited`), else only where it is done."""
    jax = require_jax()
    data = jax.device_put(batch, jax.local_devices()[0])
    program = (kept, reference_form(model, batch, parts), True)
    reference, types = _reference_step(model), _types(program, state, data)
    if not waited and not (reference.started(types) and reference.ready(types)):
        return None
    try:
        logs, squares = reference.step(types)(*state, data)
    except TypeError:  # an executable takes its types exactly (a weak type, a layout)
        if not waited:
            return None  # compiling it here would put that compile before the first step
        logs, squares = reference.program(*program)(*state, data)
    return _floats(logs), Update.from_squares(*squares)


@contextlib.contextmanager
def _no_distribution() -> Iterator[None]:
    """Keras's distribution set aside: the one-device step is traced and run outside it."""
    import keras

    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(distribution)


def _floats(logs: dict) -> dict:
    return {key: float(np.asarray(value)) for key, value in logs.items()}


def one_device_inference(model: Any, batch: Any, one_device_copy: Callable[[], Any]) -> dict:
    """`batch`'s logs in inference mode: Keras's own `test_on_batch` of a copy holding the
    model's weights, with no distribution in force."""
    import keras

    with _no_distribution():
        copy = one_device_copy()
        copy.set_weights([np.asarray(w) for w in model.get_weights()])
        x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
        logs = copy.test_on_batch(x, y, weight, return_dict=True)
    return _floats(logs)


def _live_state(model: Any) -> tuple:
    """The model's state as JAX arrays now: what `fit` holds between steps (its variables
    are emptied while it trains), else the variables' values."""
    held = getattr(model, "_jax_state", None)
    if held and not getattr(model, "_jax_state_synced", True):
        return (held["trainable_variables"], held["non_trainable_variables"],
                held["optimizer_variables"], held["metrics_variables"])
    return tuple([v.value for v in group] for group in state_groups(model))


def _on_device(array: Any, device: Any) -> Any:
    """`array` on one device: a replicated array's own copy there (no transfer), else moved."""
    jax = require_jax()
    sharding = getattr(array, "sharding", None)
    if sharding is not None and sharding.is_fully_replicated:
        for shard in array.addressable_shards:
            if shard.device == device:
                return shard.data
    return jax.device_put(array, device)
