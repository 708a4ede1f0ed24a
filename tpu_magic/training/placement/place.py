"""Where a cell's model lives: the second step of its one way through (request →
placement → run → report).

`place` settles the connection and the mesh from the request before the cell's code runs
(`--shard data`: the connection as it is; `--shard model`: a mesh of data rows by model
columns). `settle` is the step before a `fit`'s first step: the memory plan (`--shard
model`, `--plan-for`), and `--shard auto`'s choice, which lays out an existing model over
the mesh that fits. Each returns a frozen `Placement`; the cell trains on the newest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from tpu_magic.core.session import Connection
from tpu_magic.training.placement import memory_plan
from tpu_magic.training.request import Shard, TrainRequest


@dataclass(frozen=True)
class Placement:
    """The connection a cell trains on.

    Attributes:
        connection: its strategy (a `ModelParallel` under a mesh), replicas (data rows).
        mesh: (data rows, model columns); None: data parallel, as connected.
        memory_plan: the memory plan's line for the report, once one was made.
        settled: whether the mesh is settled (`--shard auto` chooses at each fit until it
            lays the model out over model columns).
    """

    connection: Connection
    mesh: tuple[int, int] | None = None
    memory_plan: str | None = None
    settled: bool = False


Owners = Callable[[], Iterable[type]]  # the classes whose layout maps lay out a mesh


def place(connection: Connection, request: TrainRequest, owners: Owners | None = None
          ) -> Placement:
    """The placement before the cell runs (`auto`: data parallel until `settle` chooses);
    `owners`: asked, when a variable is made on the mesh, for the classes whose layout maps
    apply (`cell_code.layout_owners`).

    Raises:
        ShardError: a backend without model parallelism.
    """
    if request.shard is not Shard.MODEL:
        return Placement(connection, None, settled=request.shard is Shard.DATA)
    rows, columns = request.mesh
    return Placement(connection.backend.model_parallel(connection, rows, columns, owners),
                     request.mesh, settled=True)


def settle(placement: Placement, request: TrainRequest, model: Any, data: Any,
           owners: Owners | None = None) -> Placement:
    """Before a `fit`'s first step: the memory plan, and `--shard auto`'s choice (where data
    parallelism does not fit, `model` is laid out over the mesh that does).

    Raises:
        MemoryPlanError: the step will not fit a device (nothing has run).
    """
    connection = placement.connection
    if not placement.settled:  # --shard auto, at its first fit
        chosen, mesh, line = memory_plan.choose(connection, model, data, request.plan_for,
                                                owners)
        if mesh is not None:
            chosen.backend.reshard(model, chosen)
        return Placement(chosen, mesh, line, settled=mesh is not None)  # data: asks again
    if placement.mesh or request.plan_for:
        line = memory_plan.before_fit(connection, model, data, request.plan_for)
        return replace(placement, memory_plan=line)
    return placement
