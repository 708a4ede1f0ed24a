"""A cell's `evaluate`, `predict` and `*_on_batch` calls (its `fit` is `fit.plan` and
`fit.run`): each one's inputs built for its checked batch, Keras's own method run on them,
and its result as plain Keras returns it, with what the report keeps of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import keras
import numpy as np

from tpu_magic.core import arrays
from tpu_magic.core.batching import BatchPlan
from tpu_magic.core.steps import builds_from_a_pass, layers_built
from tpu_magic.training import routing
from tpu_magic.training.fit.steps_for import steps_for
from tpu_magic.training.inputs import exactness, planning
from tpu_magic.training.inputs.build import Inputs
from tpu_magic.training.placement import memory_plan


@dataclass(frozen=True)
class Evaluated:
    """An `evaluate`: its result as Keras returns it, its numbers for the report, and the
    samples it left out (those a one-device copy could not count in)."""

    result: Any
    numbers: dict[str, float]
    left_out: Mapping[str, int]


@dataclass(frozen=True)
class Calls:
    """Runs a cell's calls on one connection.

    Args:
        inputs: builds their inputs (its connection is theirs).
        quiet: Keras's own progress output off (the cell's bars show).
        one_device_copy: model -> a maker of its compiled copy on one device (plain
            Keras's code: where `evaluate`'s left-out samples are evaluated).
        requested: `--steps-per-execution` (None: auto: `fit.steps_for.steps_for`).
        batch: `--batch-size`'s plan (None: each call's own batch).
        prepare: puts the cell's settings on a model before its call (`models.setup`),
            returning their notes.
    """

    inputs: Inputs
    quiet: bool
    one_device_copy: Callable[[Any], Callable[[], Any]]
    requested: int | None = None  # --steps-per-execution (None: auto)
    batch: BatchPlan | None = None  # --batch-size's plan
    prepare: Callable[[Any], list] = lambda model: []  # the model's settings (`models.setup`)

    def plan(self, method: str, model: Any, call: Mapping[str, Any], named: set) -> BatchPlan:
        """The call's batch, checked (`planning.plan_call`), its advice said; then the
        model's settings put on it, and the batch made one whose step fits a device
        (`memory_plan.call_batch`: smaller, the same results)."""
        plan = planning.plan_call(method, model, call, named, self.inputs.connection,
                                  self.batch, label=self.inputs.name(model))
        for warning in plan.warnings:
            self.inputs.note(warning, "warning: ")
        for note in self.prepare(model):
            self.inputs.note(note)
        return self._fitting(method, model, call, plan)

    def _fitting(self, method: str, model: Any, call: Mapping[str, Any],
                 plan: BatchPlan) -> BatchPlan:
        x = call.get("x")
        # an evaluate of a model Keras still builds from a batch (its compiled metrics: an
        # F1Score makes its variables at its first update) is planned after that build, at
        # its next call; a predict needs only the layers built
        unbuilt = (not layers_built(model) if method == "predict"
                   else builds_from_a_pass(model))
        if not plan.global_batch or not arrays.is_array_input(x) or not model.built or unbuilt:
            return plan
        connection = self.inputs.connection
        data = connection.backend.inputs()

        def first(batch: int) -> Any:
            if method == "predict":
                return data.predict_pipeline(x, batch, strategy=connection.strategy,
                                             remainder="short").dataset[0]
            return data.eval_pipeline(x, call.get("y"), call.get("sample_weight"), batch,
                                      strategy=connection.strategy).dataset[0]

        try:
            batch, said = memory_plan.call_batch(
                connection, model, "predict" if method == "predict" else "test",
                self.inputs.batch(plan, model, arrays.num_samples(x)), first)
        except Exception:  # noqa: BLE001 - the plan adds a note or a smaller batch, never an error
            return plan
        if said is None:
            return plan
        self.inputs.note(said)
        return BatchPlan(batch, plan.replicas, batch // plan.replicas)

    def evaluate(self, model: Any, call: Mapping[str, Any], named: set) -> Evaluated:
        built = self.inputs.for_evaluate(model, call, self.plan("evaluate", model, call, named))
        call = dict(built.call, return_dict=True)
        if self.quiet:
            call["verbose"] = 0
        with self._grouped(model, built, "test", call.get("callbacks")):
            result = routing.keras_method("evaluate")(model, **call)
        left_out = dict(built.left_out)
        if built.rest is not None:
            counted = self._evaluate_rest(model, built.rest, left_out.get("evaluate"))
            if counted is not None:
                result = counted
                left_out.pop("evaluate", None)
        numbers = {k: float(np.asarray(v)) for k, v in result.items()
                   if np.size(v) == 1}  # the report's; a metric per class stays in `wanted`
        # Keras's own ordering of a non-dict result (a scalar for a single value)
        wanted = result if built.call.get("return_dict", False) else \
            model._flatten_metrics_in_order(result)
        return Evaluated(wanted, numbers, left_out)

    def _grouped(self, model: Any, built: Any, kind: str, callbacks: Any) -> Any:
        """The call's steps an execution (`fit.steps_for.steps_for`), in force while it runs."""
        connection = self.inputs.connection
        chosen = steps_for(connection, model, built, self.requested, kind, callbacks)
        return connection.backend.grouped_steps(model, chosen, built.own)

    def _evaluate_rest(self, model: Any, rest: tuple, count: int | None) -> dict | None:
        """`evaluate`'s results with its left-out samples evaluated on one device and
        counted in (`Backend.evaluate_rest`); None where they stay left out (said)."""
        backend = self.inputs.connection.backend
        if not backend.evaluates_rest:
            return None
        try:
            with exactness.suspended(model):
                return backend.evaluate_rest(model, rest, self.one_device_copy(model))
        except Exception as exc:  # noqa: BLE001 - the samples stay left out, and it is said
            self.inputs.note(f"evaluate left out its last {count} samples: a one-device copy "
                             f"of {self.inputs.label(model)!r} could not evaluate them "
                             f"({type(exc).__name__}: {exc})")
            return None

    def predict(self, model: Any, call: Mapping[str, Any], named: set) -> Any:
        built = self.inputs.for_predict(model, call, self.plan("predict", model, call, named))
        call = dict(built.call, verbose=0) if self.quiet else dict(built.call)
        with self._grouped(model, built, "predict", call.get("callbacks")):
            out = routing.keras_method("predict")(model, **call)
        return out if built.rows is None else arrays.trim(out, built.rows)


def rows_of(out: Any) -> int:
    """How many rows a `predict` returned (the report's)."""
    return len(keras.tree.flatten(out)[0])


def predict_on_batch_call(call: Mapping[str, Any]) -> dict:
    """`predict_on_batch(x)` as the `predict` call that gives its rows (one batch's worth)."""
    return {"x": call["x"], "batch_size": None, "verbose": 0, "steps": None, "callbacks": None}
