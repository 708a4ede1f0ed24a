"""NumPy inputs as whole, padded batches for the JAX backend (a Keras `PyDataset`).

The same rules as `tf_data` (tf.data, TensorFlow backend) without TensorFlow: every
batch has exactly the global batch size, so `DataParallel` can split it over the
devices (a smaller last batch fails: keras-team/keras#21167, ZeroDivisionError with
fewer samples than devices). Padding is masked out of losses and metrics by `exactness`.
Epoch `e`'s order depends only on (seed, e), so a resumed run sees the same order.
"""

from __future__ import annotations

from typing import Any, Callable

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
        remainder: what becomes of the samples that do not fill the last batch: "pad"
            (padding, masked out by `exactness`), "short" (the last batch holds them alone
            and runs whole on every device, see `Backend.replica_steps`) or "drop" (left
            out).
        labelled: whether batches carry targets and weights (False: inputs only).
        rows: the data rows of the mesh: a batch they divide is split between the processes
            (`own_rows`); a short one they do not is given whole to every process
            (`WholeRows`).

    With padding, batches carry `exactness`'s packed sample weight, as in `tf_data`.
    """

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, *, batch: int,
                 shuffle: bool = False, seed: int = 0, first_epoch: int = 0,
                 remainder: str = "pad", labelled: bool = True, rows: int = 1):
        super().__init__()
        self.x, self.y, self.sample_weight, self.rows = x, y, sample_weight, rows
        self.batch, self.shuffle, self.seed, self.labelled = batch, shuffle, seed, labelled
        self.samples = num_samples(x)
        drop = remainder == "drop"
        self.steps = steps_for(self.samples, batch, drop=drop)
        self.pad = self.steps * batch - self.samples if remainder == "pad" else 0
        self.left_out = self.samples - self.steps * batch if drop else 0
        self.epoch = first_epoch
        self.order = self._order()

    def _order(self) -> np.ndarray:
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.samples)
                 if self.shuffle else np.arange(self.samples))
        return np.concatenate([order[:self.samples - self.left_out], np.full(self.pad, -1)])

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple:
        index = self.order[i * self.batch:(i + 1) * self.batch]
        real_share = float(np.mean(index >= 0))  # of the whole batch, on every process
        whole = len(index) % self.rows != 0  # a short batch, given whole to every process
        index = index if whole else own_rows(index)
        real = index >= 0
        safe = np.where(real, index, 0)

        def pick(a):
            return keras.tree.map_structure(
                lambda v: v[safe].view(WholeRows) if whole else v[safe], a)

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
                   strategy: Any = None, remainder: str = "pad") -> Pipeline:
    """Shuffled whole batches for `fit`, the last one padded, short or left out (`remainder`).

    `repeat` and `strategy` are accepted for the same signature as `tf_data.train_pipeline`:
    Keras asks a PyDataset for each epoch's batches itself, and splits them over the devices.
    """
    data = PaddedBatches(x, y, sample_weight, batch=batch, shuffle=shuffle,
                         seed=new_seed() if seed is None else seed, first_epoch=first_epoch,
                         remainder=remainder, rows=data_rows(strategy))
    return Pipeline(data, data.steps, data.samples, data.pad, left_out=data.left_out,
                    first=lambda k: [data[i] for i in range(min(k, data.steps))])


def eval_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, strategy: Any = None,
                  remainder: str = "pad") -> Pipeline:
    """One ordered pass for `evaluate`, the last batch padded, short or left out."""
    data = PaddedBatches(x, y, sample_weight, batch=batch, remainder=remainder,
                         rows=data_rows(strategy))
    return Pipeline(data, data.steps, data.samples, data.pad, left_out=data.left_out)


def predict_pipeline(x: Any, batch: int, strategy: Any = None,
                     remainder: str = "pad") -> Pipeline:
    """One ordered pass of inputs only; padding repeats sample 0 and is trimmed afterwards
    (or the last batch is short)."""
    data = PaddedBatches(x, batch=batch, labelled=False,
                         remainder="short" if remainder == "short" else "pad",
                         rows=data_rows(strategy))
    return Pipeline(data, data.steps, data.samples, data.pad)


class WholeRows(np.ndarray):
    """A batch every process holds whole (a short batch the data rows do not divide, on
    several hosts): `Backend.replica_steps` gives it to every device as it is, where a
    process's own share would be assembled into a global batch."""


def data_rows(distribution: Any) -> int:
    """How many parts a batch is split into: the size of the distribution's batch axis."""
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    name = getattr(distribution, "batch_dim_name", None) or mesh.axis_names[0]
    return int(mesh.shape[list(mesh.axis_names).index(name)]) if name in mesh.axis_names else 1


def own_rows(batch: np.ndarray) -> np.ndarray:
    """This process's rows of a global batch: all of it in one process; across processes
    (one a host), process p feeds the p-th equal part, and Keras assembles the global batch
    from the parts (`DataParallel(auto_shard_dataset=False)`)."""
    count = _processes()
    if count == 1:
        return batch
    part = len(batch) // count
    import jax

    return batch[jax.process_index() * part:(jax.process_index() + 1) * part]


def process_share(rows: int) -> Callable[[Any], Any] | None:
    """What of each whole batch of a user's dataset this process gives Keras: on several
    hosts, every host reads every batch (in the dataset's order, as one process would) and
    keeps its own rows of it, as for arrays (`own_rows`), or the whole batch, marked
    `WholeRows`, where the mesh's data rows do not divide it. None in one process."""
    if _processes() == 1:
        return None

    def share(batch: Any) -> Any:
        x = keras.utils.unpack_x_y_sample_weight(batch)[0]
        if num_samples(x) % rows:
            return keras.tree.map_structure(lambda v: np.asarray(v).view(WholeRows), batch)
        return keras.tree.map_structure(lambda v: own_rows(np.asarray(v)), batch)

    return share


def _processes() -> int:
    import jax

    return jax.process_count()
