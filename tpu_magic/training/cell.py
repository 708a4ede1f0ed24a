"""Running a cell's Keras training on the connection's strategy: the cell's orchestration.

`fit`, `evaluate` and `predict` of the models a `%%tpu_train` cell runs (and, later, of
the models it built or rewrapped: see `routing`) go through `TrainingCell`: the batch
is checked before anything runs, NumPy inputs become whole batches (see `backends.tf.data`,
`backends.jax.data`), padding is masked out of losses and metrics (see `exactness`), and `fit`
gets a live progress bar and a report.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, MutableMapping

import keras

from tpu_magic.core import arrays
from tpu_magic.core.batching import BatchPlan, plan_batches
from tpu_magic.core.errors import CheckpointError, RewrapError
from tpu_magic.core.session import Connection
from tpu_magic.core.variables import name_of
from tpu_magic.training import (checkpoints, exactness, memory_plan, parity, planning,
                                precision, routing, sharding, utilization)
from tpu_magic.training.agreement import ReplicasAgree
from tpu_magic.training.cell_code import hand_written_loop, layout_owners, names_in
from tpu_magic.training.inputs import Inputs, given_batch_size
from tpu_magic.training.model_setup import prepare
from tpu_magic.training.progress import FitProgress, FitTiming, TrainingView
from tpu_magic.training.report import TrainReport
from tpu_magic.training.rewrap import (built_for, built_outside, compile_again,
                                      custom_objects_from, made_outside,
                                      rewrap_namespace)
from tpu_magic.training.stopping import StopOnEvent, stop_on_interrupt
from tpu_magic.training.sync import compiled_like, cpu_copy


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
class TrainOptions:
    """The flags of `%%tpu_train`."""

    batch_size: int | None = None
    epochs: int | None = None
    scale_lr: bool = False
    steps_per_execution: int | None = None
    progress: bool = True
    checkpoint: str | None = None  # a directory
    keep: int = 2
    resume: bool = False
    precision: str | None = None  # --precision; None: the Keras dtype policy as it is
    shard: str | None = None  # --shard data|model (None: data)
    mesh: str | None = None  # --mesh BxM
    plan_for: str | None = None  # --plan-for CHIP-N (a memory plan against that chip)
    verify: bool = True  # --verify: the first step against the same step on one device
    measured_tflops: float | None = None  # one device's matmul TFLOP/s from --check, if it ran


class TrainingCell:
    """Routes every Keras `fit`/`evaluate`/`predict` through tpu_magic while a cell runs.

    Args:
        connection: what `%tpu_connect` made (strategy, replicas, backend).
        options: the cell's flags.
        namespace: the user's namespace (models are looked up and rebound there).
        say: prints one line to the user.
        bar: a tqdm-like class for progress bars (None: no bars).
        view: shows the training live too (the panel's training area).
        agreed: first-step setups that agreed with one device earlier in this notebook
            (`parity.setup_key`): not compared again.

    After `run` or `fit_again`, `report` is the outcome, and `last_fit` the last `fit`
    the cell made (what the panel's Train repeats). It writes no shared state.
    """

    def __init__(self, connection: Connection, options: TrainOptions,
                 namespace: MutableMapping[str, Any], say: Callable[[str], None] = print,
                 bar: Any = None, view: TrainingView | None = None,
                 agreed: frozenset = frozenset(),
                 watch: Callable[[str], ContextManager[Any]] | None = None):
        # --shard model: the cell trains on a mesh (data rows, model columns) of the devices
        self.code = ""  # run's cell: the classes it names lay out a mesh (`layout_owners`)
        self.layout_owners = lambda: layout_owners(self.code, namespace)
        connection, self.mesh = sharding.connection_for(connection, options.shard, options.mesh,
                                                        self.layout_owners)
        self.connection = connection
        self.options = options
        self.namespace = namespace
        self.say = say
        self.bar = bar
        self.view = view
        self.report = TrainReport(strategy=connection.strategy_name,
                                  replicas=connection.replicas)
        self.last_model: Any = None
        self.last_fit: FitCall | None = None
        self.stop_event: threading.Event | None = None  # set: stop at the next batch
        self.inputs = Inputs(connection, self._note, self.report.left_out,
                             lambda model: self._name_of(model) or model.name)
        self.checkpoints: checkpoints.CellCheckpoints | None = None  # --checkpoint
        self.precision: precision.Precision | None = None
        self.flops = utilization.FlopCounts(connection.backend)
        self.verified = False  # the cell's first fit ran the parity check (or skipped it)
        self.agreed = agreed
        # around each Keras call the cell makes (an engine of several hosts tells the
        # notebook where it is: `hosts.progress.in_call`)
        self.watch = watch or (lambda name: contextlib.nullcontext())

    def run(self, execute: Callable[[], Any], cell: str) -> TrainReport:
        """Rewraps the models the cell names, then runs it with the strategy in force."""
        __tracebackhide__ = True  # noqa: F841 - the cell's own errors show the cell, not us
        start = time.perf_counter()
        self.code = cell
        if self.options.batch_size is not None:  # a bad flag fails before anything runs
            plan_batches(self.options.batch_size, self.connection.replicas, what="--batch-size")
        if self.options.checkpoint is not None:
            self.checkpoints = checkpoints.CellCheckpoints(
                self.options.checkpoint, self.options.keep, self.options.resume)
        if self.options.precision is not None:
            self.precision = precision.for_connection(self.options.precision, self.connection)
            self.report.precision = self.precision.describe()
        if self.connection.replicas > 1 and hand_written_loop(cell):
            return self._run_on_one_device(execute, start)
        self._follow_users_distribution()
        strategy = self.connection.strategy
        for done in rewrap_namespace(self.namespace, names_in(cell), self.connection):
            line = done.summary(self.connection.strategy_name, self.connection.replicas)
            self.report.rewrapped.extend(done.names)
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
            self.report.seconds = time.perf_counter() - start
            self.report.model_name = self._name_of(self.last_model)
            self._adopt_namespace()
            if self.mesh is not None and self.last_model is not None:
                self.report.sharding, notes = sharding.of_model(self.connection,
                                                                self.last_model, self.mesh)
                for note in notes:
                    self._note(note, "warning: ")
        return self.report

    def _run_on_one_device(self, execute: Callable[[], Any], start: float) -> TrainReport:
        """A cell with its own GradientTape loop runs as a plain cell, on one device (see
        `ONE_DEVICE`)."""
        __tracebackhide__ = True  # noqa: F841
        self._note(ONE_DEVICE.format(replicas=self.connection.replicas))
        try:
            with precision.in_force(self.precision):
                execute()
        finally:
            self.report.seconds = time.perf_counter() - start
        return self.report

    def _adopt_namespace(self) -> None:
        """Models the cell left in the namespace that belong to the strategy keep routing."""
        for name, value in list(self.namespace.items()):
            if isinstance(value, keras.Model) and not name.startswith("_") and \
                    built_for(value, self.connection):
                self._adopt(value)

    def _adopt(self, model: Any) -> None:
        """Outside cells the model keeps routing: Keras's own output, no flags."""
        if not routing.adopted(model):
            routing.adopt(model, TrainingCell(self.connection, TrainOptions(progress=False),
                                              self.namespace, say=self.say))

    def fit_again(self, last: FitCall, stop_event: threading.Event | None = None) -> TrainReport:
        """Repeats a recorded `fit` from the current weights with this cell's batch and epochs.

        Args:
            last: the `fit` to repeat (its data, validation data and callbacks).
            stop_event: when set, training stops at the next batch boundary.
        """
        start, self.stop_event = time.perf_counter(), stop_event
        call = dict(last.arguments, initial_epoch=0, verbose=0)
        named = set(last.named) - {"batch_size", "epochs", "initial_epoch"}
        try:
            with self.connection.strategy.scope(), routing.inside_keras(), \
                    self.connection.backend.replica_steps(last.model, self.connection):
                self._fit(last.model, call, named)
        finally:
            self.report.seconds = time.perf_counter() - start
            self.report.model_name = self._name_of(self.last_model)
        return self.report

    # -- routing ---------------------------------------------------------------------------

    def route(self, name: str, model: Any, call: dict, named: set) -> Any:
        """`model.<name>(...)` through tpu_magic (see `routing`)."""
        with self.watch(name):
            return self._route(name, model, call, named)

    def _route(self, name: str, model: Any, call: dict, named: set) -> Any:
        self._follow_users_distribution()
        if built_outside(model, self.connection):
            self._place(model)
        self._adopt(model)
        planning.as_arrays(call)
        with self.connection.strategy.scope(), routing.inside_keras(), \
                self.connection.backend.replica_steps(model, self.connection):
            return getattr(self, "_" + name)(model, call, named)

    def _follow_users_distribution(self) -> None:
        """A distribution the user's own code put in force (before the cell or in it) wins
        over tpu_magic's: the cell's calls train with it from now on, said once."""
        found = self.connection.backend.users_distribution(self.connection)
        if found is None:
            return
        ours = self.connection.strategy_name
        self.connection, described = found
        self.mesh = None
        self.inputs = Inputs(self.connection, self._note, self.report.left_out,
                             lambda model: self._name_of(model) or model.name)
        self.report.strategy, self.report.replicas = (self.connection.strategy_name,
                                                      self.connection.replicas)
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
                                  self.options.batch_size, key, label=self._name_of(model))
        for warning in plan.warnings:
            self._note(warning, "warning: ")
        return plan

    def _note(self, text: str, prefix: str = "note: ") -> None:
        """Tells the user once per cell, and keeps it in the report."""
        if text not in self.report.notes:
            self.report.notes.append(text)
            self.say(prefix + text)

    def _prepare(self, model: Any) -> None:
        for note in prepare(model, self.connection, self.options.steps_per_execution,
                            self.precision, self._name_of(model) or model.name):
            self._note(note)

    def _name_of(self, model: Any) -> str | None:
        return name_of(self.namespace, model)

    def _first_step_check(self, model: Any) -> parity.FirstStep | None:
        """The parity check of the cell's first fit (see `parity`), where it applies."""
        connection = self.connection
        if not self.options.verify or self.verified or \
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
        return parity.FirstStep(backend.step_state, self.inputs.first_batches, reference,
                                parity.LOW_PRECISION_TOLERANCE if low else parity.TOLERANCE,
                                likely, draws, where, self.agreed, inference,
                                backend.step_logs)

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
        if "epochs" not in named and self.options.epochs is not None:
            call["epochs"] = self.options.epochs
        if self.options.scale_lr:
            note = planning.scale_learning_rate(model, plan)
            if note:
                self._note(note, "")
        self._prepare(model)
        seed, resume_from = arrays.new_seed(), None
        if self.checkpoints is not None:
            resume_from = self.checkpoints.resume(
                call["epochs"], lambda text: self._note(text, "warning: "), self.say,
                model, self.connection)
            if resume_from is not None:
                self.report.resumed_from = str(resume_from.path)
                seed, call["initial_epoch"] = resume_from.seed, resume_from.epoch
        batch = self.inputs.for_fit(model, call, plan, seed)
        if batch and not plan.global_batch:  # a dataset's batch, where it says so
            plan = plan_batches(batch, self.connection.replicas, what="the dataset's batch")
        _plan_memory(self, model, call["x"])  # before anything runs: it may refuse
        timing = FitTiming(global_batch=batch, flops_per_sample=self.flops.per_sample(model),
                           tokens_per_sample=utilization.tokens_per_sample(recorded.arguments["x"]))
        first_batches = self.inputs.first_batches
        progress = FitProgress(
            timing, bar=self.bar if self.options.progress else None, view=self.view,
            batch_of=lambda: given_batch_size(call["x"]),
            tokens_of=None if arrays.is_array_input(recorded.arguments["x"])
            else lambda: utilization.first_batch_tokens(first_batches))
        saver = (self.checkpoints.callback(seed, self.connection, resume_from)
                 if self.checkpoints is not None else None)
        check = self._first_step_check(model)
        call["callbacks"] = _callbacks(call.get("callbacks"), progress, saver, self.stop_event,
                                       self.connection, check)
        if self.options.progress:
            call["verbose"] = 0
        interrupted, failure = False, None
        compiled_before = self.connection.backend.compile_counts()
        with stop_on_interrupt(model) as stop, self.connection.strategy.scope(), \
                _default_shuffle_unsaid("shuffle" not in named):
            try:
                history = routing.keras_method("fit")(model, **call)
            except KeyboardInterrupt:
                interrupted, history = True, getattr(model, "history", None)
            except CheckpointError as exc:  # e.g. a full disk: stop, keep what was learned
                failure, history = exc, getattr(model, "history", None)
            finally:
                progress.close(interrupted=interrupted or stop.requested)
        ctrl_c = interrupted or stop.requested
        stopped = self.stop_event is not None and self.stop_event.is_set()
        interrupted = ctrl_c or stopped or failure is not None
        if not plan.global_batch:  # a dataset's batch, known once Keras read it
            plan = _seen_plan(given_batch_size(call["x"]), self.connection.replicas)
        self.report.add_fit(plan, timing, history, interrupted)
        if check is not None and check.outcome is not None:
            self.report.parity = check.outcome
            warning = check.outcome.warning()
            if warning:
                self._note(warning, "warning: ")
        self.last_model, self.last_fit = model, recorded
        self.report.utilization = utilization.of_fit(
            self.connection, self.flops.counted(model), timing.samples_per_second,
            timing.steady_seconds / timing.steady_steps if timing.steady_steps else None,
            self.inputs.measurable, self.options.measured_tflops)
        if compiled_before is not None:
            self.report.xla_compile = self.connection.backend.compile_counts() - compiled_before
        if saver is not None:
            self.report.checkpoints.extend(str(p) for p in saver.written)
            warnings, notes = self.checkpoints.outcome(saver)
            for text in warnings:
                self._note(text, "warning: ")
            for text in notes:
                self._note(text)
        if failure is not None:
            raise failure
        if interrupted:
            self.say(_interrupted(timing.steps_done, ctrl_c))
        if ctrl_c:  # as in any Python cell, an interrupt ends it: the lines after fit don't run
            __tracebackhide__ = True  # noqa: F841 - IPython shows the user's line, not ours
            raise KeyboardInterrupt
        return history

    def _evaluate(self, model: Any, call: dict, named: set) -> Any:
        plan = self._plan("evaluate", model, call, named)
        self._prepare(model)
        rest = self.inputs.for_evaluate(model, call, plan)
        if self.options.progress:
            call["verbose"] = 0
        wanted_dict = call.get("return_dict", False)
        call["return_dict"] = True
        result = routing.keras_method("evaluate")(model, **call)
        if rest is not None:
            result = self._evaluate_rest(model, rest) or result
        self.report.evaluations.append({k: float(v) for k, v in result.items()})
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
            self._note(f"evaluate left out its last {self.report.left_out.get('evaluate')} "
                       f"samples: a one-device copy of {self._name_of(model) or model.name!r} "
                       f"could not evaluate them ({type(exc).__name__}: {exc})")
            return None
        if result is not None:
            self.report.left_out.pop("evaluate", None)
        return result

    def _predict(self, model: Any, call: dict, named: set) -> Any:
        plan = self._plan("predict", model, call, named)
        self._prepare(model)
        if self.options.progress:
            call["verbose"] = 0
        rows = self.inputs.for_predict(model, call, plan)
        out = routing.keras_method("predict")(model, **call)
        out = out if rows is None else arrays.trim(out, rows)
        self.report.predictions.append(len(keras.tree.flatten(out)[0]))
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


def _plan_memory(cell: TrainingCell, model: Any, data: Any) -> None:
    """The memory plan before the first step (`--shard model`, `--plan-for`), and
    `--shard auto`'s choice: where data parallelism does not fit, the model is laid out over
    the mesh that does, and the cell trains there from now on."""
    options = cell.options
    if (options.shard or "").lower() == "auto" and cell.mesh is None:
        connection, mesh, cell.report.memory_plan = memory_plan.choose(
            cell.connection, model, data, options.plan_for, cell.layout_owners)
        if mesh is not None:
            connection.backend.reshard(model, connection)
            cell.connection, cell.mesh = connection, mesh
            cell.report.strategy, cell.report.replicas = connection.strategy_name, mesh[0]
    elif cell.mesh or options.plan_for:
        cell.report.memory_plan = memory_plan.before_fit(cell.connection, model, data,
                                                         options.plan_for)


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
