"""Running a cell's Keras training on the connection's strategy: the cell's orchestration.

`fit`, `evaluate` and `predict` of the models a `%%tpu_train` cell runs (and, later, of
the models it built or rewrapped: see `routing`) go through `TrainingCell`, given the
cell's request (its flags, checked: `request`) and placed (`placement`): each call's batch
is checked before anything runs, NumPy inputs become whole batches (see `backends.tf.data`,
`backends.jax.data`), padding is masked out of losses and metrics (see `exactness`), and `fit`
gets a live progress bar; what each call did goes into the report (`report`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Mapping, MutableMapping

import keras

from tpu_magic.core import arrays
from tpu_magic.core.batching import BatchPlan, plan_batches
from tpu_magic.core.errors import CheckpointError, RewrapError
from tpu_magic.core.session import Connection
from tpu_magic.core.variables import name_of
from tpu_magic.training.checkpoints import cell_checkpoints as checkpoints
from tpu_magic.training.inputs import exactness
from tpu_magic.training.parity import compare as parity
from tpu_magic.training.placement import place as placement
from tpu_magic.training.inputs import planning
from tpu_magic.training.models import precision
from tpu_magic.training import routing
from tpu_magic.training.placement import sharding
from tpu_magic.training.fit import utilization
from tpu_magic.training.fit.agreement import ReplicasAgree
from tpu_magic.training.cell_code import (assigned_before, hand_written_loop,
                                          layout_owners, names_in)
from tpu_magic.training.inputs.build import Inputs, given_batch_size
from tpu_magic.training.models.setup import prepare, settle_traced_state
from tpu_magic.training.fit.progress import FitProgress, FitTiming, TrainingView
from tpu_magic.training.report import CellRecord, FitOutcome, TrainReport
from tpu_magic.training.request import TrainRequest
from tpu_magic.training.models.rewrap import (built_for, built_outside, compile_again,
                                      custom_objects_from, made_outside,
                                      rewrap_namespace)
from tpu_magic.training.fit.stopping import StopOnEvent, stop_on_interrupt
from tpu_magic.training.sync.cpu_copy import compiled_like, cpu_copy


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
        connection: what `%tpu_connect` made (strategy, replicas, backend).
        request: the cell's flags, read and checked (`request.read_request`).
        namespace: the user's namespace (models are looked up and rebound there).
        say: prints one line to the user.
        bar: a tqdm-like class for progress bars (None: no bars).
        view: shows the training live too (the panel's training area).
        agreed: first-step setups that agreed with one device earlier in this notebook
            (`parity.setup_key`): not compared again.
        inputs_measured: a batch's input seconds measured on earlier fits of tpu_magic's
            own pipelines, by key (`Inputs.measurable_key`): not drawn again.
        flops_counted: training FLOPs of a sample counted in earlier cells, by
            `utilization.flops_key`: not counted again.

    The cell goes one way: the request, the placement (`placement.place`, settled again
    before a fit's first step), the run (each Keras call a step of its own, whose outcome is
    recorded), and the report, built once when `run` ends: `report` is then
    the frozen `TrainReport`, and `last_fit` the last `fit` the cell made (what the panel's
    Train repeats). It writes no shared state.
    """

    def __init__(self, connection: Connection, request: TrainRequest,
                 namespace: MutableMapping[str, Any], say: Callable[[str], None] = print,
                 bar: Any = None, view: TrainingView | None = None,
                 agreed: frozenset = frozenset(),
                 inputs_measured: Mapping[str, float] | None = None,
                 flops_counted: Mapping[str, Any] | None = None,
                 watch: Callable[[str], ContextManager[Any]] | None = None):
        self.request = request
        self.code = ""  # run's cell: the classes it names lay out a mesh (`layout_owners`)
        self.before: dict[str, Any] = {}  # what the names the cell assigns held before it
        self.layout_owners = lambda: layout_owners(self.code, namespace, self.before)
        self.placement = placement.place(connection, request, self.layout_owners)
        self.namespace = namespace
        self.say = say
        self.bar = bar
        self.view = view
        connection = self.placement.connection
        self.record = CellRecord(strategy=connection.strategy_name,
                                 replicas=connection.replicas)
        self.report: TrainReport = self.record.report()  # built again when the cell ends
        self.last_model: Any = None
        self.last_fit: FitCall | None = None
        self.stop_event: threading.Event | None = None  # set: stop at the next batch
        self.inputs = self._inputs()
        self.checkpoints: checkpoints.CellCheckpoints | None = None  # --checkpoint
        self.flops = utilization.FlopCounts(connection.backend, flops_counted)
        self.verified = False  # the cell's first fit ran the parity check (or skipped it)
        self.agreed = agreed
        # a batch's input seconds of tpu_magic's own pipelines, by key, from earlier fits of
        # this notebook and this cell (`utilization.input_need`)
        self.inputs_measured = dict(inputs_measured or {})
        # around each Keras call the cell makes (an engine of several hosts tells the
        # notebook where it is: `hosts.progress.in_call`)
        self.watch = watch or (lambda name: contextlib.nullcontext())

    @property
    def connection(self) -> Connection:
        """The connection the cell trains on now (the placement's)."""
        return self.placement.connection

    @property
    def mesh(self) -> tuple[int, int] | None:
        return self.placement.mesh

    @property
    def precision(self) -> precision.Precision | None:
        return self.request.precision

    def _inputs(self) -> Inputs:
        return Inputs(self.connection, self._note, self.record.left_out,
                      lambda model: self._name_of(model) or model.name)

    def run(self, work: CellCode | FitAgain) -> TrainReport:
        """The cell's one entry point: the `%%tpu_train` cell's code (`CellCode`: rewraps the
        models it names, then runs it with the strategy in force), or the last `fit` again
        (`FitAgain`, the panel's Train). Returns the report, built once when it ends."""
        __tracebackhide__ = True  # noqa: F841 - the cell's own errors show the cell, not us
        start = time.perf_counter()
        try:
            if isinstance(work, FitAgain):
                self._fit_again(work.last, work.stop_event)
            else:
                self._run(work.execute, work.code)
        finally:
            self._reported(start)
        return self.report

    def _reported(self, start: float) -> None:
        """The cell ended (or failed): its report, built once from what it recorded."""
        self.record.seconds = time.perf_counter() - start
        self.record.model_name = self._name_of(self.last_model)
        self.report = self.record.report()

    def _run(self, execute: Callable[[], Any], cell: str) -> None:
        __tracebackhide__ = True  # noqa: F841
        self.code, self.before = cell, assigned_before(cell, self.namespace)
        if self.request.checkpoint is not None:
            self.checkpoints = checkpoints.CellCheckpoints(
                self.request.checkpoint, self.request.keep, self.request.resume)
        if self.precision is not None:
            self.record.precision = self.precision.describe()
        if self.connection.replicas > 1 and hand_written_loop(cell):
            self._run_on_one_device(execute)
            return
        self._follow_users_distribution()
        strategy = self.connection.strategy
        for done in rewrap_namespace(self.namespace, names_in(cell), self.connection):
            line = done.summary(self.connection.strategy_name, self.connection.replicas)
            self.record.rewrapped.extend(done.names)
            self.say(line)
        kept, entered = None, self.connection
        try:
            with strategy.scope(), routing.cell(self), precision.in_force(self.precision):
                try:
                    execute()
                finally:  # a distribution the cell set stays in force, as in plain Keras
                    kept = self.connection.backend.users_distribution(entered)
        finally:
            if kept is not None:
                self.connection.backend.keep_in_force(kept[0].strategy)
            self._adopt_namespace()
            if self.mesh is not None and self.last_model is not None:
                lines, notes = sharding.of_model(self.connection, self.last_model, self.mesh)
                self.record.sharding = tuple(lines)
                for note in notes:
                    self._note(note, "warning: ")

    def _run_on_one_device(self, execute: Callable[[], Any]) -> None:
        """A cell with its own GradientTape loop runs as a plain cell, on one device (see
        `ONE_DEVICE`)."""
        __tracebackhide__ = True  # noqa: F841
        self._note(ONE_DEVICE.format(replicas=self.connection.replicas))
        with precision.in_force(self.precision):
            execute()

    def _adopt_namespace(self) -> None:
        """Models the cell left in the namespace that belong to the strategy keep routing."""
        for name, value in list(self.namespace.items()):
            if isinstance(value, keras.Model) and not name.startswith("_") and \
                    built_for(value, self.connection):
                self._adopt(value)

    def _adopt(self, model: Any) -> None:
        """Outside cells the model keeps routing: Keras's own output, no flags."""
        if not routing.adopted(model):
            routing.adopt(model, TrainingCell(self.connection, TrainRequest(progress=False),
                                              self.namespace, say=self.say))

    def _fit_again(self, last: FitCall, stop_event: threading.Event | None) -> None:
        """Repeats a recorded `fit` from the current weights with this cell's batch and
        epochs; when `stop_event` is set, training stops at the next batch boundary."""
        self.stop_event = stop_event
        call = dict(last.arguments, initial_epoch=0, verbose=0)
        named = set(last.named) - {"batch_size", "epochs", "initial_epoch"}
        with self.connection.strategy.scope(), routing.inside_keras(), \
                self.connection.backend.replica_steps(last.model, self.connection):
            try:
                self._fit(last.model, call, named)
            finally:
                settle_traced_state(last.model)

    # -- routing ---------------------------------------------------------------------------

    def route(self, name: str, model: Any, call: dict, named: set) -> Any:
        """`model.<name>(...)` through tpu_magic (see `routing`). When the call ends, what
        holds the inputs built for it is dropped (`_drop_inputs`)."""
        with self.watch(name):
            try:
                return self._route(name, model, call, named)
            finally:
                self._drop_inputs(call)

    def _drop_inputs(self, call: dict) -> None:
        """The call's arguments (`routing` made the dict for this call alone) and the cell's
        `Inputs` hold the pipelines built for it, which on TensorFlow hold a copy of the
        arrays. A cell's objects refer to each other (the cell, its inputs and its progress
        hold each other's methods), so without this they went only at Python's next full
        collection, which comes seldom: measured on the seeds' CNN over 8 simulated replicas,
        5 fits' pipelines (each a 96 MiB copy of the images) were alive after 5 cells."""
        call.clear()
        self.inputs.drop_pipelines()

    def _route(self, name: str, model: Any, call: dict, named: set) -> Any:
        self._follow_users_distribution()
        if built_outside(model, self.connection):
            self._place(model)
        self._adopt(model)
        planning.as_arrays(call)
        with self.connection.strategy.scope(), routing.inside_keras(), \
                self.connection.backend.replica_steps(model, self.connection):
            try:
                return getattr(self, "_" + name)(model, call, named)
            finally:
                settle_traced_state(model)

    def _follow_users_distribution(self) -> None:
        """A distribution the user's own code put in force (before the cell or in it) wins
        over tpu_magic's: the cell's calls train with it from now on, said once."""
        found = self.connection.backend.users_distribution(self.connection)
        if found is None:
            return
        ours = self.connection.strategy_name
        connection, described = found
        self._placed(placement.Placement(connection, None, settled=True))
        self._note(f"the cell's own keras.distribution is in force ({described}): it lays "
                   f"out the models and splits the batches, in place of tpu_magic's {ours}.")

    def _place(self, model: Any) -> None:
        """A model the cell reaches with variables made elsewhere (a layer adapted in an
        earlier cell, an optimizer compiled in a plain cell): moved onto the devices where
        the backend can move variables (JAX), compiled again inside the strategy where only
        its optimizer was made outside, else refused naming the parts made outside."""
        connection, label = self.connection, self._name_of(model) or model.name
        moved = connection.backend.place(model, connection)
        if moved is not None:
            parts = made_outside(model, moved, self.namespace)
            devices = len(connection.devices) or connection.replicas
            self._note(f"model {label!r} reached this cell with parts made outside "
                       f"{connection.strategy_name}: {', '.join(parts) or 'its variables'} "
                       f"now live on its {devices} device{'s' * (devices != 1)} (the same "
                       "objects).")
            return
        outside = connection.backend.outside_variables(model, connection.strategy)
        if model.compiled and not ({id(v) for v in outside} & {id(v) for v in model.weights}):
            compile_again(model, connection, custom_objects_from(self.namespace, model))
            self._note(f"model {label!r} was compiled outside {connection.strategy_name}: "
                       "compiled again inside it, with the same settings.")
            return
        raise _unnamed(label, made_outside(model, outside, self.namespace), connection)

    # -- shared steps ----------------------------------------------------------------------

    def _plan(self, method: str, model: Any, call: dict, named: set,
              key: str = "batch_size") -> BatchPlan:
        plan = planning.plan_call(method, model, call, named, self.connection,
                                  self.request.batch_size, key, label=self._name_of(model))
        for warning in plan.warnings:
            self._note(warning, "warning: ")
        return plan

    def _note(self, text: str, prefix: str = "note: ") -> None:
        """Tells the user once per cell, and keeps it in the report."""
        if text not in self.record.notes:
            self.record.notes.append(text)
            self.say(prefix + text)

    def _prepare(self, model: Any) -> None:
        for note in prepare(model, self.connection, self.request.steps_per_execution,
                            self.precision, self._name_of(model) or model.name):
            self._note(note)

    def _name_of(self, model: Any) -> str | None:
        return name_of(self.namespace, model)

    def _first_step_check(self, model: Any) -> parity.FirstStep | None:
        """The parity check of the cell's first fit (see `parity`), where it applies."""
        connection = self.connection
        if not self.request.verify or self.verified or \
                (connection.replicas < 2 and self.mesh is None):
            return None
        self.verified = True
        backend = connection.backend
        if connection.target.startswith("hosts:"):
            self._note("the first step is not compared with one device on several hosts")
            return None
        whole_batch = backend.step_sees_global_batch
        random = [] if whole_batch else parity.random_layers(model)
        draws = (f"it draws random numbers while training ({', '.join(random)}), and each "
                 f"{backend.label} replica draws its own" if random else None)
        low = str(getattr(model, "compute_dtype", "float32")) in ("bfloat16", "float16")
        likely = parity.likely_cause(connection.replicas,
                                     [] if whole_batch else parity.per_replica_norms(model),
                                     exactness.scalar_losses(model),
                                     not exactness.keras_steps(model))
        def reference(m: Any, before: Any, batches: list) -> Any:
            with exactness.suspended(m):
                return backend.one_device_steps(m, before, batches, self._one_device_copy(m))

        def inference(m: Any, fed: Any, real: Any) -> Any:
            ours = backend.distributed_inference(m, fed)
            if ours is None:
                return None
            with exactness.suspended(m):
                return ours, backend.one_device_inference(m, real, self._one_device_copy(m))

        where = f"{connection.strategy_name} {connection.replicas} {self.mesh} {connection.target}"
        shapes = self.inputs.first_shapes
        return parity.FirstStep(backend.step_state, self.inputs.first_batches, reference,
                                parity.LOW_PRECISION_TOLERANCE if low else parity.TOLERANCE,
                                likely, draws, where, self.agreed, inference,
                                backend.step_logs,
                                setup_before=parity.setup_before(model, shapes, where, draws)
                                if shapes is not None and self.agreed else None)

    def _one_device_copy(self, model: Any) -> Callable[[], Any]:
        """Makes a copy of `model` for one device, compiled as it is (plain Keras's code: the
        reference of the parity check and of `evaluate`'s last samples)."""
        objects = custom_objects_from(self.namespace, model)
        backend = self.connection.backend
        return lambda: compiled_like(cpu_copy(model, objects, backend), model)

    # -- the three methods -----------------------------------------------------------------

    def _fit(self, model: Any, call: dict, named: set) -> Any:
        recorded = FitCall(model, dict(call), frozenset(named))
        plan = self._plan("fit", model, call, named)
        self._fit_settings(model, call, named, plan)
        seed, resume_from = self._resume(model, call)
        plan, batch = self._placed_inputs(model, call, named, plan, seed)
        timing = FitTiming(global_batch=batch, flops_per_sample=self.flops.per_sample(model),
                           tokens_per_sample=utilization.tokens_per_sample(recorded.arguments["x"]))
        progress = self._progress(timing, call, recorded.arguments["x"])
        saver = (self.checkpoints.callback(seed, self.connection, resume_from)
                 if self.checkpoints is not None else None)
        check = self._first_step_check(model)
        call["callbacks"] = _callbacks(call.get("callbacks"), progress, saver, self.stop_event,
                                       self.connection, check)
        if self.request.progress:
            call["verbose"] = 0
        compiled_before = self.connection.backend.compile_counts()
        history, ctrl_c, failure = _keras_fit(model, call, named, progress,
                                              self.connection.strategy)
        stopped = self.stop_event is not None and self.stop_event.is_set()
        interrupted = ctrl_c or stopped or failure is not None
        if not plan.global_batch:  # a dataset's batch, known once Keras read it
            plan = _seen_plan(given_batch_size(call["x"]), self.connection.replicas)
        self.last_model, self.last_fit = model, recorded
        used = utilization.of_fit(
            self.connection, self.flops.counted(model), timing.samples_per_second,
            timing.steady_seconds / timing.steady_steps if timing.steady_steps else None,
            self.inputs.measurable, self.request.measured_tflops,
            key=self.inputs.measurable_key, known=self.inputs_measured)
        if used is not None and used.input_measured:
            self.inputs_measured.update([used.input_measured])
        self.record.fits.append(FitOutcome.of(
            plan, timing, history, interrupted,
            parity=check.outcome if check is not None else None,
            utilization=used,
            xla_compile=(self.connection.backend.compile_counts() - compiled_before
                         if compiled_before is not None else None),
            checkpoints=tuple(str(p) for p in saver.written) if saver is not None else (),
            resumed_from=str(resume_from.path) if resume_from is not None else None))
        self._fit_notes(check, saver)
        if failure is not None:
            raise failure
        if interrupted:
            self.say(_interrupted(timing.steps_done, ctrl_c))
        if ctrl_c:  # as in any Python cell, an interrupt ends it: the lines after fit don't run
            __tracebackhide__ = True  # noqa: F841 - IPython shows the user's line, not ours
            raise KeyboardInterrupt
        return history

    def _fit_settings(self, model: Any, call: dict, named: set, plan: BatchPlan) -> None:
        """The request's `--epochs` and `--scale-lr`, and the model's settings."""
        if "epochs" not in named and self.request.epochs is not None:
            call["epochs"] = self.request.epochs
        if self.request.scale_lr:
            note = planning.scale_learning_rate(model, plan)
            if note:
                self._note(note, "")
        self._prepare(model)

    def _resume(self, model: Any, call: dict) -> tuple[int, Any]:
        """The fit's shuffle seed, and the checkpoint it continues from (`--resume`, the
        cell's first fit; None: from the start)."""
        if self.checkpoints is None:
            return arrays.new_seed(), None
        resume_from = self.checkpoints.resume(
            call["epochs"], lambda text: self._note(text, "warning: "), self.say,
            model, self.connection)
        if resume_from is None:
            return arrays.new_seed(), None
        call["initial_epoch"] = resume_from.epoch
        return resume_from.seed, resume_from

    def _placed_inputs(self, model: Any, call: dict, named: set, plan: BatchPlan,
                       seed: int) -> tuple[BatchPlan, int]:
        """The fit's inputs as whole batches, for the placement it trains on: settled from
        their first batch before anything runs (`placement.settle`: the memory plan, which
        may refuse, and `--shard auto`'s choice); where auto lays the model out over a mesh,
        the batch is planned and the inputs built again, for that mesh. Returns the batch's
        plan, and the batch a step takes."""
        given = dict(call)
        batch = self.inputs.for_fit(model, call, plan, seed)
        settled = placement.settle(self.placement, self.request, model, call["x"],
                                   self.layout_owners)
        if self._placed(settled):
            call.clear()
            call.update(given)
            plan = self._plan("fit", model, call, named)
            batch = self.inputs.for_fit(model, call, plan, seed)
        if batch and not plan.global_batch:  # a dataset's batch, where it says so
            plan = plan_batches(batch, self.connection.replicas, what="the dataset's batch")
        return plan, batch

    def _placed(self, settled: placement.Placement) -> bool:
        """The cell trains on `settled` from now on: its later inputs are built for it, and
        the report names it. Returns whether the connection changed."""
        moved = settled.connection is not self.placement.connection
        self.placement = settled
        if moved:
            self.inputs = self._inputs()
            self.record.strategy = settled.connection.strategy_name
            self.record.replicas = settled.connection.replicas
        if settled.memory_plan is not None:
            self.record.memory_plan = settled.memory_plan
        return moved

    def _progress(self, timing: FitTiming, call: dict, given: Any) -> FitProgress:
        """The fit's bar and live view, measuring into `timing`."""
        first_batches = self.inputs.first_batches
        return FitProgress(
            timing, bar=self.bar if self.request.progress else None, view=self.view,
            batch_of=lambda: given_batch_size(call["x"]),
            tokens_of=None if arrays.is_array_input(given)
            else lambda: utilization.first_batch_tokens(first_batches))

    def _fit_notes(self, check: Any, saver: Any) -> None:
        """What the parity check and the checkpoints of a fit tell the user."""
        warning = check.outcome.warning() if check is not None and check.outcome else None
        if warning:
            self._note(warning, "warning: ")
        if saver is not None:
            warnings, notes = self.checkpoints.outcome(saver)
            for text in warnings:
                self._note(text, "warning: ")
            for text in notes:
                self._note(text)

    def _evaluate(self, model: Any, call: dict, named: set) -> Any:
        plan = self._plan("evaluate", model, call, named)
        self._prepare(model)
        rest = self.inputs.for_evaluate(model, call, plan)
        if self.request.progress:
            call["verbose"] = 0
        wanted_dict = call.get("return_dict", False)
        call["return_dict"] = True
        result = routing.keras_method("evaluate")(model, **call)
        if rest is not None:
            result = self._evaluate_rest(model, rest) or result
        self.record.evaluations.append({k: float(v) for k, v in result.items()})
        if self.last_model is None:
            self.last_model = model
        # Keras's own ordering of a non-dict result (a scalar for a single value).
        return result if wanted_dict else model._flatten_metrics_in_order(result)

    def _evaluate_rest(self, model: Any, rest: tuple) -> dict | None:
        """`evaluate`'s results with its left-out samples evaluated on one device and
        counted in (`Backend.evaluate_rest`); None where they stay left out (said)."""
        backend = self.connection.backend
        if not backend.evaluates_rest:
            return None
        try:
            with exactness.suspended(model):
                result = backend.evaluate_rest(model, rest, self._one_device_copy(model))
        except Exception as exc:  # noqa: BLE001 - the samples stay left out, and it is said
            self._note(f"evaluate left out its last {self.record.left_out.get('evaluate')} "
                       f"samples: a one-device copy of {self._name_of(model) or model.name!r} "
                       f"could not evaluate them ({type(exc).__name__}: {exc})")
            return None
        if result is not None:
            self.record.left_out.pop("evaluate", None)
        return result

    def _predict(self, model: Any, call: dict, named: set) -> Any:
        plan = self._plan("predict", model, call, named)
        self._prepare(model)
        if self.request.progress:
            call["verbose"] = 0
        rows = self.inputs.for_predict(model, call, plan)
        out = routing.keras_method("predict")(model, **call)
        out = out if rows is None else arrays.trim(out, rows)
        self.record.predictions.append(len(keras.tree.flatten(out)[0]))
        return out

    def _predict_on_batch(self, model: Any, call: dict, named: set) -> Any:
        return self._predict(model, _predict_on_batch_call(call), {"x"})

    def _train_on_batch(self, model: Any, call: dict, named: set) -> Any:
        """One step on exactly the rows given: Keras's own, with the backend's rules for a
        batch the devices do not divide (see `Backend.replica_steps`)."""
        self._prepare(model)
        return routing.keras_method("train_on_batch")(model, **call)

    def _test_on_batch(self, model: Any, call: dict, named: set) -> Any:
        self._prepare(model)
        return routing.keras_method("test_on_batch")(model, **call)


