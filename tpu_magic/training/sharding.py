"""`%%tpu_train --shard data|model [--mesh BxM]`: which mesh a cell trains on, the layout a
variable gets where the model names none, and the sharding table of the report.

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

from tpu_magic.core.errors import ShardError
from tpu_magic.core.layouts import VariableShard

# A replicated variable at least this share of a device's memory gets a note.
LOUD_SHARE = 0.10
SHARDS = ("data", "model", "auto")


def parse_mesh(text: str | None, devices: int) -> tuple[int, int]:
    """`--mesh BxM` (None: one row over all devices, `1x<devices>`).

    Raises:
        ShardError: not `BxM`, or B×M is not the number of devices.
    """
    if text is None:
        return 1, devices
    parts = text.lower().replace("×", "x").split("x")
    try:
        rows, columns = (int(p) for p in parts)
    except ValueError:
        raise ShardError(f"--mesh {text!r}: write it as BxM, data rows by model columns, e.g. "
                         f"--mesh 1x{devices} or --mesh 2x{max(devices // 2, 1)}") from None
    if rows < 1 or columns < 1 or rows * columns != devices:
        divisors = [m for m in range(1, devices + 1) if devices % m == 0]
        raise ShardError(f"--mesh {text}: {rows}×{columns} is not the {devices} devices here; "
                         "use one of " + ", ".join(f"{devices // m}x{m}" for m in divisors))
    return rows, columns


def check_shard(shard: str | None, mesh: str | None) -> str:
    """The `--shard` value, checked ("data" where none was given and no mesh either).

    Raises:
        ShardError: an unknown value, or a mesh with `--shard data`.
    """
    chosen = (shard or ("model" if mesh else "data")).lower()
    if chosen not in SHARDS:
        raise ShardError(f"--shard {shard!r}: use data (replicate the model, split the batch), "
                         "model (split the model's large variables too, on JAX) or auto (data "
                         "where the memory plan fits, else the fewest model columns that fit)")
    if chosen in ("data", "auto") and mesh:
        raise ShardError(f"--mesh {mesh} lays out the model over its columns: use it with "
                         "--shard model (or leave --mesh out for data parallelism)")
    return chosen


def connection_for(connection: Any, shard: str | None, mesh: str | None, owners: Any = None
                   ) -> tuple[Any, tuple[int, int] | None]:
    """The connection a cell trains on, and its mesh (None: data parallel, as connected);
    `owners` gives the classes whose layout maps apply (`cell_code.layout_owners`).

    Raises:
        ShardError: a bad --shard or --mesh, or a backend without model parallelism.
    """
    if check_shard(shard, mesh) in ("data", "auto"):  # auto: data until the plan says (see
        return connection, None                         # memory_plan.choose)
    rows, columns = parse_mesh(mesh, connection.replicas)
    return connection.backend.model_parallel(connection, rows, columns, owners), (rows, columns)


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
