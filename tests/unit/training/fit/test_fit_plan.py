"""A fit's plan (training/fit/plan.py) with its collaborators stood in: the batch planned for
the placement the fit trains on (the call checked once), its advice and `--scale-lr` said
once, the memory plan's and --resume's notes said (in the plan's notes, in order: nothing
calls back to be said; where planning fails, its error carries the notes found before it),
a resumed fit's epoch and seed; no Keras."""

from dataclasses import dataclass, field

import pytest

from tpu_magic.core.batching import BatchPlan
from tpu_magic.core.errors import CheckpointError, MemoryPlanError
from tpu_magic.training.fit import plan as fit_plan
from tpu_magic.training.placement.place import Placement
from tpu_magic.training.request import TrainRequest


@dataclass
class Layer:
    built: bool = True


@dataclass
class Model:
    """What the plan reads of a model: whether Keras would build it from a pass."""

    layers: list = field(default_factory=lambda: [Layer(), Layer()])

    def _flatten_layers(self):
        return self.layers


@dataclass(frozen=True)
class Connection:
    replicas: int


@dataclass(frozen=True)
class Checkpoint:
    epoch: int
    seed: int


@dataclass(frozen=True)
class Resumed:
    """What `--resume` finds (`cell_checkpoints.ResumePoint`): where, and what to say."""

    checkpoint: Checkpoint | None
    notes: tuple = (("a damaged one skipped", "warning: "), ("resuming", ""))


def plan(monkeypatch, *, moved_to: int | None = None, scale_lr: bool = True, resume=None,
         settle=None):
    """`plan_fit` of a fit on 8 replicas; `moved_to`: `--shard auto` lays the model out on a
    mesh of that many data rows. Returns (the plan, the notes said, the replicas the call
    was planned for (checked, then its batch chosen again for a mesh), the first batch's)."""
    planned = []

    def choose_batch(method, call, named, connection, requested, static):
        planned.append(f"batch for {connection.replicas}")
        return BatchPlan(64, connection.replicas, 64 // connection.replicas,
                         (f"64 over {connection.replicas}",))

    def plan_call(method, model, call, named, connection, batch, label=None):
        planned.append(connection.replicas)
        return choose_batch(method, call, named, connection, batch, None)

    def settled(placement, request, model, first_batch, owners):
        first_batch()  # what the memory plan reads
        if moved_to is None:
            return Placement(placement.connection, settled=True, form_notes=("a form note",))
        return Placement(Connection(moved_to), mesh=(moved_to, 8 // moved_to), settled=True)

    monkeypatch.setattr(fit_plan.planning, "plan_call", plan_call)
    monkeypatch.setattr(fit_plan.planning, "choose_batch", choose_batch)
    monkeypatch.setattr(fit_plan.planning, "static_per_replica", lambda model, c: None)
    monkeypatch.setattr(fit_plan.planning, "scale_learning_rate",
                        lambda model, batch: f"scaled for {batch.replicas}")
    monkeypatch.setattr(fit_plan, "settle", settle or settled)
    monkeypatch.setattr(fit_plan.random_state, "order_seed", lambda: 99)
    request = TrainRequest(epochs=3, scale_lr=scale_lr)
    first = []
    result = fit_plan.plan_fit(
        request, Placement(Connection(8)), Model(), {"x": None}, {"x"},
        first_batch=lambda *args: first.append(args[-1].replicas),
        prepare=lambda model: ["a setting"], resume=resume)
    notes = [prefix.replace("note: ", "") + text for text, prefix in result.notes]
    return result, notes, planned, first


def test_a_fit_is_planned_once_and_says_its_advice_once(monkeypatch):
    result, notes, planned, first = plan(monkeypatch)
    assert planned == [8, "batch for 8"] and first == [8]
    assert notes == ["a setting", "a form note", "warning: 64 over 8", "scaled for 8"]
    assert result.call["epochs"] == 3 and result.seed == 99 and result.resume_from is None
    assert result.batch.replicas == 8 and result.placement.settled


def test_shard_auto_plans_the_batch_for_its_mesh_and_says_it_once(monkeypatch):
    # the batch chosen again for the mesh's 2 data rows (the call checked once); its advice
    # and --scale-lr said once, for that mesh (they were said for both)
    result, notes, planned, _ = plan(monkeypatch, moved_to=2)
    assert planned == [8, "batch for 8", "batch for 2"] and result.batch.replicas == 2
    assert notes == ["a setting", "warning: 64 over 2", "scaled for 2"]
    assert result.placement.mesh == (2, 4)


def test_a_resumed_fit_starts_at_its_epoch_with_its_order(monkeypatch):
    result, notes, _, _ = plan(monkeypatch,
                               resume=lambda model, epochs, c: Resumed(Checkpoint(2, 7)))
    assert result.call["initial_epoch"] == 2 and result.seed == 7
    assert notes[-2:] == ["warning: a damaged one skipped", "resuming"]
    with pytest.raises(TypeError):  # the call is read-only
        result.call["epochs"] = 1
    result, notes, _, _ = plan(monkeypatch, resume=lambda model, epochs, c: Resumed(None))
    assert "initial_epoch" not in result.call and result.seed == 99 and notes[-1] == "resuming"


def test_a_plan_that_fails_hands_back_its_error_with_what_it_found_to_say(monkeypatch):
    # the model's settings and the batch's advice, found before --resume failed, are said
    # before its error (as they were when the plan said them as it went)
    def no_good_checkpoint(model, epochs, connection):
        raise CheckpointError("none reads back")

    with pytest.raises(fit_plan.PlanFailed) as failed:
        plan(monkeypatch, resume=no_good_checkpoint)
    assert isinstance(failed.value.error, CheckpointError)
    assert [text for text, _ in failed.value.notes] == [
        "a setting", "a form note", "64 over 8", "scaled for 8"]


def test_a_refusal_stops_the_plan_and_a_failed_plan_is_a_note(monkeypatch):
    def refuses(*args):
        raise MemoryPlanError("will not fit")

    with pytest.raises(fit_plan.PlanFailed) as failed:
        plan(monkeypatch, settle=refuses)
    assert isinstance(failed.value.error, MemoryPlanError)
    assert failed.value.notes == (("a setting", "note: "),)

    def breaks(*args):
        raise RuntimeError("no compiler")

    result, notes, _, _ = plan(monkeypatch, settle=breaks)
    assert notes[1].startswith("the memory plan was skipped (RuntimeError: no compiler)")
    assert result.placement.settled