@contextlib.contextmanager
def _default_shuffle_unsaid(default: bool) -> Iterator[None]:
    """Keras's "`shuffle=True` was passed, but will be ignored" about a dataset, left out
    where the user passed no `shuffle` (Keras's default; a KerasHub task makes a dataset of
    the user's arrays itself): noise the user did not cause. Said where they passed it."""
    with warnings.catch_warnings():
        if default:
            warnings.filterwarnings("ignore", message=r"`shuffle=True` was passed, but will be "
                                    "ignored", category=UserWarning)
        yield


def _keras_fit(model: Any, call: dict, named: set, progress: FitProgress, strategy: Any
               ) -> tuple[Any, bool, CheckpointError | None]:
    """Keras's own `fit` under `strategy` (the placement's, settled for this fit), with
    Ctrl-C and a failed checkpoint ending it at a batch boundary.

    Returns:
        (its history, whether Ctrl-C ended it, the checkpoint error that did).
    """
    interrupted, failure = False, None
    with stop_on_interrupt(model) as stop, strategy.scope(), \
            _default_shuffle_unsaid("shuffle" not in named):
        try:
            history = routing.keras_method("fit")(model, **call)
        except KeyboardInterrupt:
            interrupted, history = True, getattr(model, "history", None)
        except CheckpointError as exc:  # e.g. a full disk: stop, keep what was learned
            failure, history = exc, getattr(model, "history", None)
        finally:
            progress.close(interrupted=interrupted or stop.requested)
    return history, interrupted or stop.requested, failure


