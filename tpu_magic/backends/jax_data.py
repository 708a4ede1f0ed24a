"""NumPy inputs as whole, padded batches for the JAX backend (a Keras `PyDataset`).

The same rules as `tf_data` (tf.data, TensorFlow backend) without TensorFlow: every
batch has exactly the global batch size, so `DataParallel` can split it over the
devices (a smaller last batch fails: keras-team/keras#21167, ZeroDivisionError with
fewer samples than devices). Padding is masked out of losses and metrics by `exactness`.
Epoch `e`'s order depends only on (seed, e), so a resumed run sees the same order.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

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


def _processes() -> int:
    import jax

    return jax.process_count()


def whole(batch: Any, rows: int, full: int, masked: bool) -> tuple[Any, int]:
    """One batch of a user's input made whole for a mesh of `rows` data rows.

    With `masked` (the model's loss takes the padding mask, and the batch has targets),
    every batch carries the packed sample weight (`core.packed`: the same structure for
    every batch, so one compiled step serves all), and a batch smaller than the largest
    seen so far (`full`), or one the data rows do not divide, is padded with its padding
    masked out. Otherwise the batch goes as it is: one the rows do not divide runs whole on
    every device (`Backend.replica_steps`), exactly as on one device.

    Returns:
        (the batch to give Keras, the largest batch seen now).
    """
    x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
    if not masked or y is None:
        return batch, max(full, num_samples(x))
    x, y, weight = (None if a is None else keras.tree.map_structure(np.asarray, a)
                    for a in (x, y, weight))
    n = num_samples(x)
    size = max(full, -(-n // rows) * rows)
    index = np.concatenate([np.arange(n), np.zeros(size - n, int)])

    def pick(a: Any) -> Any:
        return a if size == n else keras.tree.map_structure(lambda v: v[index], a)

    mask = (np.arange(size) < n).astype("float32")
    weight = np.ones(size, "float32") if weight is None else pick(weight).astype("float32")
    share = np.full(size, n / size, "float32")
    return (pick(x), pick(y), {MASK: mask, WEIGHT: weight, REAL: share}), size


def whole_batches(data: Any, rows: int, masked: bool, shuffle: bool = False,
                  class_weight: Any = None, steps: int | None = None, keep: int = 1) -> Any:
    """A user's batched input (a tf.data or grain dataset, a `PyDataset`, a generator, a
    KerasHub task's own pipeline) as Keras reads it, with each batch made whole (`whole`).

    Keras's own data adapter for the input reads it, so every pass sees each batch once, in
    the order plain Keras would (a `PyDataset`'s indices shuffled by `shuffle` as Keras
    does, a stream in its own order), a one-shot generator is read once, and `class_weight`
    is applied as Keras applies it. Nothing is read ahead of Keras. The first `keep`
    batches of each pass are kept (`first`), for the first-step parity check.
    """
    from keras.src.trainers.data_adapters import data_adapter, get_data_adapter

    inner = get_data_adapter(data, shuffle=shuffle and isinstance(data, keras.utils.PyDataset),
                             class_weight=class_weight, steps_per_epoch=steps)

    class WholeBatches(data_adapter.DataAdapter):
        """Keras's adapter of the input, each batch made whole (see `whole_batches`)."""

        def __init__(self) -> None:
            self.full = 0  # the largest batch seen (after padding)
            self.fed: list = []  # the first `keep` batches of the latest pass
            self.reading = [0.0, 0]  # seconds spent reading batches, and how many

        def get_numpy_iterator(self) -> Iterator[Any]:
            self.fed = []
            batches = iter(inner.get_numpy_iterator())
            while True:
                start = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                batch, self.full = whole(batch, rows, self.full, masked)
                self.reading[0] += time.perf_counter() - start
                self.reading[1] += 1
                if len(self.fed) < keep:
                    self.fed.append(batch)
                yield batch

        def first(self, k: int) -> list:
            return self.fed[:k]

        def peek(self) -> Any:
            """The first batch, made whole, where it can be read without changing what Keras
            reads next (see `first_batch_safely`); None where it cannot."""
            first = first_batch_safely(data)
            return None if first is None else whole(first, rows, 0, masked)[0]

        def read_seconds(self) -> tuple[float, int]:
            """Time spent reading and making batches whole as Keras read them, and how many
            batches (the input's share of a step, measured without reading it again)."""
            return self.reading[0], self.reading[1]

        def get_jax_iterator(self) -> Iterator[Any]:
            return self.get_numpy_iterator()  # Keras's JAX trainer places NumPy batches

        @property
        def num_batches(self) -> int | None:
            return inner.num_batches

        @property
        def batch_size(self) -> int | None:
            return self.full or inner.batch_size

        @property
        def has_partial_batch(self) -> bool | None:
            return inner.has_partial_batch

        @property
        def partial_batch_size(self) -> int | None:
            return inner.partial_batch_size

        def on_epoch_begin(self) -> None:
            inner.on_epoch_begin()

        def on_epoch_end(self) -> None:
            inner.on_epoch_end()

    return WholeBatches()


def first_batch_safely(source: Any) -> Any:
    """A user's first batch, read only where reading it changes nothing Keras reads later: a
    grain dataset (a pure description: every pass from the start reads the same batches, its
    shuffles seeded; a KerasHub task's own pipeline), or a tf.data dataset with no shuffle in
    it (a new pass of a shuffling one would draw the next order). None for anything else: a
    `PyDataset` may be a stream, a generator is read once."""
    kinds = {cls.__name__ for cls in type(source).__mro__
             if cls.__module__.startswith("grain")}
    try:
        if "MapDataset" in kinds:
            return source[0] if len(source) else None
        if "IterDataset" in kinds:
            return next(iter(source), None)
    except (IndexError, TypeError, KeyError):
        return None
    if hasattr(source, "element_spec") and not _shuffles(source):
        for batch in source.take(1):
            return keras.tree.map_structure(np.asarray, batch)
    return None


def _shuffles(dataset: Any) -> bool:
    """Whether a tf.data pipeline has a shuffle anywhere in it."""
    pending = [dataset]
    while pending:
        node = pending.pop()
        if "Shuffle" in type(node).__name__:
            return True
        pending += [n for n in (getattr(node, "_input_dataset", None),) if n is not None]
        pending += list(getattr(node, "_input_datasets", ()) or ())
    return False
