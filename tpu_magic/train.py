"""Running a cell's Keras training on the connection's strategy: the cell's orchestration.

`fit`, `evaluate` and `predict` of the models a `%%tpu_train` cell runs (and, later, of
the models it built or rewrapped: see `routing`) go through `TrainingCell`: the batch
is checked before anything runs, NumPy inputs become whole batches (see `backends.tf_data`,
`backends.jax_data`), padding is masked out of losses and metrics (see `exactness`), and `fit`
gets a live progress bar and a report.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping

import keras
import numpy as np

from tpu_magic import arrays, checkpointing, exactness, planning, precision, routing, utilization
from tpu_magic.agreement import ReplicasAgree
from tpu_magic.batching import BatchPlan, plan_batches, scaled_learning_rate
from tpu_magic.checkpoint import CheckpointStore, Checkpointing
from tpu_magic.errors import CheckpointError, InputError, RewrapError
from tpu_magic.planning import is_dataset
from tpu_magic.progress import FitProgress, FitTiming, TrainingView
from tpu_magic.report import TrainReport
from tpu_magic.cell_code import hand_written_loop, names_in
from tpu_magic.rewrap import built_for, built_outside, rewrap_namespace
from tpu_magic.session import Connection
from tpu_magic.stopping import StopOnEvent, stop_on_interrupt
from tpu_magic.utilization import Utilization
from tpu_magic.variables import name_of

_ORIGINAL = routing.ORIGINAL
# The learning rate each model had before --scale-lr first scaled it.
_base_learning_rate: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()


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

    After `run` or `fit_again`, `report` is the outcome, and `last_fit` the last `fit`
    the cell made (what the panel's Train repeats). It writes no shared state.
    """

    def __init__(self, connection: Connection, options: TrainOptions,
                 namespace: MutableMapping[str, Any], say: Callable[[str], None] = print,
                 bar: Any = None, view: TrainingView | None = None):
        self.connection = connection
        self.options = options
        self.namespace = namespace
        self.say = say
        self.bar = bar
        self.view = view
        self.report = TrainReport(strategy=type(connection.strategy).__name__,
                                  replicas=connection.replicas)
        self.last_model: Any = None
        self.last_fit: FitCall | None = None
        self.stop_event: threading.Event | None = None  # set: stop at the next batch
        self.data = connection.backend.inputs()
        self.store: CheckpointStore | None = None
        self._resume_pending = False
        self.precision: precision.Precision | None = None
        self._counted: "weakref.WeakKeyDictionary[Any, tuple[float, str] | None]" = \
            weakref.WeakKeyDictionary()

    def run(self, execute: Callable[[], Any], cell: str) -> TrainReport:
        """Rewraps the models the cell names, then runs it with the strategy in force."""
        __tracebackhide__ = True  # noqa: F841 - the cell's own errors show the cell, not us
        start = time.perf_counter()
        strategy = self.connection.strategy
        if self.options.batch_size is not None:  # a bad flag fails before anything runs
            plan_batches(self.options.batch_size, self.connection.replicas, what="--batch-size")
        if self.options.checkpoint is not None:
            self.store = checkpointing.open_store(self.options.checkpoint, self.options.keep,
                                                  self.options.resume)
            self._resume_pending = self.options.resume
        if self.options.precision is not None:
            self.precision = precision.choose(self.options.precision, self.connection.kind,
                                              self._bf16_chip())
            self.report.precision = self.precision.describe()
        if self.connection.replicas > 1 and hand_written_loop(cell):
            return self._run_on_one_device(execute, start)
        for done in rewrap_namespace(self.namespace, names_in(cell), self.connection):
            line = done.summary(type(strategy).__name__, self.connection.replicas)
            self.report.rewrapped.extend(done.names)
            self.say(line)
        try:
            with strategy.scope(), routing.cell(self), precision.in_force(self.precision):
                execute()
        finally:
            self.report.seconds = time.perf_counter() - start
            self.report.model_name = self._name_of(self.last_model)
            self._adopt_namespace()
        return self.report

    def _run_on_one_device(self, execute: Callable[[], Any], start: float) -> TrainReport:
        """A cell with its own GradientTape loop runs as a plain cell, on one device: its
        steps are not `strategy.run` calls, and its optimizer would update replicated
        variables from outside a replica (TensorFlow: "DistributedVariable.handle is not
        available outside the replica context")."""
        __tracebackhide__ = True  # noqa: F841
        self._note("this cell trains with its own tf.GradientTape loop, so it runs as a plain "
                   "cell on one device, with plain Keras's numbers. To train on all "
                   f"{self.connection.replicas} replicas, put the step in a train_step method "
                   "and call fit (keras.io: 'Customizing what happens in fit()').")
        try:
            with precision.in_force(self.precision):
                execute()
        finally:
            self.report.seconds = time.perf_counter() - start
        return self.report

    def _bf16_chip(self) -> bool | None:
        """Whether the connected GPU computes bfloat16 (None: not a GPU, or not known)."""
        if self.connection.kind != "gpu":
            return None
        chip = self.connection.backend.device_view(self.connection, {}).chip
        return None if chip is None else chip.bf16

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
        start = time.perf_counter()
        self.stop_event = stop_event
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
        if built_outside(model, self.connection):
            label = self._name_of(model) or model.name
            raise RewrapError(
                f"model {label!r} was built outside {type(self.connection.strategy).__name__}, and "
                "this cell reaches it without naming it. Name it in the cell (tpu_magic rebuilds "
                "the models a cell names) or build it inside the %%tpu_train cell."
            )
        self._adopt(model)
        planning.as_arrays(call)
        with self.connection.strategy.scope(), routing.inside_keras(), \
                self.connection.backend.replica_steps(model, self.connection):
            return getattr(self, "_" + name)(model, call, named)

    # -- shared steps ----------------------------------------------------------------------

    def _plan(self, method: str, model: Any, call: dict, named: set,
              key: str = "batch_size") -> BatchPlan:
        plan = planning.plan_call(method, model, call, named, self.connection,
                                  self.options.batch_size, key, label=self._name_of(model))
        for warning in plan.warnings:
            self._note(warning, "warning: ")
        return plan

    def _padded_batch(self, plan: BatchPlan, model: Any, samples: int, drop: bool = False) -> int:
        return planning.padded_batch(plan, model, samples, self.connection, drop)

    def _exact(self, model: Any, has_targets: bool) -> bool:
        """Whether padding can be masked out for this model; else say what happens instead."""
        why = exactness.why_not_exact(model, has_targets)
        if why is None:
            return True
        self._note(f"model {self._name_of(model) or model.name!r}: {why}")
        return False

    def _note(self, text: str, prefix: str = "note: ") -> None:
        """Tells the user once per cell, and keeps it in the report."""
        if text not in self.report.notes:
            self.report.notes.append(text)
            self.say(prefix + text)

    def _prepare(self, model: Any) -> None:
        """Per-model settings, and a retrace the first time tpu_magic runs the model."""
        k = self.options.steps_per_execution or model.steps_per_execution
        retrace = not getattr(model, "_tpu_magic_traced", False)
        cannot = self.connection.backend.steps_per_execution_note(self.connection, k)
        if cannot:
            self._note(cannot)
            k = 1
        if model.steps_per_execution != k:
            model.steps_per_execution = k
            retrace = True
        cannot_jit = self.connection.backend.jit_compile_note(self.connection, model)
        if cannot_jit:
            self._note(cannot_jit)
            model.jit_compile = False
            retrace = True
        _mark_built_without_call(model)
        if exactness.enable(model):
            retrace = True
        if self._keep_outputs_float32(model):
            retrace = True
        if retrace:
            # Functions traced before the exactness overrides would count padded samples.
            model.train_function = model.test_function = model.predict_function = None
            model._tpu_magic_traced = True

    def _flops(self, model: Any) -> float | None:
        """Training FLOPs of one sample (once per model and cell), where they can be told."""
        if model not in self._counted:
            self._counted[model] = self.connection.backend.training_flops(model)
        counted = self._counted[model]
        return None if counted is None else counted[0]

    def _utilization(self, model: Any, timing: FitTiming, dataset: Any) -> Utilization | None:
        """Achieved TFLOP/s against the peaks, and the input's share of a step."""
        if not timing.samples_per_second:
            return None
        counted = self._counted.get(model)
        replicas = self.connection.replicas
        chip = self.connection.backend.device_view(self.connection, {}).chip
        wait = utilization.input_need(dataset, timing.steady_seconds / timing.steady_steps)
        return Utilization(
            flops_per_sample=counted[0] if counted else None,
            source=counted[1] if counted else "",
            achieved_tflops=utilization.achieved(counted[0] if counted else None,
                                                 timing.samples_per_second),
            nominal_tflops=chip.device_peak_tflops * replicas if chip else None,
            # simulated replicas share one CPU: its measured peak is all they have together
            measured_tflops=(self.options.measured_tflops
                             * (1 if self.connection.simulated else replicas)
                             if self.options.measured_tflops else None),
            input_share=wait[0] if wait else None, input_how=wait[1] if wait else "",
            input_bound=bool(wait and wait[2]))

    def _keep_outputs_float32(self, model: Any) -> bool:
        """Under a 16-bit policy: output activations in float32 (Keras's advice); a model
        built before the cell keeps its float32 and is named. True where a layer changed."""
        chosen = self.precision
        if chosen is None or not precision.low_precision(chosen.policy):
            return False
        label = self._name_of(model) or model.name
        if not precision.low_precision(model.dtype_policy):
            self._note(f"model {label!r} was built before this cell with "
                       f"{model.dtype_policy.name}: it keeps float32 variables and compute. "
                       f"Build it inside the %%tpu_train cell to train in {chosen.policy}.")
            return False
        if not chosen.mixed:
            self._note(f"{chosen.policy}: variables and outputs are bfloat16 too; "
                       "--precision mixed_bf16 keeps variables and output activations in "
                       "float32 (Keras's advice)")
            return False
        changed = precision.float32_outputs(model)
        if changed:
            self._note(f"{chosen.policy}: the output layer{'s' * (len(changed) > 1)} "
                       f"{', '.join(changed)} compute{'s' * (len(changed) == 1)} in float32, "
                       "as Keras's mixed precision guide advises (a softmax or sigmoid in 16 "
                       "bits loses precision); the rest computes in 16 bits, variables float32")
        return bool(changed)

    def _scale_learning_rate(self, model: Any, plan: BatchPlan) -> None:
        optimizer = getattr(model, "optimizer", None)
        if not self.options.scale_lr or optimizer is None:
            return
        if isinstance(optimizer.learning_rate, keras.optimizers.schedules.LearningRateSchedule) or \
                isinstance(getattr(optimizer, "_learning_rate", None),
                           keras.optimizers.schedules.LearningRateSchedule):
            note = "--scale-lr: the learning rate is a schedule, left as it is"
        else:
            base = _base_learning_rate.setdefault(model, float(optimizer.learning_rate.numpy()))
            scaled = scaled_learning_rate(base, plan)
            optimizer.learning_rate = scaled
            note = (f"--scale-lr: learning rate {base:g} → {scaled:g} (×{plan.replicas}: global "
                    f"batch {plan.global_batch} = {plan.replicas} × {plan.per_replica} per replica)")
        self._note(note, "")

    def _name_of(self, model: Any) -> str | None:
        return name_of(self.namespace, model)

    # -- the three methods -----------------------------------------------------------------

    def _fit(self, model: Any, call: dict, named: set) -> Any:
        recorded = FitCall(model, dict(call), frozenset(named))
        plan = self._plan("fit", model, call, named)
        if "epochs" not in named and self.options.epochs is not None:
            call["epochs"] = self.options.epochs
        self._scale_learning_rate(model, plan)
        self._prepare(model)
        seed, resume_from = arrays.new_seed(), None
        if self._resume_pending:  # the cell's first fit continues from the newest checkpoint
            self._resume_pending = False
            point = checkpointing.resume_point(self.store, call["epochs"])
            for warning in point.warnings:
                self._note(warning, "warning: ")
            self.say(point.message)
            resume_from = point.checkpoint
            if resume_from is not None:
                self.report.resumed_from = str(resume_from.path)
                seed, call["initial_epoch"] = resume_from.seed, resume_from.epoch
        x, y, weights = call["x"], call["y"], call["sample_weight"]
        batch = plan.global_batch
        if arrays.is_array_input(x) and (y is None or arrays.is_array_input(y)):
            split = call.get("validation_split") or 0.0
            if split and call.get("validation_data") is None:
                (x, y, weights), call["validation_data"] = planning.split_validation(
                    x, y, weights, split)
                call["validation_split"] = 0.0
            weights = planning.fold_class_weight(y, weights, call.get("class_weight"))
            call["class_weight"] = None
            if y is None and weights is not None:
                raise InputError("fit got sample_weight but no targets (y): weights apply to "
                                 "a loss against targets; pass y, or leave sample_weight out")
            drop = not self._exact(model, y is not None)
            endless = self.connection.backend.repeats_input(
                model.steps_per_execution, call.get("steps_per_epoch") is not None)
            batch = self._padded_batch(plan, model, arrays.num_samples(x), drop=drop)
            train = self.data.train_pipeline(
                x, y, weights, batch, shuffle=bool(call.get("shuffle", True)), repeat=endless,
                seed=seed, first_epoch=call.get("initial_epoch") or 0,
                strategy=self.connection.strategy, drop=drop)
            self._count_left_out("fit", train)
            call.update(x=train.dataset, y=None, sample_weight=None, batch_size=None, shuffle=False,
                        steps_per_epoch=call.get("steps_per_epoch") or (train.steps if endless else None))
        elif is_dataset(x) and not call.get("class_weight"):  # Keras maps class weights in
            call["x"] = self._whole_dataset(model, x, plan.global_batch)
        self._validation(model, call, named, plan)
        timing = FitTiming(global_batch=batch, flops_per_sample=self._flops(model))
        progress = FitProgress(timing, bar=self.bar if self.options.progress else None,
                               view=self.view)
        call["callbacks"] = list(call.get("callbacks") or []) + [progress]
        if self.connection.replicas > 1:  # one set of BatchNorm statistics, as its copy has
            call["callbacks"].append(ReplicasAgree(self.connection.backend))
        saver = None
        if self.store is not None:  # first, so every other callback sees restored weights
            saver = Checkpointing(self.store, seed, self.connection, resume_from)
            call["callbacks"].insert(0, saver)
        if self.stop_event is not None:
            call["callbacks"].append(StopOnEvent(self.stop_event))
        if self.options.progress:
            call["verbose"] = 0
        interrupted, failure = False, None
        compiled_before = self.connection.backend.compile_counts()
        with stop_on_interrupt(model) as stop:
            try:
                history = _ORIGINAL["fit"](model, **call)
            except KeyboardInterrupt:
                interrupted, history = True, getattr(model, "history", None)
            except CheckpointError as exc:  # e.g. a full disk: stop, keep what was learned
                failure, history = exc, getattr(model, "history", None)
            finally:
                progress.close(interrupted=interrupted or stop.requested)
        ctrl_c = interrupted or stop.requested
        stopped = self.stop_event is not None and self.stop_event.is_set()
        interrupted = ctrl_c or stopped or failure is not None
        self._record_fit(recorded, plan, timing, history, interrupted)
        self.report.utilization = self._utilization(model, timing, call["x"])
        if compiled_before is not None:
            self.report.xla_compile = self.connection.backend.compile_counts() - compiled_before
        if saver is not None:
            self._record_checkpoints(saver)
        if failure is not None:
            raise failure
        if interrupted:
            self.say(f"Interrupted after {timing.steps_done} steps: the model keeps the weights "
                     "learned so far" + (", and the rest of the cell does not run." if ctrl_c
                                         else "."))
        if ctrl_c:  # as in any Python cell, an interrupt ends it: the lines after fit don't run
            __tracebackhide__ = True  # noqa: F841 - IPython shows the user's line, not ours
            raise KeyboardInterrupt
        return history

    # -- checkpoints -----------------------------------------------------------------------

    def _record_checkpoints(self, saver: Checkpointing) -> None:
        self.report.checkpoints.extend(str(p) for p in saver.written)
        for moved in self.store.take_moved_aside():
            self._note(moved, "warning: ")
        for note in (checkpointing.not_finite_note(saver, self.store),
                     checkpointing.cut_short_note(saver, self.store)):
            if note:
                self._note(note)

    def _validation(self, model: Any, call: dict, named: set, plan: BatchPlan) -> None:
        data = call.get("validation_data")
        if data is None:
            return
        if is_dataset(data):
            call["validation_data"] = self._whole_dataset(
                model, data, self.connection.backend.dataset_batch_size(data))
            return
        if not isinstance(data, (tuple, list)):  # a PyDataset or generator: Keras reads it
            return
        vx, vy, vw = (tuple(data) + (None, None))[:3]
        if not (arrays.is_array_input(vx) and (vy is None or arrays.is_array_input(vy))):
            return
        vplan = planning.validation_plan(call, plan, model, self.connection)
        drop = not self._exact(model, vy is not None)
        evaluation = self.data.eval_pipeline(
            vx, vy, vw, self._padded_batch(vplan, model, arrays.num_samples(vx), drop=drop),
            strategy=self.connection.strategy, drop=drop)
        self._count_left_out("validation", evaluation)
        call.update(validation_data=evaluation.dataset, validation_batch_size=None,
                    validation_steps=call.get("validation_steps") or evaluation.steps)

    def _whole_dataset(self, model: Any, data: Any, batch: int | None) -> Any:
        """A user's dataset as whole batches: padded with the padding masked out where the
        model's loss takes the mask, else every batch cut to equal shares per replica (a
        custom step or an inputs-only dataset: no replica gets an empty or smaller share)."""
        if not batch and self.connection.replicas == 1:
            return data
        return self.connection.backend.whole_dataset(
            data, batch, self.connection.strategy, self._note,
            masked=bool(batch) and exactness.masks_reach_loss(model, has_targets=True))

    def _count_left_out(self, what: str, pipeline: arrays.Pipeline) -> None:
        if pipeline.left_out:
            self.report.left_out[what] = pipeline.left_out

    def _record_fit(self, recorded: FitCall, plan, timing, history, interrupted) -> None:
        model = recorded.model
        r = self.report
        r.fits += 1
        r.global_batch, r.per_replica = plan.global_batch, plan.per_replica
        r.epochs = len(timing.epoch_seconds)
        r.steps = timing.steps_done
        r.compile_seconds = timing.compile_seconds
        r.samples_per_second = timing.samples_per_second
        r.epoch_seconds = list(timing.epoch_seconds)
        r.metrics = dict(timing.last_logs)
        r.history = history
        r.interrupted = interrupted
        r.diverged = timing.diverged_text()
        self.last_model = model
        self.last_fit = recorded

    def _evaluate(self, model: Any, call: dict, named: set) -> Any:
        plan = self._plan("evaluate", model, call, named)
        self._prepare(model)
        x, y, weights = call["x"], call["y"], call["sample_weight"]
        if arrays.is_array_input(x) and (y is None or arrays.is_array_input(y)):
            drop = not self._exact(model, y is not None)
            evaluation = self.data.eval_pipeline(
                x, y, weights, self._padded_batch(plan, model, arrays.num_samples(x), drop=drop),
                strategy=self.connection.strategy, drop=drop)
            self._count_left_out("evaluate", evaluation)
            call.update(x=evaluation.dataset, y=None, sample_weight=None, batch_size=None,
                        steps=call.get("steps") or evaluation.steps)
        elif is_dataset(x):
            call["x"] = self._whole_dataset(model, x, plan.global_batch)
        if self.options.progress:
            call["verbose"] = 0
        wanted_dict = call.get("return_dict", False)
        call["return_dict"] = True
        result = _ORIGINAL["evaluate"](model, **call)
        self.report.evaluations.append({k: float(v) for k, v in result.items()})
        if self.last_model is None:
            self.last_model = model
        # Keras's own ordering of a non-dict result (a scalar for a single value).
        return result if wanted_dict else model._flatten_metrics_in_order(result)

    def _predict(self, model: Any, call: dict, named: set) -> Any:
        plan = self._plan("predict", model, call, named)
        self._prepare(model)
        x = call["x"]
        if self.options.progress:
            call["verbose"] = 0
        if not arrays.is_array_input(x):
            out = _ORIGINAL["predict"](model, **call)
        else:
            rows = arrays.num_samples(x)
            if rows == 0:  # one batch of a zero row gives the outputs' shapes; 0 rows come back
                x = keras.tree.map_structure(lambda a: np.zeros((1,) + a.shape[1:], a.dtype), x)
            samples = self.data.predict_pipeline(
                x, self._padded_batch(plan, model, arrays.num_samples(x)),
                strategy=self.connection.strategy)
            call.update(x=samples.dataset, batch_size=None, steps=samples.steps)
            out = arrays.trim(_ORIGINAL["predict"](model, **call), rows)
        rows = len(keras.tree.flatten(out)[0])
        self.report.predictions.append(rows)
        return out

    def _predict_on_batch(self, model: Any, call: dict, named: set) -> Any:
        return self._predict(model, _predict_on_batch_call(call), {"x"})


def _predict_on_batch_call(call: dict) -> dict:
    """`predict_on_batch(x)` as the `predict` call that gives its rows (one batch's worth)."""
    return {"x": call["x"], "batch_size": None, "verbose": 0, "steps": None, "callbacks": None}


def _mark_built_without_call(model: Any) -> None:
    """A subclassed model with its own train_step and no `call()` (keras-io's VAE) counts as
    built once its layers are.

    Under a tf.distribute strategy Keras builds an unbuilt model symbolically before `fit`
    by calling it, and fails there ("does not have a `call()` method"); on one device it
    never calls it. The model has no variables of its own, so nothing is left unbuilt.
    """
    if model.built or type(model).call is not keras.Model.call:
        return
    layers = list(model._flatten_layers(include_self=False))
    if layers and all(layer.built for layer in layers):
        model.built = True
