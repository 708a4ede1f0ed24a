"""NumPy inputs as whole, padded batches for the JAX backend (a Keras `PyDataset`).

The same rules as `tf_data` (tf.data, TensorFlow backend) without TensorFlow: every
batch has exactly the global batch size, so `DataParallel` can split it over the
devices (a smaller last batch fails: keras-team/keras#21167, ZeroDivisionError with
fewer samples than devices). Padding is masked out of losses and metrics by `exactness`.
Epoch `e`'s order depends only on (seed, e), so a resumed run sees the same order.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from tpu_magic.core.arrays import Pipeline, new_seed, num_samples
from tpu_magic.core.batching import steps_for
from tpu_magic.core.packed import MASK, REAL, WEIGHT


class PaddedBatches(keras.utils.PyDataset):
    """Batch `i` of the current epoch: indices into the arrays, -1 for padding.

    Args:
        x, y, sample_weight: NumPy arrays or structures of them (`y`, `sample_weight` may
            be None).
        batch: the global batch.
        shuffle: a new order each epoch (from `seed` and the epoch number).
        first_epoch: the epoch `fit` starts at.
        drop: leave the remainder of each epoch's order out instead of padding.
        labelled: whether batches carry targets and weights (False: inputs only).

    With padding, batches carry `exactness`'s packed sample weight, as in `tf_data`.
    """

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, *, batch: int,
                 shuffle: bool = False, seed: int = 0, first_epoch: int = 0,
                 drop: bool = False, labelled: bool = True):
        super().__init__()
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.batch, self.shuffle, self.seed, self.labelled = batch, shuffle, seed, labelled
        self.samples = num_samples(x)
        self.steps = steps_for(self.samples, batch, drop=drop)
        self.pad = 0 if drop else self.steps * batch - self.samples
        self.left_out = self.samples - self.steps * batch if drop else 0
        self.epoch = first_epoch
        self.order = self._order()

    def _order(self) -> np.ndarray:
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.samples)
                 if self.shuffle else np.arange(self.samples))
        return np.concatenate([order[:self.steps * self.batch - self.pad],
                               np.full(self.pad, -1)])

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple:
        index = self.order[i * self.batch:(i + 1) * self.batch]
        real = index >= 0
        safe = np.where(real, index, 0)

        def pick(a):
            return keras.tree.map_structure(lambda v: v[safe], a)

        if not self.labelled:
            return (pick(self.x),)
        if self.y is None:  # as Keras gives it: the inputs alone (a custom train_step gets `x`)
            return pick(self.x)
        picked = (pick(self.x), pick(self.y))
        weight = None if self.sample_weight is None else pick(self.sample_weight)
        if self.pad:
            mask = real.astype("float32")
            share = np.full(len(mask), mask.mean(), "float32")
            weight = np.ones_like(mask) if weight is None else weight.astype("float32")
            return picked + ({MASK: mask, WEIGHT: weight, REAL: share},)
        return picked if weight is None else picked + (weight,)

    def on_epoch_end(self) -> None:
        self.epoch += 1
        if self.shuffle:
            self.order = self._order()


def train_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, shuffle: bool,
                   repeat: bool = True, seed: int | None = None, first_epoch: int = 0,
                   strategy: Any = None, drop: bool = False) -> Pipeline:
    """Shuffled whole batches for `fit`, the last one padded (or dropped with `drop`).

    `repeat` and `strategy` are accepted for the same signature as `tf_data.train_pipeline`:
    Keras asks a PyDataset for each epoch's batches itself, and splits them over the devices.
    """
    data = PaddedBatches(x, y, sample_weight, batch=batch, shuffle=shuffle,
                         seed=new_seed() if seed is None else seed, first_epoch=first_epoch,
                         drop=drop)
    return Pipeline(data, data.steps, data.samples, data.pad, left_out=data.left_out)


def eval_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, strategy: Any = None,
                  drop: bool = False) -> Pipeline:
    """One ordered pass for `evaluate`, the last batch padded (or dropped with `drop`)."""
    data = PaddedBatches(x, y, sample_weight, batch=batch, drop=drop)
    return Pipeline(data, data.steps, data.samples, data.pad, left_out=data.left_out)


def predict_pipeline(x: Any, batch: int, strategy: Any = None) -> Pipeline:
    """One ordered pass of inputs only; padding repeats sample 0 and is trimmed afterwards."""
    data = PaddedBatches(x, batch=batch, labelled=False)
    return Pipeline(data, data.steps, data.samples, data.pad)
