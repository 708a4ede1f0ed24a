"""Where a variable lives on a device mesh: the layout rule for variables a model's own
layout map does not name, and the per-variable record the report's sharding table shows.
Pure: the JAX backend applies the rule, `training.placement.sharding` renders the records."""

from __future__ import annotations

import math
from dataclasses import dataclass

# A variable smaller than this stays replicated: sharding it would save little and cost a
# collective in every step (biases, norms, LoRA factors).
SHARD_FROM_BYTES = 1 << 20


def derived_spec(shape: tuple[int, ...], itemsize: int, columns: int) -> tuple[str | None, ...]:
    """The layout of a variable a model's own layout map does not name.

    A variable of two or more dimensions and at least `SHARD_FROM_BYTES` is split over the
    model axis on the first dimension the columns divide, in this order: the middle ones
    (an attention kernel's heads, `(hidden, heads, head_dim)`), the last (a Dense kernel's
    output units, an embedding's hidden size), the first (a vocabulary). Everything else is
    replicated (biases, norms, LoRA factors).
    """
    spec: list[str | None] = [None] * len(shape)
    if columns == 1 or len(shape) < 2 or math.prod(shape) * itemsize < SHARD_FROM_BYTES:
        return tuple(spec)
    order = list(range(1, len(shape) - 1)) + [len(shape) - 1, 0]
    for axis in order:
        if shape[axis] % columns == 0:
            spec[axis] = "model"
            break
    return tuple(spec)


@dataclass(frozen=True)
class VariableShard:
    """One variable's place on the mesh, as the report's table shows it."""

    path: str
    shape: tuple[int, ...]
    spec: tuple[str | None, ...]
    bytes_per_device: int
    total_bytes: int
    source: str = ""  # where the layout came from: a model's layout map, or derived

    @property
    def replicated(self) -> bool:
        return all(s is None for s in self.spec)
