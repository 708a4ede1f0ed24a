"""A fit's plan (training/fit/plan.py) with its collaborators stood in: the batch planned for
the placement the fit trains on, its advice and `--scale-lr` said once, the memory plan's
notes said (in the plan's notes, in order: nothing calls back to be said), a resumed fit's
epoch and seed; no Keras."""

from dataclasses import dataclass, field

import pytest

from tpu_magic.core.batching import BatchPlan
from tpu_magic.core.errors import MemoryPlanError
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
class Resumed:
    epoch: int
    seed: int


def plan(monkeypatch, *, moved_to: int | None = None, scale_lr: bool = True, resume=None,
         settle=None):
    """`plan_fit` of a fit on 8 replicas; `moved_to`: `--shard auto` lays the model out on a
    mesh of that many data rows. Returns (the plan, the notes said, the batches planned)."""
    planned = []

    def plan_call(method, model, call, named, connection, batch, label=None):
        planned.append(connection.replicas)
        return BatchPlan(64, connection.replicas, 64 // connection.replicas,
                         (f"64 over {connection.replicas}",))

    def settled(placement, request, model, first_batch, owners):
        first_batch()  # what the memory plan reads
        if moved_to is None:
            return Placement(placement.connection, settled=True, form_notes=("a form note",))
        return Placement(Connection(moved_to), mesh=(moved_to, 8 // moved_to), settled=True)

    monkeypatch.setattr(fit_plan.planning, "plan_call", plan_call)
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
    assert planned == [8] and first == [8]
    assert notes == ["a setting", "a form note", "warning: 64 over 8", "scaled for 8"]
    assert result.call["epochs"] == 3 and result.seed == 99 and result.resume_from is None
    assert result.batch.replicas == 8 and result.placement.settled


def test_shard_auto_plans_the_batch_for_its_mesh_and_says_it_once(monkeypatch):
    # the batch planned again for the mesh's 2 data rows; its advice and --scale-lr said
    # once, for that mesh (they were said for both)
    result, notes, planned, _ = plan(monkeypatch, moved_to=2)
    assert planned == [8, 2] and result.batch.replicas == 2
    assert notes == ["a setting", "warning: 64 over 2", "scaled for 2"]
    assert result.placement.mesh == (2, 4)


def test_a_resumed_fit_starts_at_its_epoch_with_its_order(monkeypatch):
    result, _, _, _ = plan(monkeypatch, resume=lambda model, epochs, c: Resumed(2, 7))
    assert result.call["initial_epoch"] == 2 and result.seed == 7
    with pytest.raises(TypeError):  # the call is read-only
        result.call["epochs"] = 1


def test_a_refusal_stops_the_plan_and_a_failed_plan_is_a_note(monkeypatch):
    def refuses(*args):
        raise MemoryPlanError("will not fit")

    with pytest.raises(MemoryPlanError):
        plan(monkeypatch, settle=refuses)

    def breaks(*args):
        raise RuntimeError("no compiler")

    result, notes, _, _ = plan(monkeypatch, settle=breaks)
    assert notes[1].startswith("the memory plan was skipped (RuntimeError: no compiler)")
    assert result.placement.settled
