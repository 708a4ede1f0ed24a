"""The first-step parity check on JAX: the model's state as host arrays, and the same steps
(or inference) on one device with no distribution in force.

The one-device step is traced and compiled on a thread of its own (`one_device_ahead`,
`beside`) as early as its shapes are known: before the memory plan compiles the
distributed step, where the fit is known to be checked (the two compiles side by side), or
else before the fit's first step; once a model and batch type (a second ask for the same
types finds it). The check then adds its run, not its compile, to the first step; the step
run after is that compiled program (kept in the model's record). It holds one copy of the
model's state on that device beside the model's own: the copy it is given is donated to
the step, whose new state takes its place. A frozen layer's weights are not copied: the
step reads the model's own buffers there and returns nothing for them (returned, they
would be new buffers: a second copy of every frozen weight on that device, a LoRA
model's whole base; docs/benchmarks.md)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tpu_magic.backends.jax import step_forms
from tpu_magic.backends.jax.beside import Beside
from tpu_magic.core import record
from tpu_magic.core.deps import require_jax
from tpu_magic.core.steps import (StepForm, StepState, frozen_variables, host_copy,
                                  state_groups)


def step_state(model: Any) -> StepState:
    """The model's state now, as host arrays (a frozen variable's as None)."""
    frozen = frozen_variables(model)
    live = _live_state(model)
    return StepState(*(tuple(None if id(v) in frozen else host_copy(a)
                             for v, a in zip(variables, arrays))
                       for variables, arrays in zip(state_groups(model), live)))


def one_device_ahead(model: Any, batch: Any, parts: int = 1) -> Callable[[], bool]:
    """The one-device step `one_device_steps` will run for batches like `batch` (in `parts`
    micro-batches where they give its numbers: `reference_form`), traced now (with no
    distribution in force, from the model's state as it is: a step's state has its shapes)
    and compiled on a thread of its own while the cell goes on; once a model and batch type
    (asked again for the same types, the compile already started). Returns a callable
    telling whether that compile is done (the check compares once it is, not waiting for
    it)."""
    import keras

    jax = require_jax()
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    state = tuple([jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=one) for a in arrays]
                  for arrays in _live_state(model))
    data = jax.tree_util.tree_map(  # the types JAX takes (NumPy's int64 labels as int32)
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.dtypes.canonicalize_dtype(
            a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype), sharding=one), batch)
    frozen = frozen_variables(model)
    kept = tuple(id(v) not in frozen for v in state_groups(model)[1])
    form = reference_form(model, batch, parts)
    reference, types = _reference_step(model), _types((kept, form), state, data)
    if not reference.started(types):
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            lowered = reference.program(kept, form).lower(*state, data)
        finally:
            keras.distribution.set_distribution(distribution)
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

    def program(self, kept: tuple, form: StepForm) -> Any:
        """Keras's train step in `form` (`reference_form`), jitted, returning the
        non-trainable values `kept` marks (True) and nothing for the others (a frozen
        layer's weights, which no step changes): the caller puts the ones it gave back
        (`_restored`)."""
        found = self._programs.get((kept, form))
        if found is None:
            step = step_forms.train_step(self._model, form, on_one_device=True)

            def train_step(trainable: Any, fixed: Any, slots: Any, metrics: Any,
                           batch: Any) -> Any:
                logs, (trainable, fixed, slots, metrics) = step(
                    (trainable, fixed, slots, metrics), batch)
                changed = [value for value, keep in zip(fixed, kept) if keep]
                return logs, (trainable, changed, slots, metrics)

            # the trainable values, the optimizer's and the metrics' are the check's copies
            found = self._programs[kept, form] = require_jax().jit(
                train_step, donate_argnums=(0, 2, 3))
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
                     ) -> tuple[dict, StepState]:
    """Keras's own `train_step` of the model (each batch in `parts` micro-batches where
    they give its numbers: `reference_form`), compiled for one device (the first local
    one) with no distribution in force (ahead, where `one_device_ahead` was asked), from
    `before` (a frozen layer's weights read from the model: the replicated copy already on
    that device, nothing moved)."""
    import keras

    jax = require_jax()
    device = jax.local_devices()[0]
    live = _live_state(model)
    state = tuple([jax.device_put(h, device) if h is not None else _on_device(a, device)
                   for h, a in zip(host, arrays)]
                  for host, arrays in zip(before.groups, live))
    reference = _reference_step(model)
    kept = tuple(h is not None for h in before.non_trainable)
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        logs: Any = {}
        for batch in batches:
            data = jax.device_put(batch, device)
            form = reference_form(model, batch, parts)
            step = reference.step(_types((kept, form), state, data))
            try:
                logs, out = step(*state, data)
            except TypeError:  # an executable takes its types exactly (a weak type, a
                # layout): the jitted program takes what the check has, nothing donated yet
                logs, out = reference.program(kept, form)(*state, data)
            state = (out[0], _restored(state[1], out[1], kept), out[2], out[3])
    finally:
        keras.distribution.set_distribution(distribution)
    after = StepState(*(tuple(None if h is None else host_copy(a)
                              for h, a in zip(host, arrays))
                        for host, arrays in zip(before.groups, state)))
    return {key: float(np.asarray(value)) for key, value in logs.items()}, after


def one_device_inference(model: Any, batch: Any, one_device_copy: Callable[[], Any]) -> dict:
    """`batch`'s logs in inference mode: Keras's own `test_on_batch` of a copy holding the
    model's weights, with no distribution in force."""
    import keras

    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        copy = one_device_copy()
        copy.set_weights([np.asarray(w) for w in model.get_weights()])
        x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
        logs = copy.test_on_batch(x, y, weight, return_dict=True)
    finally:
        keras.distribution.set_distribution(distribution)
    return {key: float(np.asarray(value)) for key, value in logs.items()}


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
