"""NumPy inputs as whole, padded batches for the JAX backend (a Keras `PyDataset`).

The same rules as `backends.tf.data` (tf.data, TensorFlow backend) without TensorFlow: every
batch has exactly the global batch size, so `DataParallel` can split it over the
devices (a smaller last batch fails: keras-team/keras#21167, ZeroDivisionError with
fewer samples than devices). Padding is masked out of losses and metrics by `exactness`.
Epoch `e`'s order depends only on (seed, e), so a resumed run sees the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import numpy as np

from tpu_magic.core.arrays import Pipeline, batch_shapes, new_seed, num_samples
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
        split: the mesh's data rows and this process's share of them: a batch they divide is
            split between the processes (`RowSplit.mine`); a short one they do not is given
            whole to every process (`WholeRows`).
        whole: every batch goes whole to every device (`WholeRows`): a small prediction,
            computed as one device computes it, to the bit.

    With padding, batches carry `exactness`'s packed sample weight, as in `backends.tf.data`.
    """

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, *, batch: int,
                 shuffle: bool = False, seed: int = 0, first_epoch: int = 0,
                 remainder: str = "pad", labelled: bool = True,
                 split: RowSplit | None = None, whole: bool = False):
        super().__init__()
        self.x, self.y, self.sample_weight, self.whole = x, y, sample_weight, whole
        self.split = split or RowSplit()
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
        # a short batch, or every batch where asked: given whole to every process and device
        whole = self.whole or len(index) % self.split.rows != 0
        # the share of real rows in the whole batch, on every process (padding alone reads it)
        share = float(np.mean(index >= 0)) if self.pad else 1.0
        index = index if whole else self.split.mine(index)
        return self._gathered(index, share, (lambda v: v.view(WholeRows)) if whole else None)

    def group(self, first: int, count: int) -> list[tuple[Any, bool]]:
        """This epoch's batches `first` to `first + count - 1`, for a loop that runs them
        together (`backends.jax.device_loop`): the full ones gathered at once and stacked
        along a new first axis ((k, batch, ...) arrays), a short last one on its own, as
        (data, stacked). The same rows, padding and weights as `self[i]` each, in one
        process (several processes read a batch at a time)."""
        stop = min(first + count, self.steps)
        short = stop == self.steps and len(self.order) - (stop - 1) * self.batch < self.batch
        full = stop - first - int(short)
        found = []
        if full:
            index = self.order[first * self.batch:(first + full) * self.batch]
            index = index.reshape(full, self.batch)
            share = np.mean(index >= 0, axis=1, keepdims=True).astype("float32")
            marked = (lambda v: v.view(WholeRows)) if self.whole else None
            found.append((self._gathered(index, share, marked), True))
        if short:
            found.append((self[stop - 1], False))
        return found

    def _gathered(self, index: np.ndarray, share: Any, marked: Any = None) -> tuple:
        """The rows `index` names (-1: padding), as Keras takes a batch; `index` may be one
        batch's or a stack of them (k, batch); `share`: the batch's share of real rows (each
        batch's, (k, 1), for a stack); `marked`: applied to every array (a short batch's
        `WholeRows`)."""
        real = index >= 0
        safe = index if not self.pad else np.where(real, index, 0)  # -1 only where padded

        def gather(v):  # np.take: about twice as fast as indexing with an array of rows
            rows = np.take(np.asarray(v), safe, axis=0)
            return rows if marked is None else marked(rows)

        def pick(a):  # an array on its own without the tree walk (every step pays it)
            return gather(a) if isinstance(a, np.ndarray) else keras.tree.map_structure(gather, a)

        if not self.labelled:
            return (pick(self.x),)
        if self.y is None:  # as Keras gives it: the inputs alone (a custom train_step gets `x`)
            return pick(self.x)
        picked = (pick(self.x), pick(self.y))
        weight = None if self.sample_weight is None else pick(self.sample_weight)
        if self.pad:
            mask = real.astype("float32")
            weight = np.ones_like(mask) if weight is None else weight.astype("float32")
            real_share = np.broadcast_to(np.asarray(share, "float32"), mask.shape).copy()
            return picked + ({MASK: mask, WEIGHT: weight, REAL: real_share},)
        return picked if weight is None else picked + (weight,)

    def on_epoch_end(self) -> None:
        self.epoch += 1
        if self.shuffle:
            self.order = self._order()


