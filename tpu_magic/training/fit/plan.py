"""A `fit` settled before anything is built: `plan_fit` returns the frozen `FitPlan`.

The batch is planned here and nowhere else (the request's `--batch-size` plan carried
through), the placement settled from the shapes of the fit's first batch before any
pipeline exists (the memory plan, `--shard auto`'s choice), and the epochs, the data
order's seed and the checkpoint it resumes from fixed. The inputs are then built once, for
the plan (`inputs.build`), and the fit runs (`fit.run`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping

from tpu_magic.core import host_maps, random_state
from tpu_magic.core.batching import BatchPlan, plan_batches
from tpu_magic.core.errors import KerasBuildError, MemoryPlanError
from tpu_magic.core.steps import builds_from_a_pass
from tpu_magic.training.inputs import planning
from tpu_magic.training.placement.place import Owners, Placement, settle
from tpu_magic.training.request import TrainRequest


@dataclass(frozen=True)
class FitPlan:
    """What a `fit` will do, settled before its inputs are built.

    Attributes:
        model: the model it trains.
        call: its arguments as the inputs are built from: the user's (tensors as arrays),
            the request's `--epochs`, and the epoch it resumes at (read-only).
        named: the arguments the user gave.
        batch: the batch over the placement's data rows (a batch of 0: a dataset's own,
            told once the input is built or read: `told`).
        placement: the connection and mesh it trains on, settled.
        seed: the data order's seed where tpu_magic shuffles itself (a resumed fit's is its
            checkpoint's; drawn from nothing: `random_state.order_seed`).
        build_pass: plain Keras would read a batch of a pass of its own to build the model
            first (`core.steps.builds_from_a_pass`, as the fit began): a pipeline that
            shuffles as plain Keras does draws that pass's order too.
        resume_from: the checkpoint it continues from (None: the start).
        steps: the steps an execution (`fit.steps.Steps`), chosen once the inputs are built
            (`fit.run.ready`; None before).
        first: the fit's first batch as fed, read when first asked (`first()`; None where it
            cannot be read without changing what Keras reads: `fit.steps_for.first_batch`), so a
            fit that needs no batch reads none.
        notes: what planning found to tell the user, `(text, prefix)` in the order found (the
            model's settings, the memory plan's form, the batch's advice, `--scale-lr`): the
            caller says them; nothing here writes to the cell.
    """

    model: Any
    call: Mapping[str, Any]
    named: frozenset
    batch: BatchPlan
    placement: Placement
    seed: int
    build_pass: bool = False
    resume_from: Any = None
    steps: Any = None
    first: Callable[[], Any] = lambda: None
    notes: tuple[tuple[str, str], ...] = ()

    @property
    def connection(self) -> Any:
        return self.placement.connection

    def told(self, batch: int) -> "FitPlan":
        """The plan with a dataset's batch, where only the input could tell it (`batch`, 0:
        not yet); checked against the data rows as any batch is.

        Raises:
            BatchSizeError: the dataset's batch does not split over the replicas.
        """
        if self.batch.global_batch or not batch:
            return self
        return replace(self, batch=plan_batches(batch, self.connection.replicas,
                                                what="the dataset's batch"))

    def batch_run(self, read: int) -> BatchPlan:
        """The batch the fit ran: the plan's, or where only the user's input knew it, the batch
        Keras read from it (`read`, 0: none; unchecked: it ran). The plan is left as it is."""
        if self.batch.global_batch or not read:
            return self.batch
        replicas = self.connection.replicas
        return BatchPlan(read, replicas, read // replicas)


class PlanFailed(Exception):
    """Planning ended in `error` after it had found `notes` (the model's settings, the
    batch's advice, ...): the caller says them, then raises `error`, as it would have
    said them had the plan been finished."""

    def __init__(self, error: Exception, notes: tuple[tuple[str, str], ...]):
        super().__init__(error)
        self.error, self.notes = error, notes


# (model, epochs, connection) -> where `--resume` continues (`checkpoints.cell_checkpoints.
# ResumePoint`: its checkpoint, None for the start, and its `notes`), or None: no --resume
Resume = Callable[[Any, int, Any], Any]
Prepare = Callable[[Any], list]  # model -> the notes of the settings it put on the model
# (model, the fit's first batch when asked) -> None: the check's one-device step started
CheckAhead = Callable[[Any, Callable[[], Any]], None]


def plan_fit(request: TrainRequest, placement: Placement, model: Any,
             call: Mapping[str, Any], named: set, *, first_batch: Callable[..., Any],
             prepare: Prepare, resume: Resume | None, label: str | None = None,
             owners: Owners | None = None, check_ahead: CheckAhead | None = None
             ) -> FitPlan:
    """Plans a `fit`: its batch, the model's settings (`prepare`, which returns its notes),
    the placement settled from its first batch (`first_batch(connection, model, call,
    batch)`, built from the arrays or read safely from a dataset, never a pipeline, read
    once), `--scale-lr`, and where it resumes (`resume`: the checkpoint `--resume` continues
    from, and its data order's seed; None, or nothing to resume: from the start, with a new
    seed). `check_ahead`: where the fit will be checked, what starts the check's one-device
    step from that first batch before the placement is settled (`parity.check.check_ahead`:
    its compile beside the memory plan's). First, past half of Linux's limit on the
    process's memory maps, the unreferenced models' compiled programs are collected, and
    the framework's kept ones let go where that is not enough (`core.host_maps`; a compile
    past the limit kills the kernel). What it finds to say is in the plan's `notes`, for
    the caller to say; nothing is said from here.

    Raises:
        PlanFailed: the `error` below, with the notes found before it:
        BatchSizeError, InputError: the batch or the inputs, before anything runs.
        MemoryPlanError: the step will not fit a device.
        CheckpointError: `--resume` finds no checkpoint that reads back.
        The cell's own error where building its model fails as in plain Keras.
    """
    notes: list[tuple[str, str]] = []
    # before anything of this fit compiles: room for its code
    relief = host_maps.relieve(lambda: placement.connection.backend.release_compiled())
    warning = relief.warning() if relief is not None else None
    if warning is not None:
        notes.append((warning, "warning: "))
    try:
        build_pass = builds_from_a_pass(model)  # before tpu_magic builds anything of it
        call = dict(call)
        if "epochs" not in named and request.epochs is not None:
            call["epochs"] = request.epochs
        batch = planning.plan_call("fit", model, call, named, placement.connection,
                                   request.batch, label=label)
        notes += [(text, "note: ") for text in prepare(model)]
        first = functools.cache(lambda: first_batch(placement.connection, model, call, batch))
        settled, said = _settled(placement, request, model, first, owners, check_ahead)
        notes += said
        if settled.connection is not placement.connection:  # --shard auto laid out a mesh
            batch = _over_the_mesh(request, settled, model, call, named)
        notes += _said(request, model, batch)  # once, for the placement the fit trains on
        point = None if resume is None else resume(model, call["epochs"], settled.connection)
        notes += point.notes if point is not None else ()
    except Exception as error:  # noqa: BLE001 - handed back whole, with what was found
        raise PlanFailed(error, tuple(notes)) from error
    resume_from = None if point is None else point.checkpoint
    seed = random_state.order_seed() if resume_from is None else resume_from.seed
    if resume_from is not None:
        call["initial_epoch"] = resume_from.epoch
    return FitPlan(model, MappingProxyType(call), frozenset(named), batch, settled, seed,
                   build_pass, resume_from, notes=tuple(notes))


def _settled(placement: Placement, request: TrainRequest, model: Any,
             first_batch: Callable[[], Any], owners: Owners | None,
             check_ahead: CheckAhead | None = None) -> tuple[Placement, list[tuple[str, str]]]:
    """`placement.settle` (the check's step started first, where asked), and its notes
    (what the plan's step form changes); where the plan itself fails (not a refusal: the
    step will not fit), the placement as it is, and a note: the memory plan adds a note,
    never an error."""
    try:
        if check_ahead is not None:
            check_ahead(model, first_batch)
        settled = settle(placement, request, model, first_batch, owners)
        return settled, [(text, "note: ") for text in settled.form_notes]
    except MemoryPlanError:
        raise
    except KerasBuildError as failed:  # the cell's own error, where plain Keras raises it
        raise failed.original from None
    except Exception as exc:  # noqa: BLE001 - see the docstring
        skipped = (f"the memory plan was skipped ({type(exc).__name__}: {exc})"
                   + ("; --shard auto keeps data parallelism" if not placement.settled else ""))
        return (replace(placement, settled=True) if not placement.settled else placement,
                [(skipped, "note: ")])


def _over_the_mesh(request: TrainRequest, settled: Placement, model: Any,
                   call: Mapping[str, Any], named: set) -> BatchPlan:
    """The fit's batch over the data rows of the mesh `--shard auto` laid out: chosen again
    for them (the split, and a batch fixed in the model's Input, are per data row); the
    call's samples and inputs were checked once, by `plan_call`, and are not again."""
    connection = settled.connection
    return planning.choose_batch("fit", call, named, connection, request.batch,
                                 planning.static_per_replica(model, connection))


def _said(request: TrainRequest, model: Any, batch: BatchPlan) -> list[tuple[str, str]]:
    """`--scale-lr` applied for the batch, once a fit; the batch's advice and the scaling's
    line, to say."""
    said = [(warning, "warning: ") for warning in batch.warnings]
    if request.scale_lr:
        scaled = planning.scale_learning_rate(model, batch)
        if scaled:
            said.append((scaled, ""))
    return said
