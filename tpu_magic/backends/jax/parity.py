"""The first-step parity check on JAX: the model's state as host arrays, and the same steps
(or inference) on one device with no distribution in force.

The one-device step is traced before the fit's first step and compiled on a thread of its
own while that step compiles and runs (`one_device_ahead`, `beside`), so the check adds its
run, not its compile, to the first step; the step run after is that compiled program (kept
in the model's record). It holds one copy of the model's state on that device beside the
model's own: the copy it is given is donated to the step, whose new state takes its place
(the non-trainable values stay: a frozen layer's are the model's own buffers there)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tpu_magic.backends.jax.beside import Beside
from tpu_magic.core import record
from tpu_magic.core.deps import require_jax
from tpu_magic.core.steps import StepState, frozen_variables, host_copy, state_groups


def step_state(model: Any) -> StepState:
    """The model's state now, as host arrays (a frozen variable's as None)."""
    frozen = frozen_variables(model)
    live = _live_state(model)
    return StepState(*(tuple(None if id(v) in frozen else host_copy(a)
                             for v, a in zip(variables, arrays))
                       for variables, arrays in zip(state_groups(model), live)))


def one_device_ahead(model: Any, before: StepState, batches: list) -> Callable[[], bool]:
    """The one-device step `one_device_steps` will run, traced now (with no distribution in
    force, from the shapes of `before` and of the first of `batches`: every batch of an
    execution has them) and compiled on a thread of its own while the fit goes on. Returns
    a callable telling whether that compile is done (the check compares once it is, not
    waiting for it)."""
    import keras

    jax = require_jax()
    device = jax.local_devices()[0]
    one = jax.sharding.SingleDeviceSharding(device)
    live = _live_state(model)
    state = tuple([jax.ShapeDtypeStruct(np.shape(a), np.asarray(h).dtype if h is not None
                                        else a.dtype, sharding=one)
                   for h, a in zip(host, arrays)]
                  for host, arrays in zip(before.groups, live))
    batch = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=one),
        batches[0])
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        lowered = _reference_step(model).program.lower(*state, batch)
    finally:
        keras.distribution.set_distribution(distribution)
    reference = _reference_step(model)
    reference.compile_ahead(model, lowered)
    return reference.compiled


class _Reference:
    """The check's one-device step for one model: jitted once, compiled ahead where asked."""

    def __init__(self, model: Any) -> None:
        def train_step(trainable: Any, fixed: Any, slots: Any, metrics: Any, batch: Any
                       ) -> Any:
            return model.train_step((trainable, fixed, slots, metrics), batch)

        # the trainable values, the optimizer's and the metrics' are the check's own copies
        self.program = require_jax().jit(train_step, donate_argnums=(0, 2, 3))
        self._ahead: Beside | None = None

    def compile_ahead(self, model: Any, lowered: Any) -> None:
        self._ahead = Beside(model, lowered.compile)

    def compiled(self) -> bool:
        """Whether `ready` would return at once (no compile ahead left to wait for)."""
        return self._ahead is None or self._ahead.done()

    def ready(self) -> Any:
        """The program, its compile ahead (if any) waited for."""
        if self._ahead is not None:
            self._ahead.wait()
            self._ahead = None
        return self.program


def _reference_step(model: Any) -> _Reference:
    kept = record.of(model)
    if kept.reference is None:
        kept.reference = _Reference(model)
    return kept.reference


def one_device_steps(model: Any, before: StepState, batches: list) -> tuple[dict, StepState]:
    """Keras's own `train_step` of the model, compiled for one device (the first local
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
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        step = _reference_step(model).ready()
        logs: Any = {}
        for batch in batches:
            logs, state = step(*state, jax.device_put(batch, device))
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
