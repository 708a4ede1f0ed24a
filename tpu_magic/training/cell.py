"""A `%%tpu_train` cell's orchestration: `TrainingCell` routes the cell's Keras calls to
their steps and records what each did.

`fit`, `evaluate` and `predict` of the models a cell runs (and, later, of the models it
built or rewrapped: see `routing`) come here. A `fit` is planned (`fit.plan`: its batch,
the placement settled from its first batch), its inputs built once for the plan
(`inputs.build`), and run (`fit.run`); `evaluate` and `predict` are `calls`. The cell
speaks (notes, said once) and keeps the `CellRecord` the report is built from.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Mapping, MutableMapping

import keras

from tpu_magic.core.errors import TpuMagicError
from tpu_magic.core.session import Connection
from tpu_magic.core.variables import name_of
from tpu_magic.training import routing
from tpu_magic.training.calls import Calls, predict_on_batch_call, rows_of
from tpu_magic.training.cell_code import (assigned_before, hand_written_loop,
                                          layout_owners, names_in)
from tpu_magic.training.checkpoints import cell_checkpoints
from tpu_magic.training.fit import utilization
from tpu_magic.training.fit.plan import FitPlan, PlanFailed, plan_fit
from tpu_magic.training.fit.progress import TrainingView
from tpu_magic.training.fit.run import (FitHooks, Measures, interrupted_line, notes_of,
                                        progress_for, ready, run_fit)
from tpu_magic.training.inputs import planning
from tpu_magic.training.inputs.build import Built, Inputs
from tpu_magic.training.models import precision
from tpu_magic.training.models.rewrap import (built_for, built_outside, custom_objects_from,
                                              place_model, rewrap_for_cell)
from tpu_magic.training.models.setup import prepare, settle_traced_state
from tpu_magic.training.parity.check import check_ahead, checked_first, fit_checks
from tpu_magic.training.placement import place as placement
from tpu_magic.training.placement import sharding
from tpu_magic.training.report import CellRecord, TrainReport
from tpu_magic.training.request import TrainRequest
from tpu_magic.training.sync.rebuild import compiled_like, cpu_copy

# Its steps are not `strategy.run` calls, and its optimizer would update replicated variables
# from outside a replica (TensorFlow: "DistributedVariable.handle is not available outside
# the replica context").
ONE_DEVICE = ("this cell trains with its own tf.GradientTape loop, so it runs as a plain cell "
              "on one device, with plain Keras's numbers. To train on all {replicas} replicas, "
              "put the step in a train_step method and call fit (keras.io: 'Customizing what "
              "happens in fit()').")


@dataclass(frozen=True)
class FitCall:
    """A `fit` as the cell made it: the model and its arguments (the panel's Train repeats it)."""

    model: Any
    arguments: dict
    named: frozenset

    @property
    def cannot_repeat(self) -> str | None:
        """Why the panel's Train cannot repeat this fit (None: it can)."""
        for key in ("x", "validation_data"):
            if planning.read_once(self.arguments.get(key)):
                return (f"this fit read a generator ({key}), which is used up: train from a "
                        "cell, with the generator made again")
        return None

    @property
    def repeated(self) -> tuple[dict, set]:
        """Its arguments and the names the user gave, as the panel's Train repeats it: the
        cell's batch and epochs (the user's left out), from epoch 0, Keras's output off."""
        return (dict(self.arguments, initial_epoch=0, verbose=0),
                set(self.named) - {"batch_size", "epochs", "initial_epoch"})


@dataclass(frozen=True)
class CellCode:
    """A `%%tpu_train` cell's work: its compiled code, and the code as text (read for the
    names it uses and a hand-written loop)."""

    execute: Callable[[], Any]
    code: str


@dataclass(frozen=True)
class FitAgain:
    """The panel's Train: the last `fit` again; `stop_event` set stops it at a batch."""

    last: FitCall
    stop_event: threading.Event | None = None


class TrainingCell:
    """Routes every Keras `fit`/`evaluate`/`predict` through tpu_magic while a cell runs.

    Args:
        connection / request: what `%tpu_connect` made; the cell's flags, checked.
        namespace / say: the user's namespace; prints one line to the user.
        bar / view: a tqdm-like class for bars (None: none); the panel's training area.
        agreed / inputs_measured / flops_counted: what earlier cells of this notebook
            measured, not measured again: first-step setups that agreed with one device
            (`parity.setup.setup_key`), a batch's input seconds (`Built.measurable_key`),
            a sample's FLOPs (`utilization.flops_key`).
        watch: around each Keras call, by name (an engine of several hosts says where it is).

    When `run` ends, `report` is the frozen `TrainReport` and `last_fit` the last `fit` the
    cell made (what the panel's Train repeats). It writes no shared state.
    """

    def __init__(self, connection: Connection, request: TrainRequest,
                 namespace: MutableMapping[str, Any], say: Callable[[str], None] = print,
                 bar: Any = None, view: TrainingView | None = None,
                 agreed: frozenset = frozenset(),
                 inputs_measured: Mapping[str, float] | None = None,
                 flops_counted: Mapping[str, Any] | None = None,
                 watch: Callable[[str], ContextManager[Any]] | None = None):
        self.request, self.namespace, self.say, self.bar, self.view = \
            request, namespace, say, bar, view
        self.agreed, self.inputs_measured = agreed, dict(inputs_measured or {})
        self.code, self.before = "", {}  # the cell's code, what the names it assigns held
        self.layout_owners = lambda: layout_owners(self.code, namespace, self.before)
        self.placement = placement.place(connection, request, self.layout_owners)
        self.record = CellRecord(strategy=self.connection.strategy_name,
                                 replicas=self.connection.replicas)
        self.report: TrainReport = _report_of(self.record)  # built again when the cell ends
        self.last_model, self.last_fit = None, None  # the model trained last, its `FitCall`
        self.stop_event: threading.Event | None = None  # set: stop at the next batch
        self.checkpoints: cell_checkpoints.CellCheckpoints | None = None  # --checkpoint
        self.flops = utilization.FlopCounts(connection.backend, flops_counted, self._note)
        self.verified = False  # the cell's first fit ran the parity check (or skipped it)
        self.watch = watch or (lambda name: contextlib.nullcontext())

    @property
    def connection(self) -> Connection:  # the placement's: what the cell trains on now
        return self.placement.connection

    def run(self, work: CellCode | FitAgain) -> TrainReport:
        """The cell's one entry point: its code (`CellCode`), or the last `fit` again
        (`FitAgain`, the panel's Train). Returns the report, built once when it ends."""
        __tracebackhide__ = True  # noqa: F841 - the cell's own errors show the cell, not us
        start = time.perf_counter()
        try:
            if isinstance(work, FitAgain):
                self._fit_again(work.last, work.stop_event)
            else:
                self._run(work.execute, work.code)
        finally:
            self.record.seconds = time.perf_counter() - start
            self.record.model_name = name_of(self.namespace, self.last_model)
            self.report = _report_of(self.record)
        return self.report

    def _run(self, execute: Callable[[], Any], cell: str) -> None:
        __tracebackhide__ = True  # noqa: F841
        self.code, self.before = cell, assigned_before(cell, self.namespace)
        self.checkpoints = cell_checkpoints.for_request(self.request)
        if self.request.precision is not None:
            self.record.precision = self.request.precision.describe()
        if self.connection.replicas > 1 and hand_written_loop(cell):
            self._note(ONE_DEVICE.format(replicas=self.connection.replicas))
            with precision.in_force(self.request.precision):
                return execute()
        self._follow_users_distribution()
        rewrapped, skipped = rewrap_for_cell(self.namespace, names_in(cell), self.connection)
        for done in rewrapped:
            self.record.rewrapped.extend(done.names)
            self.say(done.summary(self.connection.strategy_name, self.connection.replicas))
        if skipped:
            self._note(skipped)
        kept, entered = None, self.connection
        try:
            with entered.strategy.scope(), routing.cell(self), \
                    precision.in_force(self.request.precision):
                try:
                    execute()
                finally:  # a distribution the cell set stays in force, as in plain Keras
                    kept = entered.backend.users_distribution(entered)
        finally:
            if kept is not None:
                self.connection.backend.keep_in_force(kept[0].strategy)
            self._adopt_namespace()
            if self.placement.mesh is not None and self.last_model is not None:
                lines, notes = sharding.of_model(self.connection, self.last_model,
                                                 self.placement.mesh)
                self.record.sharding = tuple(lines)
                self._notes((note, "warning: ") for note in notes)

    def _adopt_namespace(self) -> None:
        """Models the cell left in the namespace that belong to the strategy keep routing."""
        for name, value in list(self.namespace.items()):
            try:
                if isinstance(value, keras.Model) and not name.startswith("_") and \
                        built_for(value, self.connection):
                    self._adopt(value)
            except Exception as exc:  # noqa: BLE001 - the pass adds a note, never an error
                self._note(_skipped(f"keeping {name!r} routed after the cell", exc))

    def _adopt(self, model: Any) -> None:
        """Outside cells the model keeps routing: Keras's own output, no flags."""
        if not routing.adopted(model):
            routing.adopt(model, TrainingCell(self.connection, TrainRequest(progress=False),
                                              self.namespace, say=self.say))

    def _fit_again(self, last: FitCall, stop_event: threading.Event | None) -> None:
        """A recorded `fit` again, this cell's batch and epochs; `stop_event`: the Stop."""
        self.stop_event = stop_event
        self.route("fit", last.model, *last.repeated)

    def route(self, name: str, model: Any, call: dict, named: set) -> Any:
        """`model.<name>(...)` through tpu_magic (see `routing`)."""
        with self.watch(name):
            self._follow_users_distribution()
            try:
                if built_outside(model, self.connection):
                    self._note(place_model(model, self.connection, self.namespace,
                                           self._label(model)))
            except TpuMagicError:
                raise
            except Exception as exc:  # noqa: BLE001 - tpu_magic's own step: a note, never an error
                self._note(_skipped(f"placing {self._label(model)!r} on the devices", exc)
                           + "; this call runs as plain Keras on one device")
                return _plainly(name, model, call)
            self._adopt(model)
            call = planning.as_arrays(call)
            with self.connection.strategy.scope(), routing.inside_keras(), \
                    self.connection.backend.replica_steps(model, self.connection):
                try:
                    return getattr(self, "_" + name)(model, call, named)
                finally:
                    settle_traced_state(model)

    def _follow_users_distribution(self) -> None:
        """A distribution the user's own code put in force wins over tpu_magic's, said once."""
        found = placement.users(self.placement)
        if found is not None:
            self._placed(found[0], [(found[1], "note: ")])

    def _placed(self, settled: placement.Placement, notes: Iterable[tuple[str, str]]) -> None:
        """The cell trains on `settled` from now on (its later inputs built for it)."""
        self._notes(notes)
        self.placement = settled
        self.record.strategy = settled.connection.strategy_name
        self.record.replicas = settled.connection.replicas
        self.record.memory_plan = settled.memory_plan or self.record.memory_plan

    def _note(self, text: str, prefix: str = "note: ") -> None:
        """Tells the user once per cell, and keeps it in the report."""
        if text not in self.record.notes:
            self.record.notes.append(text)
            self.say(prefix + text)

    def _notes(self, notes: Iterable[tuple[str, str]]) -> None:  # each `(text, prefix)`
        for text, prefix in notes:
            self._note(text, prefix)

    def _prepare(self, model: Any) -> list[str]:  # the request's settings on it; their notes
        return prepare(model, self.connection, self.request.steps_per_execution,
                       self.request.precision, self._label(model))

    def _label(self, model: Any) -> str:  # for messages
        return name_of(self.namespace, model) or model.name

    def _inputs(self, connection: Connection | None = None) -> Inputs:
        return Inputs(connection or self.connection, self._note, self._label,
                      lambda model: name_of(self.namespace, model))

    def _calls(self) -> Calls:
        return Calls(self._inputs(), self.request.progress,
                     _one_device_copies(self.namespace, self.connection.backend),
                     self.request.steps_per_execution, self.request.batch, self._prepare)

    def _fit(self, model: Any, call: dict, named: set) -> Any:
        recorded = FitCall(model, dict(call), frozenset(named))
        ahead = check_ahead(self.placement, self.agreed, self.request, self.verified)
        try:
            plan = plan_fit(self.request, self.placement, model, call, named,
                            first_batch=lambda c, *a: self._inputs(c).first_batch(*a),
                            prepare=self._prepare, resume=self.checkpoints and
                            self.checkpoints.resume, label=name_of(self.namespace, model),
                            owners=self.layout_owners, check_ahead=ahead)
        except PlanFailed as failed:  # what it found is said, then its error is the cell's
            self._notes(failed.notes)
            raise failed.error from failed.error.__cause__
        self._placed(plan.placement, plan.notes)
        built = self._inputs().for_fit(model, plan.call, plan.batch, plan.seed, plan.build_pass)
        self.record.left_out.update(built.left_out)
        plan = ready(plan, built, self.request.steps_per_execution)
        hooks = self._hooks(plan, built, recorded.arguments["x"])
        outcome = run_fit(plan, built, hooks, Measures(
            self.flops.counted(model, plan.first), self.request.measured_tflops,
            self.inputs_measured))
        self.last_model, self.last_fit = model, recorded
        if outcome.utilization is not None and outcome.utilization.input_measured:
            self.inputs_measured.update([outcome.utilization.input_measured])
        self.record.fits.append(outcome)
        self.agreed = (self.agreed | {getattr(outcome.parity, "remembered", None)}) - {None}
        self._notes(notes_of(hooks, self.checkpoints) + list(outcome.notes))
        if outcome.failure is not None:
            raise outcome.failure
        if outcome.interrupted:
            self.say(interrupted_line(hooks.progress.timing.steps_done, outcome.ctrl_c))
        if outcome.ctrl_c:  # as in any Python cell, an interrupt ends it: the lines after fit don't run
            __tracebackhide__ = True  # noqa: F841 - IPython shows the user's line, not ours
            raise KeyboardInterrupt
        return outcome.history

    def _hooks(self, plan: FitPlan, built: Built, given: Any) -> FitHooks:
        """The fit's bar, its checkpoint saver, and (the cell's first fit) the parity check."""
        progress = progress_for(built, given, self.flops.per_sample(plan.model, plan.first,
                                                                    plan.placement.flops),
                                self.bar if self.request.progress else None, self.view)
        saver = None if self.checkpoints is None else \
            self.checkpoints.callback(plan.seed, self.connection, plan.resume_from)
        first = checked_first(self.placement, self.request, self.verified)
        self.verified = self.verified or first
        check, whole, notes = fit_checks(self.connection, self.placement.mesh, plan, built,
                                         first, self.agreed, self._calls().one_device_copy)
        self._notes((note, "note: ") for note in notes)
        return FitHooks(progress, saver, check, self.stop_event, self.request.progress,
                        whole=whole)

    def _evaluate(self, model: Any, call: dict, named: set) -> Any:
        evaluated = self._calls().evaluate(model, call, named)
        self.record.evaluated(evaluated.numbers, evaluated.left_out)
        self.last_model = self.last_model if self.last_model is not None else model
        return evaluated.result

    def _predict(self, model: Any, call: dict, named: set) -> Any:
        out = self._calls().predict(model, call, named)
        self.record.predictions.append(rows_of(out))
        return out

    def _predict_on_batch(self, model: Any, call: dict, named: set) -> Any:
        return self._predict(model, predict_on_batch_call(call), {"x"})

    def _on_batch(self, name: str, model: Any, call: dict, named: set) -> Any:
        """Keras's own step on exactly the rows given (see `Backend.replica_steps`)."""
        self._notes((note, "note: ") for note in self._prepare(model))
        return routing.keras_method(name)(model, **call)

    _train_on_batch = functools.partialmethod(_on_batch, "train_on_batch")
    _test_on_batch = functools.partialmethod(_on_batch, "test_on_batch")


def _skipped(what: str, exc: BaseException) -> str:
    """A note for a step of tpu_magic's that failed: what was skipped, and the error."""
    text = str(exc).strip().splitlines()
    return f"tpu_magic skipped {what}: {type(exc).__name__}: {text[0] if text else ''}"


def _one_device_copies(namespace: Mapping[str, Any], backend: Any
                       ) -> Callable[[Any], Callable[[], Any]]:
    """model -> a maker of its compiled one-device copy (the first-step check's reference,
    evaluate's and predict's fallback), its layers' classes found in the user's namespace."""
    def copies(model: Any) -> Callable[[], Any]:
        objects = custom_objects_from(namespace, model)
        return lambda: compiled_like(cpu_copy(model, objects, backend), model)

    return copies


def _plainly(name: str, model: Any, call: dict) -> Any:
    """`model.<name>(**call)` as plain Keras runs it on one device: on a thread of its own,
    outside the cell's strategy (both frameworks keep a strategy's scope per thread) and
    outside tpu_magic's routing. Its result, or its error, is the call's."""
    done: dict = {}

    def run() -> None:
        try:
            done["result"] = routing.keras_method(name)(model, **call)
        except BaseException as exc:  # noqa: BLE001 - handed to the cell's thread as it is
            done["error"] = exc

    worker = threading.Thread(target=run, name=f"tpu_magic plain {name}")
    worker.start()
    worker.join()
    if "error" in done:
        raise done["error"]
    return done.get("result")


def _report_of(record: CellRecord) -> TrainReport:
    """The cell's report; where building it fails, the report of what is certain (the
    strategy, replicas, notes and seconds), with a note saying so."""
    try:
        return record.report()
    except Exception as exc:  # noqa: BLE001 - the report adds a note, never an error
        return TrainReport(strategy=record.strategy, replicas=record.replicas,
                           model_name=record.model_name, fits=len(record.fits),
                           notes=tuple(record.notes) + (_skipped("the report", exc),),
                           seconds=record.seconds)