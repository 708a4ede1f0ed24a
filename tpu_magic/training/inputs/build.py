"""A call's inputs made into whole batches, for `fit` (and its validation data), `evaluate`
and `predict`.

NumPy inputs go through the backend's input builder (`backends.tf.data`, `backends.jax.data`):
whole, static-shape batches, the last one padded and its padding masked out of losses and
metrics (see `exactness`), or, for a model whose loss cannot take the mask, whole batches of
real samples only. A user's batched input is made whole by the backend (`Backend.user_batches`).
Other inputs go to Keras as they are. Each method returns a new call in a frozen `Built`;
the call it was given is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping

import keras
import numpy as np

from tpu_magic.backends.keras_inputs import drawn_alike, first_batch_safely, whole
from tpu_magic.core import arrays
from tpu_magic.core.batching import BatchPlan
from tpu_magic.core.errors import BatchSizeError, InputError
from tpu_magic.core.packed import MASK, REAL, WEIGHT
from tpu_magic.training.inputs import exactness, planning


@dataclass(frozen=True)
class Built:
    """A call's inputs, built.

    Attributes:
        call: the call's arguments with its inputs replaced, for Keras (read-only).
        batch: the batch a step takes (0: told once Keras reads the input).
        first: the first `k` batches as fed (the parity check's; None: not known).
        shapes: their `batch_shapes`, known before the fit reads anything (None: not known).
        measurable: what a fit's input share can be measured on: tpu_magic's own pipeline
            (drawn again), or a user's input that timed its own reads (None: neither).
        measurable_key: what makes two of tpu_magic's own pipelines cost the same a batch
            (a later fit of the same reuses the measurement; None for a user's input).
        left_out: samples a pass leaves out, by pass ("fit", "validation", "evaluate").
        rest: `evaluate`'s left-out samples (x, y, sample_weight) for
            `Backend.evaluate_rest` (None: every sample is in a batch).
        rows: the rows `predict`'s outputs are trimmed to (None: Keras reads the input).
        own: tpu_magic's own pipelines by role ("train", "test", "predict"), read a pass
            at a time from its start (a backend may read them a group of batches at once).
        epoch_steps: the full batches of one pass (a short last one not counted; None: not
            known before Keras reads the input).
    """

    call: Mapping[str, Any]
    batch: int = 0
    first: Callable[[int], list] | None = None
    shapes: Callable[[int], list] | None = None
    measurable: Any = None
    measurable_key: str | None = None
    left_out: Mapping[str, int] = field(default_factory=dict)
    rest: tuple | None = None
    rows: int | None = None
    own: Mapping[str, Any] = field(default_factory=dict)
    epoch_steps: int | None = None


def _frozen(call: dict) -> Mapping[str, Any]:
    return MappingProxyType(call)


@dataclass(frozen=True)
class Inputs:
    """Builds the inputs of a cell's calls on one connection.

    Args:
        connection: the connection (its strategy, replicas and backend).
        note: says a note once (the cell's; a prefix may follow the text).
        label: a model's name for notes (the user's, else Keras's).
        name: the user's name for a model, where it has one.
    """

    connection: Any
    note: Callable[..., None]
    label: Callable[[Any], str]
    name: Callable[[Any], str | None] = lambda model: None  # the user's name (None: none)

    @property
    def data(self) -> Any:
        return self.connection.backend.inputs()

    def cut(self, plan: BatchPlan, model: Any, samples: int, has_targets: bool
            ) -> tuple[int, str]:
        """The batch the data is cut into, and what becomes of the samples that do not fill
        the last one (`planning.remainder_for`); where they are left out, says so and why.
        Fewer samples than one batch over the replicas, for a loss that cannot skip
        padding: every replica takes them all ("whole": one device's step on each)."""
        remainder = planning.remainder_for(model, self.connection, has_targets)
        try:
            batch = self.batch(plan, model, samples, remainder)
        except BatchSizeError:
            if remainder != "drop" or not samples:
                raise
            self.note(f"{samples} sample{'s' * (samples != 1)} cannot be split over "
                      f"{self.connection.replicas} replicas, and the loss of "
                      f"{self.label(model)!r} cannot skip padding: every replica takes all "
                      f"{samples} (one device's step on each, the same numbers)")
            return samples, "whole"
        if remainder == "drop":
            self.note(f"model {self.label(model)!r}: " + exactness.why_not_exact(
                model, has_targets, self.connection.backend.evaluates_rest))
        return batch, remainder

    def batch(self, plan: BatchPlan, model: Any, samples: int, remainder: str = "pad") -> int:
        return planning.padded_batch(plan, model, samples, self.connection, remainder)

    def first_batch(self, model: Any, call: Mapping[str, Any], plan: BatchPlan) -> Any:
        """The first batch `fit`'s input will feed, as its shapes go, made without building
        the input: what the memory plan and `--shard auto` settle the placement from before
        anything is built (None: not known without reading the input)."""
        x, y, weights = call["x"], call.get("y"), call.get("sample_weight")
        if _arrays(x, y):
            if call.get("class_weight") and weights is None and y is not None:
                weights = np.ones(arrays.num_samples(x), "float32")
            samples = arrays.num_samples(x)
            remainder = planning.remainder_for(model, self.connection, y is not None)
            batch = self.batch(plan, model, samples, remainder)
            rows = slice(0, min(batch, samples))
            x, y, weights = (None if a is None else keras.tree.map_structure(lambda v: v[rows], a)
                             for a in (x, y, weights))
            if remainder == "pad" and y is not None and \
                    -(-samples // batch) * batch > samples:  # every batch carries the mask
                ones = np.ones(len(keras.tree.flatten(x)[0]), "float32")
                weights = {MASK: ones, WEIGHT: ones if weights is None else weights, REAL: ones}
            return keras.utils.pack_x_y_sample_weight(x, y, weights)
        if planning.batched_input(x):
            first = first_batch_safely(x)
            return None if first is None else whole(first, self.connection.replicas, 0,
                                                    self._masked(model))[0]
        return None

    def for_fit(self, model: Any, call: Mapping[str, Any], plan: BatchPlan, seed: int,
                build_pass: bool = False) -> Built:
        """`fit`'s x/y/weights and validation data as whole batches (`seed`, `build_pass`:
        the order's, see `FitPlan`)."""
        call = dict(call)
        x, y = call["x"], call["y"]
        if _arrays(x, y):
            return self._validation(
                model, self._fit_arrays(model, call, plan, seed, build_pass), plan)
        if planning.batched_input(x):
            call["x"], applied = self.batched(
                model, x, batch=plan.global_batch or None, shuffle=bool(call.get("shuffle")),
                class_weight=call.get("class_weight"), steps=call.get("steps_per_epoch"),
                keep=model.steps_per_execution)
            if applied:
                call["class_weight"] = None
            measurable = (call["x"] if hasattr(call["x"], "read_seconds") or drawn_alike(x)
                          else None)
            built = Built(call, plan.global_batch or given_batch_size(call["x"]),
                          getattr(call["x"], "first", None), measurable=measurable,
                          epoch_steps=call.get("steps_per_epoch")
                          or getattr(call["x"], "num_batches", None))
            return self._validation(model, built, plan)
        return self._validation(model, Built(call, plan.global_batch), plan)

    def _fit_arrays(self, model: Any, call: Mapping[str, Any], plan: BatchPlan,
                    seed: int, build_pass: bool) -> Built:
        call = dict(call)
        x, y, weights = call["x"], call["y"], call["sample_weight"]
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
        batch, remainder = self.cut(plan, model, arrays.num_samples(x), y is not None)
        endless = self.connection.backend.repeats_input(
            model.steps_per_execution, call.get("steps_per_epoch") is not None)
        shuffle = call.get("shuffle", True)
        shuffle = shuffle if shuffle == "batch" else bool(shuffle)
        train = self.data.train_pipeline(
            x, y, weights, batch, shuffle=shuffle, repeat=endless, seed=seed,
            first_epoch=call.get("initial_epoch") or 0, strategy=self.connection.strategy,
            remainder=remainder, build_pass=build_pass)
        key = repr((type(train.dataset).__name__, arrays.rows_spec((x, y, weights)),
                    train.samples, batch, self.connection.replicas, shuffle, endless))
        named_steps = call.get("steps_per_epoch")
        call.update(x=train.dataset, y=None, sample_weight=None, batch_size=None,
                    shuffle=False, steps_per_epoch=named_steps
                    or (train.steps if endless else None))
        own = {} if named_steps else {"train": train.dataset}
        full = train.samples // batch if remainder == "short" else train.steps
        return Built(call, batch, train.first, train.shapes, train.dataset, key,
                     _counted("fit", train), own=own,
                     epoch_steps=min(full, named_steps) if named_steps else full)

    def _validation(self, model: Any, built: Built, plan: BatchPlan) -> Built:
        """`built` with fit's validation data as whole batches too."""
        call = dict(built.call)
        data = call.get("validation_data")
        left_out, own = dict(built.left_out), dict(built.own)
        if planning.batched_input(data):
            call["validation_data"], _ = self.batched(model, data,
                                                      steps=call.get("validation_steps"))
        elif isinstance(data, (tuple, list)):
            vx, vy, vw = (tuple(data) + (None, None))[:3]
            if _arrays(vx, vy):
                vplan = planning.validation_plan(call, plan, model, self.connection)
                batch, remainder = self.cut(vplan, model, arrays.num_samples(vx),
                                            vy is not None)
                evaluation = self.data.eval_pipeline(vx, vy, vw, batch,
                                                     strategy=self.connection.strategy,
                                                     remainder=remainder)
                left_out.update(_counted("validation", evaluation))
                if not call.get("validation_steps"):
                    own["test"] = evaluation.dataset
                call.update(validation_data=evaluation.dataset, validation_batch_size=None,
                            validation_steps=call.get("validation_steps") or evaluation.steps)
        return replace(built, call=_frozen(call), left_out=MappingProxyType(left_out),
                       own=MappingProxyType(own))

    def for_evaluate(self, model: Any, call: Mapping[str, Any], plan: BatchPlan) -> Built:
        """`evaluate`'s inputs; `rest`: the samples the batches leave out, for
        `Backend.evaluate_rest` (counted in `left_out` until they are evaluated)."""
        call = dict(call)
        x, y, weights = call["x"], call["y"], call["sample_weight"]
        if _arrays(x, y):
            batch, remainder = self.cut(plan, model, arrays.num_samples(x), y is not None)
            evaluation = self.data.eval_pipeline(x, y, weights, batch,
                                                 strategy=self.connection.strategy,
                                                 remainder=remainder)
            every_batch = not call.get("steps")
            call.update(x=evaluation.dataset, y=None, sample_weight=None, batch_size=None,
                        steps=call.get("steps") or evaluation.steps)
            rest = None
            if evaluation.left_out and every_batch:
                rows = slice(evaluation.samples - evaluation.left_out, None)
                rest = tuple(None if part is None else
                             keras.tree.map_structure(lambda a: a[rows], part)
                             for part in (x, y, weights))
            own = {} if call.get("steps") != evaluation.steps or not every_batch else \
                {"test": evaluation.dataset}
            return Built(_frozen(call), left_out=_counted("evaluate", evaluation), rest=rest,
                         own=MappingProxyType(own), epoch_steps=evaluation.steps)
        if planning.batched_input(x):
            call["x"], _ = self.batched(model, x, batch=plan.global_batch or None,
                                        steps=call.get("steps"))
        return Built(_frozen(call))

    def for_predict(self, model: Any, call: Mapping[str, Any], plan: BatchPlan) -> Built:
        """`predict`'s inputs; `rows`: the rows its outputs are trimmed to."""
        call = dict(call)
        x = call["x"]
        if not arrays.is_array_input(x):
            return Built(_frozen(call))
        rows = arrays.num_samples(x)
        if rows == 0:  # one batch of a zero row gives the outputs' shapes; 0 rows come back
            x = keras.tree.map_structure(lambda a: np.zeros((1,) + a.shape[1:], a.dtype), x)
        remainder = "pad" if planning.pads(model, self.connection) else "short"
        samples = self.data.predict_pipeline(
            x, self.batch(plan, model, arrays.num_samples(x), remainder),
            strategy=self.connection.strategy, remainder=remainder)
        call.update(x=samples.dataset, batch_size=None, steps=samples.steps)
        return Built(_frozen(call), rows=rows, own=MappingProxyType({"predict": samples.dataset}),
                     epoch_steps=samples.steps)

    def batched(self, model: Any, data: Any, batch: int | None = None, shuffle: bool = False,
                class_weight: Any = None, steps: int | None = None,
                keep: int = 1) -> tuple[Any, bool]:
        """A user's batched input (a dataset, a `PyDataset`, a generator) as whole batches:
        padded with the padding masked out where the model's loss takes the mask, else as
        the backend runs it exactly (see `Backend.user_batches`). Returns (the input,
        whether `class_weight` is applied in it)."""
        backend = self.connection.backend
        return backend.user_batches(
            data, self.connection.strategy, self.note, masked=self._masked(model),
            batch=batch or backend.dataset_batch_size(data), shuffle=shuffle,
            class_weight=class_weight, steps=steps, keep=keep)

    def _masked(self, model: Any) -> bool:
        return planning.pads(model, self.connection) and \
            exactness.masks_reach_loss(model, has_targets=True)


def _arrays(x: Any, y: Any) -> bool:
    return arrays.is_array_input(x) and (y is None or arrays.is_array_input(y))


def _counted(what: str, pipeline: arrays.Pipeline) -> Mapping[str, int]:
    return MappingProxyType({what: pipeline.left_out} if pipeline.left_out else {})


def given_batch_size(data: Any) -> int:
    """The batch of a built input where it says so without being read (0: not known yet;
    reading a user's stream ahead of Keras would change what Keras reads)."""
    size = getattr(data, "batch_size", None)
    return size if isinstance(size, int) else 0
