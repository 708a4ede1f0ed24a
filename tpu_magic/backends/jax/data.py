"""NumPy inputs as whole, padded batches for the JAX backend (a Keras `PyDataset`).

The same rules as `backends.tf.data` (tf.data, TensorFlow backend) without TensorFlow: every
batch has exactly the global batch size, so `DataParallel` can split it over the
devices (a smaller last batch fails: keras-team/keras#21167, ZeroDivisionError with
fewer samples than devices). Padding is masked out of losses and metrics by `exactness`.
A shuffled order is drawn as plain Keras's JAX trainer draws it (its `ArrayDataAdapter`):
from NumPy's global generator, a permutation at the start of each pass (`shuffle=True`)
or of each batch (`shuffle="batch"`), so the notebook's generator ends where plain Keras
leaves it, and the order is plain Keras's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import numpy as np

from tpu_magic.core.arrays import Pipeline, batch_shapes, num_samples
from tpu_magic.core.batching import steps_for
from tpu_magic.core.errors import BatchSizeError
from tpu_magic.core.packed import MASK, REAL, WEIGHT


class PaddedBatches(keras.utils.PyDataset):
    """Batch `i` of the current pass: indices into the arrays, -1 for padding.

    Args:
        x, y, sample_weight: NumPy arrays or structures of them (`y`, `sample_weight` may
            be None).
        batch: the global batch.
        shuffle: Keras's `shuffle`: False, True (a new order each pass) or "batch" (each
            batch's rows shuffled among themselves), drawn as plain Keras draws it.
        build_pass: plain Keras would read one batch of a pass of its own to build the
            model before the first (`core.steps.builds_from_a_pass`): its order is drawn
            first, and left unused, so the later draws are plain Keras's.
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

    A pass starts where its reader reads batch 0 (Keras's iterator, or the device loop's
    `group`); `upcoming` reads the next pass's first batches without starting it. With
    padding, batches carry `exactness`'s packed sample weight, as in `backends.tf.data`.
    """

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, *, batch: int,
                 shuffle: bool | str = False, build_pass: bool = False,
                 remainder: str = "pad", labelled: bool = True,
                 split: RowSplit | None = None, whole: bool = False):
        super().__init__()
        self.x, self.y, self.sample_weight, self.whole = x, y, sample_weight, whole
        self.split = split or RowSplit()
        self.batch, self.shuffle, self.labelled = batch, shuffle, labelled
        self.samples = num_samples(x)
        drop = remainder == "drop"
        self.steps = steps_for(self.samples, batch, drop=drop)
        self.pad = self.steps * batch - self.samples if remainder == "pad" else 0
        self.left_out = self.samples - self.steps * batch if drop else 0
        self._unused_draws = int(bool(shuffle) and build_pass)  # the build pass's draw
        self._next: _Pass | None = None  # the next pass, its order drawn ahead (`upcoming`)
        self._pass = _Pass(self._padded(np.arange(self.samples)))
        self._first: _Pass | None = None  # the first pass read (`first`)

    # -- the order, drawn as plain Keras draws it ------------------------------------------

    def _padded(self, order: np.ndarray) -> np.ndarray:
        return np.concatenate([order[:self.samples - self.left_out], np.full(self.pad, -1)])

    def _drawn(self) -> "_Pass":
        """The next pass: NumPy's global generator draws its order where plain Keras's
        `shuffle=True` does (after the build pass's draw, left unused: a whole order, or
        for `shuffle="batch"` its first batch's)."""
        while self._unused_draws:
            np.random.permutation(self.samples if self.shuffle is True
                                  else min(self.batch, self.samples))
            self._unused_draws -= 1
        if self.shuffle is True:
            return _Pass(self._padded(np.random.permutation(self.samples)))
        return _Pass(self._padded(np.arange(self.samples)))

    def build_pass_skipped(self) -> None:
        """Keras built the model without reading a pass of its own (it was built, or given a
        batch): the draw plain Keras's build pass makes is made now, when it would be."""
        if self._unused_draws and self._next is None:
            self._next = self._drawn()

    def _start_pass(self) -> None:
        self._pass = self._next if self._next is not None else self._drawn()
        self._next = None
        if self._first is None:
            self._first = self._pass

    def upcoming(self, k: int) -> list:
        """The next pass's first `k` batches, as its reader will read them, without starting
        it (a measured step's, the model's build)."""
        if self._next is None:
            self._next = self._drawn()
        return [self._batch(i, self._next) for i in range(min(k, self.steps))]

    def first(self, k: int) -> list:
        """The first pass's first `k` batches as it was (or, before it, will be) read: the
        first-step check's batches."""
        if self._first is None:
            return self.upcoming(k)
        return [self._batch(i, self._first) for i in range(min(k, self.steps))]

    def read_again(self, i: int) -> tuple:
        """Batch `i` of the current pass read again, drawing nothing (its input cost, timed
        after the fit: `training.fit.utilization`)."""
        return self._batch(i, self._pass, draw=False)

    def _rows(self, i: int, of: "_Pass | None" = None, draw: bool = True) -> np.ndarray:
        """Batch `i`'s indices in its pass's order; `shuffle="batch"`: its real rows in an
        order of their own, drawn when the batch is first read (as plain Keras draws it)."""
        of = of or self._pass
        index = of.order[i * self.batch:(i + 1) * self.batch]
        if self.shuffle != "batch" or (not draw and i not in of.batches):
            return index
        if i not in of.batches:
            real = index[index >= 0]
            shuffled = np.random.permutation(len(real)) + int(real[0]) if len(real) else real
            of.batches[i] = np.concatenate([shuffled, index[len(real):]])
        return of.batches[i]

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple:
        if i == 0:
            self._start_pass()
        return self._batch(i)

    def _batch(self, i: int, of: "_Pass | None" = None, draw: bool = True) -> tuple:
        index = self._rows(i, of, draw)
        # a short batch, or every batch where asked: given whole to every process and device
        whole = self.whole or len(index) % self.split.rows != 0
        # the share of real rows in the whole batch, on every process (padding alone reads it)
        share = float(np.mean(index >= 0)) if self.pad else 1.0
        index = index if whole else self.split.mine(index)
        return self._gathered(index, share, (lambda v: v.view(WholeRows)) if whole else None)

    def group(self, first: int, count: int) -> list[tuple[Any, bool]]:
        """This epoch's batches `first` to `first + count - 1`, for a loop that runs them
        together (`backends.jax.loop`): the full ones gathered at once and stacked
        along a new first axis ((k, batch, ...) arrays), a short last one on its own, as
        (data, stacked). The same rows, padding and weights as `self[i]` each, in one
        process (several processes read a batch at a time)."""
        if first == 0:
            self._start_pass()
        stop = min(first + count, self.steps)
        short = stop == self.steps and \
            len(self._pass.order) - (stop - 1) * self.batch < self.batch
        full = stop - first - int(short)
        found = []
        if full:
            index = np.stack([self._rows(i) for i in range(first, first + full)]) \
                if self.shuffle == "batch" else \
                self._pass.order[first * self.batch:(first + full) * self.batch].reshape(
                    full, self.batch)
            share = np.mean(index >= 0, axis=1, keepdims=True).astype("float32")
            marked = (lambda v: v.view(WholeRows)) if self.whole else None
            found.append((self._gathered(index, share, marked), True))
        if short:
            found.append((self._batch(stop - 1), False))
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



@dataclasses.dataclass
class _Pass:
    """One pass over the data: its order, and (`shuffle="batch"`) each batch's rows in the
    order drawn for it."""

    order: np.ndarray
    batches: dict = dataclasses.field(default_factory=dict)


def train_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, shuffle: bool | str,
                   repeat: bool = True, seed: int | None = None, first_epoch: int = 0,
                   strategy: Any = None, remainder: str = "pad",
                   build_pass: bool = False) -> Pipeline:
    """Shuffled whole batches for `fit`, the last one padded, short or left out (`remainder`),
    in plain Keras's order (`PaddedBatches`; `build_pass`: see there).

    `repeat`, `seed` and `first_epoch` are accepted for the same signature as
    `backends.tf.data.train_pipeline`: Keras asks a PyDataset for each pass's batches
    itself, and the order is drawn as plain Keras draws it, resumed or not.
    """
    data = PaddedBatches(x, y, sample_weight, batch=batch, shuffle=shuffle,
                         build_pass=build_pass, remainder=remainder, split=row_split(strategy))
    first = data.first

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
