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

from tpu_magic.core import record
from tpu_magic.core.session import Connection
from tpu_magic.core.steps import StepForm
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
        form: the train step's form the plan chose (micro-batches, rematerialized blocks;
            `core.steps.StepForm`), and what to say of it (`form_notes`).
        flops: a sample's training FLOPs, from the plan's compiled step (None: not
            counted there).
        check_room: why the first-step check's one-device step would not fit a device
            beside the step (None: it fits, or not known), from the memory plan.
    """

    connection: Connection
    mesh: tuple[int, int] | None = None
    memory_plan: str | None = None
    settled: bool = False
    form: StepForm = StepForm()
    form_notes: tuple = ()
    flops: float | None = None
    check_room: str | None = None


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


def users(placement: Placement) -> tuple[Placement, str] | None:
    """A distribution the user's own code put in force (before the cell or in it), which
    wins over tpu_magic's: the placement that trains with it from now on, and what to say
    (None: there is none)."""
    connection = placement.connection
    found = connection.backend.users_distribution(connection)
    if found is None:
        return None
    theirs, described = found
    return (Placement(theirs, None, settled=True),
            f"the cell's own keras.distribution is in force ({described}): it lays out the "
            f"models and splits the batches, in place of tpu_magic's {connection.strategy_name}.")


def settle(placement: Placement, request: TrainRequest, model: Any,
           first_batch: Callable[[], Any], owners: Owners | None = None) -> Placement:
    """Before a `fit` builds its inputs: the memory plan, and `--shard auto`'s choice (where
    data parallelism does not fit, `model` is laid out over the mesh that does), both from
    the shapes of the fit's first batch (`first_batch()`, asked only where a plan is made).
    Settled once a model, setup and batch type: a later fit or cell of the same takes the
    same placement (the same mesh, already laid out), planning and compiling nothing.

    Raises:
        MemoryPlanError: the step will not fit a device (nothing has run).
    """
    if placement.settled and not (placement.mesh or request.plan_for or
                                  placement.connection.backend.plans_memory):
        return placement
    batch = first_batch()
    key = _settled_key(placement, request, model, batch)
    kept = record.of(model)
    earlier = kept.settled
    if key in earlier:
        found = earlier[key]
        return found if not placement.settled else replace(
            placement, memory_plan=found.memory_plan, form=found.form,
            form_notes=found.form_notes, flops=found.flops, check_room=found.check_room)
    connection = placement.connection
    if not placement.settled:  # --shard auto, at its first fit
        chosen, mesh, line = memory_plan.choose(connection, model, batch, request.plan_for,
                                                owners)
        if mesh is not None:
            chosen.backend.reshard(model, chosen)
        # data parallel stays open: a later fit of another batch may need model columns
        settled = Placement(chosen, mesh, line, settled=mesh is not None)
    else:
        planned = memory_plan.before_fit(connection, model, batch, request.plan_for, request)
        settled = replace(placement, memory_plan=planned.line, form=planned.form,
                          form_notes=planned.notes, flops=planned.flops,
                          check_room=planned.check_room)
    kept.settled = {**earlier, key: settled}
    return settled


def _settled_key(placement: Placement, request: TrainRequest, model: Any, batch: Any) -> tuple:
    """What a settled placement holds for: the connection (its target, replicas and mesh),
    the request's shard, mesh and chip, the model's variables (a layer unfrozen or swapped
    changes the step's memory) and the batch's shapes."""
    import keras

    connection = placement.connection
    variables = tuple((id(v), tuple(v.shape), str(v.dtype), v.trainable)
                      for v in model.variables)
    shapes = tuple((tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", "")))
                   for a in keras.tree.flatten(batch)) if batch is not None else None
    chip = None if request.plan_for is None else (request.plan_for[0].name,
                                                  request.plan_for[1])
    return (connection.target, connection.replicas, placement.mesh, request.shard,
            request.mesh, chip, variables, shapes, request.memory, request.microbatches,
            request.remat)
