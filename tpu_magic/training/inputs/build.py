"""A call's inputs made into whole batches, for `fit` (and its validation data), `evaluate`
and `predict`.

NumPy inputs go through the backend's input builder (`backends.tf.data`, `backends.jax.data`):
whole, static-shape batches, the last one padded and its padding masked out of losses and
metrics (see `exactness`), or, for a model whose loss cannot take the mask, whole batches of
real samples only. A user's dataset is padded and masked, or cut to equal per-replica
shares (`Backend.whole_dataset`). Other inputs (a `PyDataset`, a generator) go to Keras as
they are. Each method rewrites the call in place; what it noticed comes back through `note`.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np

from tpu_magic.backends.keras_inputs import drawn_alike
from tpu_magic.core import arrays
from tpu_magic.core.batching import BatchPlan
from tpu_magic.core.errors import InputError
from tpu_magic.training.inputs import exactness, planning


class Inputs:
    """Builds the inputs of one cell's calls.

    Args:
        connection: the connection (its strategy, replicas and backend).
        note: says a note once (the cell's).
        left_out: where the samples a pass leaves out are counted ("fit", "validation", ...).
        label: the user's name for a model, for notes.
    """

    def __init__(self, connection: Any, note: Callable[[str], None], left_out: dict[str, int],
                 label: Callable[[Any], str]):
        self.connection, self.note, self.left_out, self.label = connection, note, left_out, label
        self.data = connection.backend.inputs()
        # the last fit's first batches as fed (see `arrays.Pipeline.first`); None: not known
        self.first_batches: Callable[[int], list] | None = None
        # their shapes, known before the fit reads anything (`arrays.Pipeline.shapes`)
        self.first_shapes: Callable[[int], list] | None = None
        # what the last fit's input share can be measured on: tpu_magic's own pipeline (drawn
        # again), a user's input that timed its own reads, else None (drawing a user's dataset
        # again would change the order its next pass reads)
        self.measurable: Any = None
        # what makes two of tpu_magic's own pipelines cost the same a batch (element types
        # and shapes, samples, batch, replicas, shuffle): a later fit of the same reuses the
        # input share measured on the first (`utilization.input_need`); None for a user's
        # input, whose pipeline the key cannot tell apart
        self.measurable_key: str | None = None

    def drop_pipelines(self) -> None:
        """The last call's pipelines are no longer needed (`TrainingCell._drop_inputs`)."""
        self.first_batches = self.first_shapes = self.measurable = None
        self.measurable_key = None

    def remainder(self, model: Any, has_targets: bool) -> str:
        """What becomes of the samples that do not fill the last batch
        (`planning.remainder_for`); where they are left out, says so and why."""
        remainder = planning.remainder_for(model, self.connection, has_targets)
        if remainder == "drop":
            self.note(f"model {self.label(model)!r}: " + exactness.why_not_exact(
                model, has_targets, self.connection.backend.evaluates_rest))
        return remainder

    def batch(self, plan: BatchPlan, model: Any, samples: int, remainder: str = "pad") -> int:
        return planning.padded_batch(plan, model, samples, self.connection, remainder)

    def for_fit(self, model: Any, call: dict, plan: BatchPlan, seed: int) -> int:
        """`fit`'s x/y/weights and validation data as whole batches. Returns the batch a step
        takes (the timing's)."""
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
            remainder = self.remainder(model, y is not None)
            endless = self.connection.backend.repeats_input(
                model.steps_per_execution, call.get("steps_per_epoch") is not None)
            batch = self.batch(plan, model, arrays.num_samples(x), remainder=remainder)
            train = self.data.train_pipeline(
                x, y, weights, batch, shuffle=bool(call.get("shuffle", True)), repeat=endless,
                seed=seed, first_epoch=call.get("initial_epoch") or 0,
                strategy=self.connection.strategy, remainder=remainder)
            self._count("fit", train)
            self.first_batches, self.measurable = train.first, train.dataset
            self.first_shapes = train.shapes
            self.measurable_key = repr((
                type(train.dataset).__name__, arrays.rows_spec((x, y, weights)), train.samples,
                batch, self.connection.replicas, bool(call.get("shuffle", True)), endless))
            call.update(x=train.dataset, y=None, sample_weight=None, batch_size=None,
                        shuffle=False, steps_per_epoch=call.get("steps_per_epoch")
                        or (train.steps if endless else None))
        elif planning.batched_input(x):
            call["x"], applied = self.batched(
                model, x, batch=plan.global_batch or None, shuffle=bool(call.get("shuffle")),
                class_weight=call.get("class_weight"), steps=call.get("steps_per_epoch"),
                keep=model.steps_per_execution)
            if applied:
                call["class_weight"] = None
            batch = batch or given_batch_size(call["x"])
            self.first_batches, self.measurable_key = getattr(call["x"], "first", None), None
            self.first_shapes = None
            self.measurable = (call["x"] if hasattr(call["x"], "read_seconds")
                               or drawn_alike(x) else None)
        else:
            self.first_batches = self.first_shapes = self.measurable = None
            self.measurable_key = None
        self._validation(model, call, plan)
        return batch

    def _validation(self, model: Any, call: dict, plan: BatchPlan) -> None:
        data = call.get("validation_data")
        if data is None:
            return
        if planning.batched_input(data):
            call["validation_data"], _ = self.batched(model, data,
                                                      steps=call.get("validation_steps"))
            return
        if not isinstance(data, (tuple, list)):
            return
        vx, vy, vw = (tuple(data) + (None, None))[:3]
        if not (arrays.is_array_input(vx) and (vy is None or arrays.is_array_input(vy))):
            return
        vplan = planning.validation_plan(call, plan, model, self.connection)
        remainder = self.remainder(model, vy is not None)
        evaluation = self.data.eval_pipeline(
            vx, vy, vw, self.batch(vplan, model, arrays.num_samples(vx), remainder=remainder),
            strategy=self.connection.strategy, remainder=remainder)
        self._count("validation", evaluation)
        call.update(validation_data=evaluation.dataset, validation_batch_size=None,
                    validation_steps=call.get("validation_steps") or evaluation.steps)

    def for_evaluate(self, model: Any, call: dict, plan: BatchPlan) -> tuple | None:
        """Returns the samples the batches leave out, as (x, y, sample_weight), for
        `Backend.evaluate_rest` (None: every sample is in a batch, or Keras reads the input;
        counted in the report until they are evaluated)."""
        x, y, weights = call["x"], call["y"], call["sample_weight"]
        if arrays.is_array_input(x) and (y is None or arrays.is_array_input(y)):
            remainder = self.remainder(model, y is not None)
            evaluation = self.data.eval_pipeline(
                x, y, weights, self.batch(plan, model, arrays.num_samples(x), remainder=remainder),
                strategy=self.connection.strategy, remainder=remainder)
            self._count("evaluate", evaluation)
            every_batch = not call.get("steps")
            call.update(x=evaluation.dataset, y=None, sample_weight=None, batch_size=None,
                        steps=call.get("steps") or evaluation.steps)
            if evaluation.left_out and every_batch:
                rows = slice(evaluation.samples - evaluation.left_out, None)
                return tuple(None if part is None else
                             keras.tree.map_structure(lambda a: a[rows], part)
                             for part in (x, y, weights))
        elif planning.batched_input(x):
            call["x"], _ = self.batched(model, x, batch=plan.global_batch or None,
                                        steps=call.get("steps"))
        return None

    def for_predict(self, model: Any, call: dict, plan: BatchPlan) -> int | None:
        """Returns the rows the outputs must be trimmed to (None: Keras reads the input)."""
        x = call["x"]
        if not arrays.is_array_input(x):
            return None
        rows = arrays.num_samples(x)
        if rows == 0:  # one batch of a zero row gives the outputs' shapes; 0 rows come back
            x = keras.tree.map_structure(lambda a: np.zeros((1,) + a.shape[1:], a.dtype), x)
        remainder = "pad" if planning.pads(model, self.connection) else "short"
        samples = self.data.predict_pipeline(
            x, self.batch(plan, model, arrays.num_samples(x), remainder),
            strategy=self.connection.strategy, remainder=remainder)
        call.update(x=samples.dataset, batch_size=None, steps=samples.steps)
        return rows

    def batched(self, model: Any, data: Any, batch: int | None = None, shuffle: bool = False,
                class_weight: Any = None, steps: int | None = None,
                keep: int = 1) -> tuple[Any, bool]:
        """A user's batched input (a dataset, a `PyDataset`, a generator) as whole batches:
        padded with the padding masked out where the model's loss takes the mask, else as
        the backend runs it exactly (see `Backend.user_batches`). Returns (the input,
        whether `class_weight` is applied in it)."""
        backend = self.connection.backend
        return backend.user_batches(
            data, self.connection.strategy, self.note,
            masked=planning.pads(model, self.connection)
            and exactness.masks_reach_loss(model, has_targets=True),
            batch=batch or backend.dataset_batch_size(data), shuffle=shuffle,
            class_weight=class_weight, steps=steps, keep=keep)

    def _count(self, what: str, pipeline: arrays.Pipeline) -> None:
        if pipeline.left_out:
            self.left_out[what] = pipeline.left_out


def given_batch_size(data: Any) -> int:
    """The batch of a built input where it says so without being read (0: not known yet;
    reading a user's stream ahead of Keras would change what Keras reads)."""
    size = getattr(data, "batch_size", None)
    return size if isinstance(size, int) else 0
