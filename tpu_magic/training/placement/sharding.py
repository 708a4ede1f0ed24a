"""`%%tpu_train --shard model`: the sharding table of the report (the mesh itself is read
in `request`, and laid out in `placement`).

Keras's model parallelism (`keras.distribution.ModelParallel`) exists on JAX: a mesh of B
data rows by M model columns; a variable laid out over the model axis holds 1/M of it on
each device. A model's own layout map (KerasHub's `get_layout_map`) is used where it has
one; otherwise `core.layouts.derived_spec` lays out each variable from its shape alone, so any model can
be sharded. Sharding changes where the numbers live, not what they are: the losses equal
one device's up to float rounding.
"""

from __future__ import annotations

import collections
from typing import Any

from tpu_magic.core.layouts import VariableShard

# A replicated variable at least this share of a device's memory gets a note.
LOUD_SHARE = 0.10


def of_model(connection: Any, model: Any, mesh: tuple[int, int]) -> tuple[list[str], list[str]]:
    """The sharding table of a model trained on `mesh`, and its notes (see `table`)."""
    memory = connection.backend.device_view(connection, {}).memory
    total = memory.total_gib * 2**30 if memory and memory.total_gib else None
    return table(connection.backend.shard_rows(model), mesh, total)


def table(rows: list[VariableShard], mesh: tuple[int, int], device_bytes: float | None,
          largest: int = 8) -> tuple[list[str], list[str]]:
    """The report's sharding lines (the largest variables first) and its notes: a replicated
    variable that takes `LOUD_SHARE` or more of a device's memory.

    Returns:
        (lines, notes).
    """
    per_device = sum(r.bytes_per_device for r in rows)
    total = sum(r.total_bytes for r in rows)
    lines = [f"sharding: mesh {mesh[0]}x{mesh[1]} (data × model); weights {_mib(per_device)} "
             f"per device of {_mib(total)}"]
    sources = collections.Counter(_kind(r.source) for r in rows if r.source)
    if sources:
        lines.append("  layouts: " + ", ".join(f"{count} from {kind}"
                                                for kind, count in sources.most_common()))
    for row in sorted(rows, key=lambda r: -r.total_bytes)[:largest]:
        spec = "(" + ", ".join(s or "·" for s in row.spec) + ")"
        lines.append(f"  {row.path} {tuple(row.shape)} {spec}: {_mib(row.bytes_per_device)} "
                     "per device")
    notes = [f"{row.path} {tuple(row.shape)}: layout {row.source}" for row in rows
             if row.source.startswith("derived: ")]
    if device_bytes:
        for row in rows:
            if row.replicated and row.total_bytes >= LOUD_SHARE * device_bytes:
                notes.append(f"{row.path} {tuple(row.shape)} is replicated on every device "
                             f"({_mib(row.total_bytes)}, {100 * row.total_bytes / device_bytes:.0f} "
                             "% of one device's memory): no model-axis size divides its "
                             "dimensions; give the model a layout map for it, or another --mesh")
    return lines, notes


def _kind(source: str) -> str:
    return "its shape (the model's map did not fit it)" if source.startswith("derived: ") \
        else "its shape" if source.startswith("derived") else source


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f} MiB"
