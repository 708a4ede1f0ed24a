"""A call's inputs made into whole batches, for `fit` (and its validation data), `evaluate`
and `predict`.

NumPy inputs go through the backend's input builder (`backends.tf_data`, `backends.jax_data`):
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

from tpu_magic.core import arrays
from tpu_magic.core.batching import BatchPlan
from tpu_magic.core.errors import InputError
from tpu_magic.training import exactness, planning
from tpu_magic.training.planning import is_dataset


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

    def exact(self, model: Any, has_targets: bool) -> bool:
        """Whether padding can be masked out for this model; else say what happens instead."""
        why = exactness.why_not_exact(model, has_targets)
        if why is not None:
            self.note(f"model {self.label(model)!r}: {why}")
        return why is None

    def batch(self, plan: BatchPlan, model: Any, samples: int, drop: bool = False) -> int:
        return planning.padded_batch(plan, model, samples, self.connection, drop)

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
            drop = not self.exact(model, y is not None)
            endless = self.connection.backend.repeats_input(
                model.steps_per_execution, call.get("steps_per_epoch") is not None)
            batch = self.batch(plan, model, arrays.num_samples(x), drop=drop)
            train = self.data.train_pipeline(
                x, y, weights, batch, shuffle=bool(call.get("shuffle", True)), repeat=endless,
                seed=seed, first_epoch=call.get("initial_epoch") or 0,
                strategy=self.connection.strategy, drop=drop)
            self._count("fit", train)
            call.update(x=train.dataset, y=None, sample_weight=None, batch_size=None,
                        shuffle=False, steps_per_epoch=call.get("steps_per_epoch")
                        or (train.steps if endless else None))
        elif is_dataset(x) and not call.get("class_weight"):  # Keras maps class weights in
            call["x"] = self.dataset(model, x, plan.global_batch)
            batch = batch or first_batch_size(call["x"])
        self._validation(model, call, plan)
        return batch

    def _validation(self, model: Any, call: dict, plan: BatchPlan) -> None:
        data = call.get("validation_data")
        if data is None:
            return
        if is_dataset(data):
            call["validation_data"] = self.dataset(
                model, data, self.connection.backend.dataset_batch_size(data))
            return
        if not isinstance(data, (tuple, list)):  # a PyDataset or generator: Keras reads it
            return
        vx, vy, vw = (tuple(data) + (None, None))[:3]
        if not (arrays.is_array_input(vx) and (vy is None or arrays.is_array_input(vy))):
            return
        vplan = planning.validation_plan(call, plan, model, self.connection)
        drop = not self.exact(model, vy is not None)
        evaluation = self.data.eval_pipeline(
            vx, vy, vw, self.batch(vplan, model, arrays.num_samples(vx), drop=drop),
            strategy=self.connection.strategy, drop=drop)
        self._count("validation", evaluation)
        call.update(validation_data=evaluation.dataset, validation_batch_size=None,
                    validation_steps=call.get("validation_steps") or evaluation.steps)

    def for_evaluate(self, model: Any, call: dict, plan: BatchPlan) -> None:
        x, y, weights = call["x"], call["y"], call["sample_weight"]
        if arrays.is_array_input(x) and (y is None or arrays.is_array_input(y)):
            drop = not self.exact(model, y is not None)
            evaluation = self.data.eval_pipeline(
                x, y, weights, self.batch(plan, model, arrays.num_samples(x), drop=drop),
                strategy=self.connection.strategy, drop=drop)
            self._count("evaluate", evaluation)
            call.update(x=evaluation.dataset, y=None, sample_weight=None, batch_size=None,
                        steps=call.get("steps") or evaluation.steps)
        elif is_dataset(x):
            call["x"] = self.dataset(model, x, plan.global_batch)

    def for_predict(self, model: Any, call: dict, plan: BatchPlan) -> int | None:
        """Returns the rows the outputs must be trimmed to (None: Keras reads the input)."""
        x = call["x"]
        if not arrays.is_array_input(x):
            return None
        rows = arrays.num_samples(x)
        if rows == 0:  # one batch of a zero row gives the outputs' shapes; 0 rows come back
            x = keras.tree.map_structure(lambda a: np.zeros((1,) + a.shape[1:], a.dtype), x)
        samples = self.data.predict_pipeline(
            x, self.batch(plan, model, arrays.num_samples(x)), strategy=self.connection.strategy)
        call.update(x=samples.dataset, batch_size=None, steps=samples.steps)
        return rows

    def dataset(self, model: Any, data: Any, batch: int | None) -> Any:
        """A user's dataset as whole batches: padded with the padding masked out where the
        model's loss takes the mask, else every batch cut to equal shares per replica (a
        custom step or an inputs-only dataset: no replica gets an empty or smaller share)."""
        return self.connection.backend.whole_dataset(
            data, batch, self.connection.strategy, self.note,
            masked=exactness.masks_reach_loss(model, has_targets=True))

    def _count(self, what: str, pipeline: arrays.Pipeline) -> None:
        if pipeline.left_out:
            self.left_out[what] = pipeline.left_out


def first_batch_size(data: Any) -> int:
    """The rows of the first batch of built input that can be indexed (a `PyDataset`), 0 where
    it cannot be told without reading it up."""
    try:
        first = data[0] if isinstance(data, keras.utils.PyDataset) else None
    except (IndexError, TypeError, KeyError, StopIteration):
        return 0
    if first is None:
        return 0
    return arrays.num_samples(keras.utils.unpack_x_y_sample_weight(first)[0])
