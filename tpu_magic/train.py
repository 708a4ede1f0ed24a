"""Running a cell's Keras training on the session's strategy.

`fit`, `evaluate` and `predict` of the models a `%%tpu_train` cell runs (and, later, of
the models it built or rewrapped: see `routing`) go through `TrainingCell`: the batch
is checked before anything runs, NumPy inputs become whole batches (see `pipeline`,
`pydataset`), padding is masked out of losses and metrics (see `exactness`), and `fit`
gets a live progress bar and a report.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, MutableMapping

import keras

from tpu_magic import arrays, compile_cache, exactness, routing
from tpu_magic.batching import BatchPlan, plan_batches, scaled_learning_rate
from tpu_magic.checkpoint import Checkpoint, CheckpointStore, Checkpointing
from tpu_magic.errors import BatchSizeError, CheckpointError, InputError, RewrapError
from tpu_magic.progress import FitProgress, FitTiming, TrainingView
from tpu_magic.report import TrainReport
from tpu_magic.rewrap import built_for, built_outside, names_in, rewrap_namespace
from tpu_magic.session import Session

KERAS_DEFAULT_BATCH = 32
_ORIGINAL = routing.ORIGINAL
# The learning rate each model had before --scale-lr first scaled it.
_base_learning_rate: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class FitCall:
    """A `fit` as the cell made it: the model and its arguments (the panel's Train repeats it)."""

    model: Any
    arguments: dict
    named: frozenset


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


class TrainingCell:
    """Routes every Keras `fit`/`evaluate`/`predict` through tpu_magic while a cell runs.

    Args:
        session: the connected session.
        options: the cell's flags.
        namespace: the user's namespace (models are looked up and rebound there).
        say: prints one line to the user.
        bar: a tqdm-like class for progress bars (None: no bars).
        view: shows the training live too (the panel's training area).
    """

    def __init__(self, session: Session, options: TrainOptions,
                 namespace: MutableMapping[str, Any], say: Callable[[str], None] = print,
                 bar: Any = None, view: TrainingView | None = None):
        self.session = session
        self.options = options
        self.namespace = namespace
        self.say = say
        self.bar = bar
        self.view = view
        self.report = TrainReport(strategy=type(session.strategy).__name__,
                                  replicas=session.replicas)
        self.last_model: Any = None
        self.stop_event: threading.Event | None = None  # set: stop at the next batch
        self.data = _input_builder(session.backend)
        self.store: CheckpointStore | None = None
        self._resume_pending = False

    def run(self, execute: Callable[[], Any], cell: str) -> TrainReport:
        """Rewraps the models the cell names, then runs it with the strategy in force."""
        start = time.perf_counter()
        strategy = self.session.strategy
        if self.options.batch_size is not None:  # a bad flag fails before anything runs
            plan_batches(self.options.batch_size, self.session.replicas, what="--batch-size")
        if self.options.checkpoint is not None:
            self._open_checkpoints()
        for done in rewrap_namespace(self.namespace, names_in(cell), strategy):
            line = done.summary(type(strategy).__name__, self.session.replicas)
            self.report.rewrapped.extend(done.names)
            self.say(line)
        try:
            with strategy.scope(), routing.cell(self):
                execute()
        finally:
            self.report.seconds = time.perf_counter() - start
            self.report.model_name = self._name_of(self.last_model)
            self._adopt_namespace()
        return self.report

    def _adopt_namespace(self) -> None:
        """Models the cell left in the namespace that belong to the strategy keep routing."""
        for name, value in list(self.namespace.items()):
            if isinstance(value, keras.Model) and not name.startswith("_") and \
                    built_for(value, self.session.strategy):
                self._adopt(value)

    def _adopt(self, model: Any) -> None:
        """Outside cells the model keeps routing: Keras's own output, no flags."""
        if not routing.adopted(model):
            routing.adopt(model, TrainingCell(self.session, TrainOptions(progress=False),
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
            with self.session.strategy.scope(), routing.inside_keras():
                self._fit(last.model, call, named)
        finally:
            self.report.seconds = time.perf_counter() - start
            self.report.model_name = self._name_of(self.last_model)
        return self.report

    # -- routing ---------------------------------------------------------------------------

    def route(self, name: str, model: Any, call: dict, named: set) -> Any:
        """`model.<name>(...)` through tpu_magic (see `routing`)."""
        if built_outside(model, self.session.strategy):
            label = self._name_of(model) or model.name
            raise RewrapError(
                f"model {label!r} was built outside {type(self.session.strategy).__name__}, and "
                "this cell reaches it without naming it. Name it in the cell (tpu_magic rebuilds "
                "the models a cell names) or build it inside the %%tpu_train cell."
            )
        self._adopt(model)
        with self.session.strategy.scope(), routing.inside_keras():
            return getattr(self, "_" + name)(model, call, named)

    # -- shared steps ----------------------------------------------------------------------

    def _plan(self, method: str, model: Any, call: dict, named: set,
              key: str = "batch_size") -> BatchPlan:
        replicas = self.session.replicas
        # A batch size fixed in the Input is what each replica gets (Keras splits per replica).
        static = _static_batch(model)
        if static is not None and self.session.backend == "jax":
            # JAX's DataParallel traces the global batch, so a fixed Input batch is the global one.
            static = plan_batches(static, replicas, what="the batch fixed in the model's Input"
                                  ).per_replica
        data = call.get("x")
        self._refuse_strings(model, data)
        if _is_dataset(data):
            from tpu_magic.pipeline import dataset_batch_size  # a tf.data input: TF is there

            batch, what = dataset_batch_size(data), "the dataset's batch"
            if batch is None:
                return BatchPlan(0, replicas, 0)
        elif key in named and call.get(key) is not None:
            batch, what = call[key], key
        elif self.options.batch_size is not None:
            batch, what = self.options.batch_size, "--batch-size"
        elif static is not None:
            batch, what = static * replicas, key
        elif method == "fit":
            batch, what = KERAS_DEFAULT_BATCH, key  # Keras's default, advice included
        else:
            # evaluate/predict: any batch gives the same results, so pick one that fits.
            unit = replicas * (8 if self.session.tpu_rules else 1)
            batch, what = math.ceil(KERAS_DEFAULT_BATCH / unit) * unit, key
        plan = plan_batches(batch, replicas, tpu_rules=self.session.tpu_rules,
                            static_per_replica=static, what=what)
        for warning in plan.warnings:
            self._note(warning, "warning: ")
        return plan

    def _padded_batch(self, plan: BatchPlan, model: Any, samples: int, drop: bool = False) -> int:
        """The batch NumPy data is cut into: a batch larger than the data shrinks to the data,
        rounded up to whole replicas (the same results without padding, say, 10**9 rows);
        with `drop` (no padding), rounded down instead."""
        if _static_batch(model) is not None:
            return plan.global_batch
        unit = plan.replicas * (8 if self.session.tpu_rules else 1)
        if not drop:
            return min(plan.global_batch, max(1, math.ceil(samples / unit)) * unit)
        whole = (samples // unit) * unit or (samples // plan.replicas) * plan.replicas
        if not whole:
            raise BatchSizeError(
                f"{samples} sample{'s' * (samples != 1)} cannot fill one batch over "
                f"{plan.replicas} replicas, and this model's loss cannot skip padding: pass at "
                f"least {plan.replicas} samples")
        return min(plan.global_batch, whole)

    def _refuse_strings(self, model: Any, data: Any) -> None:
        """Strings cannot be split over replicas, nor go to a TPU: say where they belong."""
        if self.session.replicas == 1 and self.session.kind != "tpu":
            return
        found = arrays.string_input(model, data)
        if found is not None:
            raise InputError(
                f"model {self._name_of(model) or model.name!r} gets strings ({found}): a TPU "
                "cannot run string ops and replicas cannot split them. Move the text "
                "vectorization into the tf.data pipeline, `dataset.map(lambda x, y: "
                "(vectorize_layer(x), y))`, and give the model its integer output (as the Keras "
                "TPU guides do); keep a model with the TextVectorization layer for inference "
                "on the CPU.")

    def _exact(self, model: Any, has_targets: bool) -> bool:
        """Whether padding can be masked out for this model; else say what happens instead."""
        if exactness.masks_reach_loss(model, has_targets):
            return True
        why = ("it has no targets or compiled loss (its loss comes from add_loss)"
               if exactness.keras_steps(model) else
               "its train_step/test_step/compute_loss/compute_metrics are its own and may "
               "ignore sample weights")
        self._note(f"model {self._name_of(model) or model.name!r}: {why}, so padded samples "
                   "could reach its loss. tpu_magic feeds it whole batches of real samples "
                   "only: fit leaves out the last few samples of each epoch's shuffled order "
                   "(different ones each epoch), evaluate the last few samples, each fewer "
                   "than one batch (the report counts them).")
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
        if k > 1 and self.session.replicas > 1 and \
                type(self.session.strategy).__name__ == "MirroredStrategy":
            self._note(f"steps_per_execution {k} fails in Keras 3 under MirroredStrategy with "
                       f"{self.session.replicas} replicas (keras-team/keras#19246): running 1 step "
                       "per execution here; on a TPU it applies.")
            k = 1
        if model.steps_per_execution != k:
            model.steps_per_execution = k
            retrace = True
        _mark_built_without_call(model)
        if exactness.enable(model):
            retrace = True
        if retrace:
            # Functions traced before the exactness overrides would count padded samples.
            model.train_function = model.test_function = model.predict_function = None
            model._tpu_magic_traced = True

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
        if model is None:
            return None
        names = sorted(k for k, v in self.namespace.items() if v is model and not k.startswith("_"))
        return names[0] if names else None

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
            resume_from = self._resume_point(call["epochs"])
            if resume_from is not None:
                seed, call["initial_epoch"] = resume_from.seed, resume_from.epoch
        x, y, weights = call["x"], call["y"], call["sample_weight"]
        batch = plan.global_batch
        if arrays.is_array_input(x) and (y is None or arrays.is_array_input(y)):
            split = call.get("validation_split") or 0.0
            if split and call.get("validation_data") is None:
                cut = int(math.floor(arrays.num_samples(x) * (1.0 - split)))
                head, tail = _split((x, y, weights), cut)
                (x, y, weights), call["validation_data"] = head, tail
                call["validation_split"] = 0.0
            weights = self._class_weighted(y, weights, call)
            if y is None and weights is not None:
                raise InputError("fit got sample_weight but no targets (y): weights apply to "
                                 "a loss against targets; pass y, or leave sample_weight out")
            drop = not self._exact(model, y is not None)
            # tf.data repeats (no stall at each epoch start); a PyDataset (JAX) is asked per epoch.
            endless = self.session.backend == "tf" and (
                model.steps_per_execution == 1 or call.get("steps_per_epoch") is not None)
            batch = self._padded_batch(plan, model, arrays.num_samples(x), drop=drop)
            train = self.data.train_pipeline(
                x, y, weights, batch, shuffle=bool(call.get("shuffle", True)), repeat=endless,
                seed=seed, first_epoch=call.get("initial_epoch") or 0,
                strategy=self.session.strategy, drop=drop)
            self._count_left_out("fit", train)
            call.update(x=train.dataset, y=None, sample_weight=None, batch_size=None, shuffle=False,
                        steps_per_epoch=call.get("steps_per_epoch") or (train.steps if endless else None))
        elif _is_dataset(x) and not call.get("class_weight"):  # Keras maps class weights in
            call["x"] = self._whole_dataset(model, x, plan.global_batch)
        self._validation(model, call, named, plan)
        timing = FitTiming(global_batch=batch)
        progress = FitProgress(timing, bar=self.bar if self.options.progress else None,
                               view=self.view)
        call["callbacks"] = list(call.get("callbacks") or []) + [progress]
        saver = None
        if self.store is not None:  # first, so every other callback sees restored weights
            saver = Checkpointing(self.store, seed, self.session.strategy, resume_from)
            call["callbacks"].insert(0, saver)
        if self.stop_event is not None:
            call["callbacks"].append(_StopOnEvent(self.stop_event))
        if self.options.progress:
            call["verbose"] = 0
        interrupted, failure = False, None
        compiled_before = compile_cache.counts()
        with _stop_on_interrupt(model) as stop:
            try:
                history = _ORIGINAL["fit"](model, **call)
            except KeyboardInterrupt:
                interrupted, history = True, getattr(model, "history", None)
            except CheckpointError as exc:  # e.g. a full disk: stop, keep what was learned
                failure, history = exc, getattr(model, "history", None)
            finally:
                progress.close(interrupted=interrupted or stop.requested)
        stopped = self.stop_event is not None and self.stop_event.is_set()
        interrupted = interrupted or stop.requested or stopped or failure is not None
        self._record_fit(recorded, plan, timing, history, interrupted)
        if compiled_before is not None:
            self.report.xla_compile = compile_cache.counts() - compiled_before
        if saver is not None:
            self._record_checkpoints(saver)
        if failure is not None:
            raise failure
        if interrupted:
            self.say(f"Interrupted after {timing.steps_done} steps: the model keeps the weights "
                     "learned so far.")
        return history

    # -- checkpoints -----------------------------------------------------------------------

    def _open_checkpoints(self) -> None:
        """--checkpoint: a writable directory; without --resume, one holding no checkpoints."""
        store = CheckpointStore(self.options.checkpoint, self.options.keep)
        store.prepare()
        listing = store.listing()
        if listing and not self.options.resume:
            raise CheckpointError(
                f"--checkpoint {store.directory} already holds checkpoints (the newest after "
                f"epoch {listing[-1][1]}): add --resume to continue from it, or choose an "
                "empty directory.")
        self.store, self._resume_pending = store, self.options.resume

    def _resume_point(self, epochs: int) -> Checkpoint | None:
        """--resume: the newest checkpoint that reads back whole, and where training goes on."""
        found = self.store.newest()
        for why in found.skipped:
            self._note(f"{why}: using the checkpoint before it", "warning: ")
        checkpoint = found.checkpoint
        if checkpoint is None:
            if found.skipped:
                raise CheckpointError(
                    f"--resume: no checkpoint in {self.store.directory} reads back whole "
                    f"({'; '.join(found.skipped)}). Move the damaged files away to start over.")
            self.say(f"--resume: no checkpoint in {self.store.directory} yet, training from the "
                     "start.")
            return None
        done = checkpoint.epoch
        self.say(f"Resuming from {checkpoint.path}: {done} epoch{'s' * (done != 1)} done, "
                 + (f"continuing at epoch {done + 1} of {epochs}." if done < epochs
                    else f"all {epochs} are done (the model gets its weights)."))
        self.report.resumed_from = str(checkpoint.path)
        return checkpoint

    def _record_checkpoints(self, saver: Checkpointing) -> None:
        self.report.checkpoints.extend(str(p) for p in saver.written)
        if saver.cut_short is not None:
            newest = self.store.listing()
            self._note(f"epoch {saver.cut_short} was stopped early, so it has no checkpoint"
                       + (f" (the newest is {newest[-1][2].name})" if newest else ""))

    def _validation(self, model: Any, call: dict, named: set, plan: BatchPlan) -> None:
        data = call.get("validation_data")
        if data is None:
            return
        if _is_dataset(data):
            from tpu_magic.pipeline import dataset_batch_size

            call["validation_data"] = self._whole_dataset(model, data, dataset_batch_size(data))
            return
        vx, vy, vw = (tuple(data) + (None, None))[:3]
        if not (arrays.is_array_input(vx) and (vy is None or arrays.is_array_input(vy))):
            return
        batch = call.get("validation_batch_size") or plan.global_batch
        vplan = plan_batches(batch, self.session.replicas, what="validation_batch_size",
                             static_per_replica=plan.per_replica if _static_batch(model) else None)
        drop = not self._exact(model, vy is not None)
        evaluation = self.data.eval_pipeline(
            vx, vy, vw, self._padded_batch(vplan, model, arrays.num_samples(vx), drop=drop),
            strategy=self.session.strategy, drop=drop)
        self._count_left_out("validation", evaluation)
        call.update(validation_data=evaluation.dataset, validation_batch_size=None,
                    validation_steps=call.get("validation_steps") or evaluation.steps)

    def _whole_dataset(self, model: Any, data: Any, batch: int | None) -> Any:
        """A user's tf.data dataset of (x, y[, w]) as whole batches with the padding masked
        out, one pipeline per replica (see `pipeline.whole_batches`), where the model's loss
        takes the mask; otherwise as it is, for Keras to distribute."""
        if self.session.backend != "tf" or not batch or \
                not exactness.masks_reach_loss(model, has_targets=True):
            return data
        from tpu_magic import pipeline

        if not pipeline.labelled(data):
            return data
        if self.session.replicas > 1 and pipeline.unseeded_shuffle(data):
            self._note("the dataset shuffles without a seed, so it cannot be split into one "
                       "pipeline per replica (each would shuffle its own way) and Keras "
                       "distributes it: freeing its iterator can make fit wait seconds to "
                       "minutes after the last step. Seed the shuffle, `shuffle(n, seed=1)`, "
                       "or call keras.utils.set_random_seed(...) before building the dataset.")
        return pipeline.whole_batches(data, batch, self.session.strategy)

    def _class_weighted(self, y: Any, weights: Any, call: dict) -> Any:
        """`class_weight` folded into per-sample weights (Keras's own rule), as Keras does."""
        class_weight = call.get("class_weight")
        if not class_weight:
            return weights
        call["class_weight"] = None
        if weights is not None:
            raise InputError("fit got both class_weight and sample_weight (Keras takes one): "
                             "multiply the class weights into sample_weight, or drop one")
        if y is None or keras.tree.is_nested(y):
            raise InputError("class_weight works with one target array (a single output): "
                             "give per-sample weights as sample_weight instead")
        return arrays.class_weights_to_sample_weights(y, class_weight)

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
        self.last_model = model
        self.session.last_model = model
        self.session.last_model_name = self._name_of(model)
        self.session.last_fit = recorded

    def _evaluate(self, model: Any, call: dict, named: set) -> Any:
        plan = self._plan("evaluate", model, call, named)
        self._prepare(model)
        x, y, weights = call["x"], call["y"], call["sample_weight"]
        if arrays.is_array_input(x) and (y is None or arrays.is_array_input(y)):
            drop = not self._exact(model, y is not None)
            evaluation = self.data.eval_pipeline(
                x, y, weights, self._padded_batch(plan, model, arrays.num_samples(x), drop=drop),
                strategy=self.session.strategy, drop=drop)
            self._count_left_out("evaluate", evaluation)
            call.update(x=evaluation.dataset, y=None, sample_weight=None, batch_size=None,
                        steps=call.get("steps") or evaluation.steps)
        elif _is_dataset(x):
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
            samples = self.data.predict_pipeline(
                x, self._padded_batch(plan, model, arrays.num_samples(x)),
                strategy=self.session.strategy)
            call.update(x=samples.dataset, batch_size=None, steps=samples.steps)
            out = arrays.trim(_ORIGINAL["predict"](model, **call), samples.samples)
        rows = len(keras.tree.flatten(out)[0])
        self.report.predictions.append(rows)
        return out


def _input_builder(backend: str) -> Any:
    """The module that turns NumPy inputs into padded batches for this backend."""
    if backend == "jax":
        from tpu_magic import pydataset

        return pydataset
    from tpu_magic import pipeline

    return pipeline


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


def _is_dataset(data: Any) -> bool:
    return hasattr(data, "element_spec")


def _static_batch(model: Any) -> int | None:
    """A batch size fixed in the model's Input(s), e.g. `keras.Input(batch_shape=(128, 40))`."""
    try:
        sizes = {t.shape[0] for t in model.inputs}
    except (AttributeError, TypeError, ValueError):
        return None
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def _split(arrays: Any, cut: int) -> tuple[Any, Any]:
    """Keras's validation_split: the last samples, before shuffling, are for validation."""
    def part(piece: slice) -> tuple:
        return tuple(None if a is None else keras.tree.map_structure(lambda v: v[piece], a)
                     for a in arrays)

    return part(slice(None, cut)), part(slice(cut, None))


class _StopRequest:
    requested = False


class _StopOnEvent(keras.callbacks.Callback):
    """Ends `fit` at the next batch boundary once the event is set (the panel's Stop)."""

    def __init__(self, event: threading.Event):
        super().__init__()
        self.event = event

    def on_train_batch_end(self, batch, logs=None):
        if self.event.is_set():
            self.model.stop_training = True


@contextlib.contextmanager
def _stop_on_interrupt(model: Any) -> Iterator[_StopRequest]:
    """Ctrl-C stops `fit` at the next batch boundary; a second Ctrl-C interrupts at once."""
    stop = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if stop.requested:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        stop.requested = True
        model.stop_training = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
