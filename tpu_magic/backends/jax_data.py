"""NumPy inputs as whole, padded batches for the JAX backend (a Keras `PyDataset`).

The same rules as `tf_data` (tf.data, TensorFlow backend) without TensorFlow: every
batch has exactly the global batch size, so `DataParallel` can split it over the
devices (a smaller last batch fails: keras-team/keras#21167, ZeroDivisionError with
fewer samples than devices). Padding is masked out of losses and metrics by `exactness`.
Epoch `e`'s order depends only on (seed, e), so a resumed run sees the same order.
"""

from __future__ import annotations

import sys
from typing import Any

import keras
import numpy as np

from tpu_magic.core.arrays import Pipeline, new_seed, num_samples
from tpu_magic.core.batching import steps_for
from tpu_magic.core.errors import BatchSizeError
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
        real_share = float(np.mean(index >= 0))  # of the whole batch, on every process
        index = own_rows(index)
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
            share = np.full(len(mask), real_share, "float32")
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


def own_rows(batch: np.ndarray) -> np.ndarray:
    """This process's rows of a global batch: all of it in one process; across processes
    (one a host), process p feeds the p-th equal part, and Keras assembles the global batch
    from the parts (`DataParallel(auto_shard_dataset=False)`)."""
    import jax

    count = jax.process_count()
    if count == 1:
        return batch
    part = len(batch) // count
    return batch[jax.process_index() * part:(jax.process_index() + 1) * part]


class WholeBatchStream(keras.utils.PyDataset):
    """A dataset of batches (grain, tf.data on JAX, KerasHub's own pipelines) as whole
    batches, one for one, read lazily: a short batch (an epoch's last) is padded to the full
    batch with the padding masked out (`masked`), or, where the model's loss cannot take the
    mask, cut to a multiple of the data rows. Each pass over a dataset of known length starts
    a new pass over the source; an endless one (a declared `steps_per_epoch`) is read on.

    Args:
        source: an iterable of batches (`x`, `(x, y)` or `(x, y, sample_weight)`).
        batch: the full batch (None: the first batch's size).
        rows: the number of data rows the batch is split over; a batch must divide by it.
        masked: pad and mask (True) or cut (False).
    """

    def __init__(self, source: Any, batch: int | None, rows: int, masked: bool):
        super().__init__()
        self.source, self.batch, self.rows, self.masked = source, batch, rows, masked
        self.length = batches_in(source)
        self._pass: Any = None

    @property
    def num_batches(self) -> int | None:
        return self.length

    def __len__(self) -> int:
        return self.length if self.length is not None else 0

    def __getitem__(self, i: int) -> Any:
        if i == 0 or self._pass is None:
            self._pass = iter(self.source)
        return self.whole(next(self._pass))

    def whole(self, batch: Any) -> Any:
        x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
        x, y, weight = (None if a is None else keras.tree.map_structure(np.asarray, a)
                        for a in (x, y, weight))
        n = num_samples(x)
        if self.batch is None:
            self.batch = n
        if self.batch % self.rows:
            raise BatchSizeError(f"the dataset's batch of {self.batch} does not split over the "
                             f"{self.rows} data rows: batch it by a multiple of {self.rows}")
        if y is None:  # inputs only: cut to equal shares
            keep = n - n % self.rows
            return keras.tree.map_structure(lambda a: a[:keep], x)
        if not self.masked:
            keep = n - n % self.rows
            cut = (lambda a: None if a is None else keras.tree.map_structure(lambda v: v[:keep], a))
            return tuple(p for p in (cut(x), cut(y), cut(weight)) if p is not None)
        pad = self.batch - n
        index = np.concatenate([np.arange(n), np.zeros(pad, int)])

        def pick(a):
            return keras.tree.map_structure(lambda v: v[index], a)

        mask = (np.arange(self.batch) < n).astype("float32")
        weight = np.ones(self.batch, "float32") if weight is None else \
            pick(weight).astype("float32")
        share = np.full(self.batch, n / self.batch, "float32")
        return pick(x), pick(y), {MASK: mask, WEIGHT: weight, REAL: share}


def batches_in(source: Any) -> int | None:
    """The batches in one pass of a dataset, None where it does not say (or has no end)."""
    cardinality = getattr(source, "cardinality", None)
    if callable(cardinality):  # tf.data: -1 infinite, -2 unknown
        count = int(cardinality())
        return count if count >= 0 else None
    try:
        count = len(source)
    except TypeError:
        return None
    return count if count < sys.maxsize else None