def _seen_plan(batch: int, replicas: int) -> BatchPlan:
    """The plan of a batch Keras read from a user's input (0: none was read)."""
    return BatchPlan(batch, replicas, batch // replicas if batch else 0)


def _predict_on_batch_call(call: dict) -> dict:
    """`predict_on_batch(x)` as the `predict` call that gives its rows (one batch's worth)."""
    return {"x": call["x"], "batch_size": None, "verbose": 0, "steps": None, "callbacks": None}


def _callbacks(given: Any, progress: FitProgress, saver: Any, stop_event: Any,
               connection: Connection, check: Any = None) -> list:
    """A `fit`'s callbacks: the checkpoint saver first (every other callback sees restored
    weights), the parity check (before any callback of the user's touches the weights), the
    user's, the bar, the replicas' agreement, the panel's Stop."""
    found = ([saver] if saver is not None else []) + ([check] if check is not None else []) \
        + list(given or []) + [progress]
    if connection.replicas > 1:  # one set of BatchNorm statistics, as its copy has
        found.append(ReplicasAgree(connection.backend))
    if stop_event is not None:
        found.append(StopOnEvent(stop_event))
    return found


def _interrupted(steps: int, ctrl_c: bool) -> str:
    return (f"Interrupted after {steps} steps: the model keeps the weights learned so far"
            + (", and the rest of the cell does not run." if ctrl_c else "."))


def _unnamed(label: str, parts: list[str], connection: Connection) -> RewrapError:
    if not parts:
        return RewrapError(
            f"model {label!r} was built outside {connection.strategy_name}, and this "
            "cell reaches it without naming it. Name it in the cell (tpu_magic rebuilds the "
            "models a cell names) or build it inside the %%tpu_train cell.")
    return RewrapError(
        f"model {label!r} uses {', '.join(parts)}, made outside "
        f"{connection.strategy_name}, whose variables cannot move into it. Name "
        f"{'it' if len(parts) == 1 else 'them'} in the %%tpu_train cell (tpu_magic makes the "
        "layers and models a cell names again inside the strategy, weights included), or "
        "make (and adapt) it inside the cell.")
