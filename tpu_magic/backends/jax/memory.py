"""One device's memory for a training step, planned before the first: Keras's own train
step lowered and compiled from abstract inputs, read from XLA's memory analysis. Planned
for the distribution in force, the step compiled is the one the fit then runs
(`loop.programs.Programs.abstract_train`): the plan costs no compile of its own."""

from __future__ import annotations

import math
from typing import Any

from tpu_magic.backends.jax.loop.programs import programs_of
from tpu_magic.backends.jax.loop.reading import batch_spec
from tpu_magic.backends.jax.placement import layout_owners
from tpu_magic.core.deps import require_jax
from tpu_magic.core.devices import StepMemory
from tpu_magic.core.session import Connection
from tpu_magic.core.steps import state_groups


def step_memory(model: Any, batch: Any, connection: Connection | None = None) -> StepMemory:
    """Lowers Keras's own train step for the distribution in force (or `connection`'s,
    with the variables laid out as it would: nothing moves) and compiles it from
    abstract inputs (no step runs, nothing is allocated), donating the state as Keras
    does, and reads XLA's memory analysis of one device."""
    model._symbolic_build(data_batch=batch)  # what fit does first: loss, metrics, optimizer
    if connection is None:
        return _step_memory(model, batch, None)
    with connection.strategy.scope():
        return _step_memory(model, batch, connection.strategy)


def _step_memory(model: Any, batch: Any, planned: Any) -> StepMemory:
    import keras

    jax = require_jax()
    state = _abstract_state(model, planned)
    if planned is None:  # the run's own program, compiled once for both
        compiled = programs_of(model).abstract_train(state, batch_spec(batch))
    else:  # another mesh's: compiled to plan it (`--shard auto`'s candidates)
        data = keras.tree.map_structure(_abstract_batch(keras.distribution.distribution()),
                                        batch)
        compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, data).compile()
    stats = compiled.memory_analysis()

    def on_one(arrays: Any) -> int:
        return sum(_bytes_on_one_device(a) for a in jax.tree_util.tree_leaves(arrays))

    weights, optimizer = on_one(state[:2]), on_one(state[2])
    return StepMemory(
        weights=weights, optimizer=optimizer,
        batch=max(stats.argument_size_in_bytes - weights - optimizer - on_one(state[3]), 0),
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
