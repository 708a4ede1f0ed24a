"""NumPy inputs as whole, padded batches for the JAX backend (a Keras `PyDataset`).

The same rules as `pipeline` (tf.data, TensorFlow backend) without TensorFlow: every
batch has exactly the global batch size, so `DataParallel` can split it over the
devices (a smaller last batch fails: keras-team/keras#21167, ZeroDivisionError with
fewer samples than devices). Padding carries a zero sample weight and the real
samples' weights are rescaled, so losses and gradients are those of the real samples.
Epoch `e`'s order depends only on (seed, e), so a resumed run sees the same order.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np

from tpu_magic.arrays import Pipeline, new_seed, num_samples
from tpu_magic.batching import steps_for


class PaddedBatches(keras.utils.PyDataset):
    """Batch `i` of the current epoch: indices into the arrays, -1 for padding.

    Args:
        arrays: (x, y[, sample_weight]) or (x,) — NumPy arrays or structures of them.
        batch: the global batch.
        shuffle: a new order each epoch (from `seed` and the epoch number).
        first_epoch: the epoch `fit` starts at.
        weigh: real-sample mask of a batch → the weights; used only where weights are needed
            (padding, or the user's own sample weights), as in `pipeline`.
    """

    def __init__(self, arrays: tuple, batch: int, shuffle: bool = False, seed: int = 0,
                 first_epoch: int = 0, weigh: Callable[[np.ndarray], np.ndarray] | None = None):
        super().__init__()
        self.arrays, self.batch, self.shuffle, self.seed = arrays, batch, shuffle, seed
        self.samples = num_samples(arrays[0])
        self.steps = steps_for(self.samples, batch)
        self.pad = self.steps * batch - self.samples
        weighted = self.pad > 0 or (len(arrays) > 2 and arrays[2] is not None)
        self.weigh = weigh if weighted else None
        self.epoch = first_epoch
        self.order = self._order()

    def _order(self) -> np.ndarray:
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.samples)
                 if self.shuffle else np.arange(self.samples))
        return np.concatenate([order, np.full(self.pad, -1)])

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple:
        index = self.order[i * self.batch:(i + 1) * self.batch]
        real = index >= 0
        safe = np.where(real, index, 0)
        picked = tuple(None if a is None else keras.tree.map_structure(lambda v: v[safe], a)
                       for a in self.arrays)
        if self.weigh is None:
            return tuple(a for a in picked if a is not None)
        weight = self.weigh(real.astype("float32"))
        if len(picked) > 2 and picked[2] is not None:
            weight = weight * picked[2].astype("float32")
        return picked[0], picked[1], weight

    def on_epoch_end(self) -> None:
        self.epoch += 1
        if self.shuffle:
            self.order = self._order()


def train_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, shuffle: bool,
                   repeat: bool = True, seed: int | None = None, first_epoch: int = 0,
                   strategy: Any = None) -> Pipeline:
    """Shuffled padded batches for `fit`; a real sample in a batch of `k` weighs `batch / k`.

    `repeat` and `strategy` are accepted for the same signature as `pipeline.train_pipeline`:
    Keras asks a PyDataset for each epoch's batches itself, and splits them over the devices.
    """
    data = PaddedBatches((x, y, sample_weight), batch, shuffle=shuffle,
                         seed=new_seed() if seed is None else seed, first_epoch=first_epoch,
                         weigh=lambda mask: mask * (batch / max(mask.sum(), 1.0)))
    return Pipeline(data, data.steps, data.samples, data.pad)


def eval_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, strategy: Any = None) -> Pipeline:
    """One ordered pass for `evaluate`; padding weighs 0, real samples `padded / real`."""
    samples = num_samples(x)
    scale = steps_for(samples, batch) * batch / samples
    data = PaddedBatches((x, y, sample_weight), batch, weigh=lambda mask: mask * scale)
    return Pipeline(data, data.steps, data.samples, data.pad)


def predict_pipeline(x: Any, batch: int, strategy: Any = None) -> Pipeline:
    """One ordered pass of inputs only; padding repeats sample 0 and is trimmed afterwards."""
    data = PaddedBatches((x,), batch)
    return Pipeline(data, data.steps, data.samples, data.pad)
