"""One device's memory for a training step, planned before the first: Keras's own train
step lowered and compiled from abstract inputs, read from XLA's memory analysis. Planned
for the distribution in force, the step compiled is the one the fit then runs
(`loop.programs.Programs.abstract_train`): the plan costs no compile of its own."""

from __future__ import annotations

import math
from typing import Any

from tpu_magic.backends.jax import step_forms
from tpu_magic.backends.jax.loop.programs import programs_of
from tpu_magic.backends.jax.loop.reading import batch_spec
from tpu_magic.backends.jax.placement import layout_owners
from tpu_magic.core.deps import require_jax
from tpu_magic.core.devices import StepMemory
from tpu_magic.core.session import Connection
from tpu_magic.core.steps import StepForm, build, state_groups


def step_memory(model: Any, batch: Any, connection: Connection | None = None,
                form: StepForm | None = None, bf16: bool = False) -> StepMemory:
    """Lowers Keras's own train step in `form` (micro-batches, rematerialized blocks; None:
    as written) for the distribution in force (or `connection`'s, with the variables laid
    out as it would: nothing moves) and compiles it from abstract inputs (no step runs,
    nothing is allocated), donating the state as Keras does, and reads XLA's memory
    analysis of one device. `bf16`: as if its floating-point variables were bfloat16 (a
    plan of what `--precision bf16` would save)."""
    build(model, batch)  # what fit does first: loss, metrics, optimizer
    if connection is None:
        return _step_memory(model, batch, None, form, bf16)
    with connection.strategy.scope():
        return _step_memory(model, batch, connection.strategy, form, bf16)


def _step_memory(model: Any, batch: Any, planned: Any, form: StepForm | None,
                 bf16: bool = False) -> StepMemory:
    import keras

    jax = require_jax()
    state = _abstract_state(model, planned)
    if bf16:
        import jax.numpy as jnp

        state = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=a.sharding)
            if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
    if planned is None and not bf16:  # the run's own program, compiled once for both
        compiled = programs_of(model).abstract_train(state, batch_spec(batch), form)
    else:  # another mesh's: compiled to plan it (`--shard auto`'s candidates)
        data = keras.tree.map_structure(_abstract_batch(keras.distribution.distribution()),
                                        batch)
        step = step_forms.train_step(model, form or StepForm())
        compiled = jax.jit(step, donate_argnums=0).lower(state, data).compile()
    stats = compiled.memory_analysis()

    def on_one(arrays: Any) -> int:
        return sum(_bytes_on_one_device(a) for a in jax.tree_util.tree_leaves(arrays))

    weights, optimizer = on_one(state[:2]), on_one(state[2])
    return StepMemory(
        weights=weights, optimizer=optimizer,
        batch=max(stats.argument_size_in_bytes - weights - optimizer - on_one(state[3]), 0),
        temporaries=stats.temp_size_in_bytes,
        outputs=max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0),
        compiled_on=jax.devices()[0].platform, flops=_flops(compiled),
        devices=_devices(compiled))


def _devices(compiled: Any) -> int:
    """The devices a compiled step runs on (its arguments' layouts name them)."""
    shardings = require_jax().tree_util.tree_leaves(compiled.input_shardings)
    return max((len(s.device_set) for s in shardings), default=1)


def _flops(compiled: Any) -> float | None:
    """One device's FLOPs in `compiled`, from XLA's cost analysis (None: not counted; a
    list of one dict in older jaxlibs)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: ranked without
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def call_memory(model: Any, kind: str, batch: Any) -> StepMemory:
    """One device's memory for a `kind` ("test", "predict") step of the model on `batch`,
    compiled from abstract inputs: the program the call then runs."""
    jax = require_jax()
    groups = {"test": (True, True, False, True), "predict": (True, True, False, False)}[kind]
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=False, metrics_variables=groups[3])
    programs = programs_of(model)
    targets = programs.targets(kind)
    if targets is None:
        shapes = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    else:
        shapes = tuple([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target)
                        for a, target in zip(group, group_targets)]
                       for group, group_targets in zip(state, targets))
    stats = programs.abstract(kind, shapes, batch_spec(batch)).memory_analysis()
    weights = sum(_bytes_on_one_device(a) for a in jax.tree_util.tree_leaves(shapes))
    return StepMemory(weights=weights, optimizer=0,
                      batch=max(stats.argument_size_in_bytes - weights, 0),
                      temporaries=stats.temp_size_in_bytes,
                      outputs=max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0),
                      compiled_on=jax.devices()[0].platform)


def _abstract_state(model: Any, planned: Any) -> tuple:
    """The model's state as its step takes it, as shapes: laid out as the run's programs
    take it (`Programs.targets`), or as `planned` (a distribution) would lay it out."""
    jax = require_jax()
    if planned is None:
        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                     optimizer_variables=True, metrics_variables=True)
        targets = programs_of(model).targets("train")
        if targets is None:
            return jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        return tuple([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target)
                      for a, target in zip(group, group_targets)]
                     for group, group_targets in zip(state, targets))
    owners = layout_owners(model)
    return tuple([jax.ShapeDtypeStruct(v.shape, v.value.dtype,
                                       sharding=planned.layout_for(v, owners).backend_layout)
                  for v in group] for group in state_groups(model))


def _abstract_batch(distribution: Any) -> Any:
    """An array → its shape and dtype, laid out as `distribution` lays out data."""
    jax = require_jax()

    def abstract(array: Any) -> Any:
        if array is None:
            return None
        shape = tuple(array.shape)
        sharding = (distribution.get_data_layout(shape).backend_layout
                    if distribution is not None and shape else None)
        return jax.ShapeDtypeStruct(shape, array.dtype, sharding=sharding)

    return abstract


def _bytes_on_one_device(array: Any) -> int:
    """An array's (or its abstract shape's) bytes on one device: its shard's, where laid out."""
    import numpy as np

    shape = tuple(array.shape)
    sharding = getattr(array, "sharding", None)
    part = sharding.shard_shape(shape) if sharding is not None else shape
    return int(math.prod(part)) * np.dtype(array.dtype).itemsize