def train_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, shuffle: bool,
                   repeat: bool = True, seed: int | None = None, first_epoch: int = 0,
                   strategy: Any = None, remainder: str = "pad") -> Pipeline:
    """Shuffled whole batches for `fit`, the last one padded, short or left out (`remainder`).

    `repeat` and `strategy` are accepted for the same signature as `backends.tf.data.train_pipeline`:
    Keras asks a PyDataset for each epoch's batches itself, and splits them over the devices.
    """
    data = PaddedBatches(x, y, sample_weight, batch=batch, shuffle=shuffle,
                         seed=new_seed() if seed is None else seed, first_epoch=first_epoch,
                         remainder=remainder, split=row_split(strategy))
    def first(k: int) -> list:
        return [data[i] for i in range(min(k, data.steps))]

    # a batch is a gather from the arrays: reading the first ones to tell their shapes is cheap
    return Pipeline(data, data.steps, data.samples, data.pad, left_out=data.left_out,
                    first=first, shapes=lambda k: [batch_shapes(b) for b in first(k)])


def eval_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, strategy: Any = None,
                  remainder: str = "pad") -> Pipeline:
    """One ordered pass for `evaluate`, the last batch padded, short or left out."""
    data = PaddedBatches(x, y, sample_weight, batch=batch, remainder=remainder,
                         split=row_split(strategy))
    return Pipeline(data, data.steps, data.samples, data.pad, left_out=data.left_out)


def predict_pipeline(x: Any, batch: int, strategy: Any = None,
                     remainder: str = "pad") -> Pipeline:
    """One ordered pass of inputs only; padding repeats sample 0 and is trimmed afterwards
    (or the last batch is short). A batch of up to `WHOLE_PREDICTIONS` rows runs whole on
    every device: split, each device's share is a matrix product of another shape, which
    rounds differently in the last bit than one device's whole batch (a reloaded model's
    predictions, compared in a plain cell, then differ)."""
    data = PaddedBatches(x, batch=batch, labelled=False,
                         remainder="short" if remainder == "short" else "pad",
                         split=row_split(strategy), whole=batch <= WHOLE_PREDICTIONS)
    return Pipeline(data, data.steps, data.samples, data.pad)


WHOLE_PREDICTIONS = 512  # rows of a prediction batch run whole on every device, at most


class WholeRows(np.ndarray):
    """A batch every process holds whole (a short batch the data rows do not divide, on
    several hosts): `Backend.replica_steps` gives it to every device as it is, where a
    process's own share would be assembled into a global batch."""


def data_rows(distribution: Any) -> int:
    """How many parts a batch is split into: the size of the distribution's batch axis."""
    return row_split(distribution).rows


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """A global batch split into `rows` equal parts along the mesh's batch axis, of which
    this process feeds parts `first` to `first + count - 1` (every part in one process; on
    several hosts, the parts its devices hold: half each on `2x4`, all of it on each where
    the batch axis does not span the hosts, as `--shard model --mesh 1x8`)."""

    rows: int = 1
    first: int = 0
    count: int = 1

    def mine(self, batch: Any) -> Any:
        """This process's rows of `batch` (whose length the parts divide)."""
        if self.count == self.rows:
            return batch
        part = len(batch) // self.rows
        return batch[self.first * part:(self.first + self.count) * part]


def row_split(distribution: Any) -> RowSplit:
    """The distribution's batch axis, and the parts of it this process's devices hold.

    Raises:
        BatchSizeError: this process's devices are not one run of the batch axis (a mesh
            tpu_magic does not build).
    """
    if distribution is None:
        return RowSplit()
    mesh = distribution.device_mesh
    name = getattr(distribution, "batch_dim_name", None) or mesh.axis_names[0]
    if name not in mesh.axis_names:
        return RowSplit()
    axis = list(mesh.axis_names).index(name)
    devices = np.moveaxis(np.asarray(mesh.devices), axis, 0)
    rows = devices.shape[0]
    if _processes() == 1:
        return RowSplit(rows, 0, rows)
    import jax

    here = jax.process_index()
    parts = [i for i in range(rows)
             if any(d.process_index == here for d in np.ravel(devices[i]))]
    if not parts or parts != list(range(parts[0], parts[-1] + 1)):
        raise BatchSizeError(f"process {here}'s devices are not one run of the mesh's "
                             f"{name!r} axis {mesh.shape}: lay the mesh out host by host")
    return RowSplit(rows, parts[0], len(parts))


def process_share(split: RowSplit) -> Callable[[Any], Any] | None:
    """What of each whole batch of a user's dataset this process gives Keras: on several
    hosts, every host reads every batch (in the dataset's order, as one process would) and
    keeps its own rows of it (`RowSplit.mine`), as for arrays, or the whole batch, marked
    `WholeRows`, where the mesh's data rows do not divide it. None in one process."""
    if _processes() == 1:
        return None

    def share(batch: Any) -> Any:
        x = keras.utils.unpack_x_y_sample_weight(batch)[0]
        if num_samples(x) % split.rows:
            return keras.tree.map_structure(lambda v: np.asarray(v).view(WholeRows), batch)
        return keras.tree.map_structure(lambda v: split.mine(np.asarray(v)), batch)

    return share


def _processes() -> int:
    import jax

    return jax.process_count()
