"""A user's batched input (a tf.data or grain dataset, a `PyDataset`, a generator, a KerasHub
task's own pipeline) read by Keras's own data adapter, each batch made whole for the
devices: the same batches, once each, in the order plain Keras reads them.

Both backends use it: JAX for every such input, TensorFlow for those that are not tf.data
(a `PyDataset`, a generator, grain), whose short batches its replicas cannot split.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Iterator

import keras
import numpy as np
from keras.src.trainers.data_adapters.data_adapter import DataAdapter

from tpu_magic.core.arrays import num_samples
from tpu_magic.core.packed import MASK, REAL, WEIGHT


def whole(batch: Any, rows: int, full: int, masked: bool, cut: bool = False
          ) -> tuple[Any, int | None]:
    """One batch of a user's input made whole for a mesh of `rows` data rows.

    With `masked` (the model's loss takes the padding mask, and the batch has targets),
    every batch carries the packed sample weight (`core.packed`: the same structure for
    every batch, so one compiled step serves all), and a batch smaller than the largest
    seen so far (`full`), or one the data rows do not divide, is padded with its padding
    masked out. Otherwise the batch goes as it is: one the rows do not divide runs whole on
    every device (`Backend.replica_steps`), exactly as on one device; with `cut` (replicas
    that cannot run a short batch whole: TensorFlow's) it is cut to a whole number of rows
    per replica, and one with fewer rows than replicas is left out (None).

    Returns:
        (the batch to give Keras or None, the largest batch seen now).
    """
    x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
    if not masked or y is None:
        n = num_samples(x)
        if not cut or n % rows == 0:
            return batch, max(full, n)
        keep = n - n % rows
        if keep == 0:
            return None, full
        return keras.tree.map_structure(lambda v: np.asarray(v)[:keep], batch), max(full, keep)
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
                  class_weight: Any = None, steps: int | None = None, keep: int = 1,
                  cut: bool = False, share: Callable[[Any], Any] | None = None,
                  split: Any = None) -> Any:
    """A user's batched input (a tf.data or grain dataset, a `PyDataset`, a generator, a
    KerasHub task's own pipeline) as Keras reads it, with each batch made whole (`whole`).

    Keras's own data adapter for the input reads it, so every pass sees each batch once, in
    the order plain Keras would (a `PyDataset`'s indices shuffled by `shuffle` as Keras
    does, a stream in its own order), a one-shot generator is read once, and `class_weight`
    is applied as Keras applies it. Nothing is read ahead of Keras. The first `keep`
    batches of each pass are kept (`first`), for the first-step parity check. `share`:
    what of each whole batch this process gives Keras (several hosts: its own rows; the
    batches kept, `peek` and the batch size stay the global batch's). `split` (with
    `share`, a `jax.data.RowSplit`): a tf.data dataset's full batches leave its pipeline as
    this process's rows alone (`_cut_at_source`), so the other hosts' rows are never
    converted, made whole or kept here. On TensorFlow (`cut`) the batches come as a tf.data
    dataset from a generator, typed from Keras's own, that Keras distributes.
    """
    from keras.src.trainers.data_adapters import get_data_adapter

    source, full_size = (data, 0) if split is None or class_weight is not None else \
        _cut_at_source(data, split)

    def adapter() -> Any:
        inner = get_data_adapter(_freed_at_once(source),
                                 shuffle=shuffle and isinstance(data, keras.utils.PyDataset),
                                 class_weight=class_weight, steps_per_epoch=steps)
        if cut and getattr(inner, "enqueuer", None) is not None:
            # TensorFlow: a PyDataset's worker threads fed through tf.data under a
            # MirroredStrategy hang the cell at its first batch (Keras peeks the distributed
            # iterator to build the model before the epoch; the enqueuer's queue never
            # fills). Its batches are read in the calling thread instead: the same batches,
            # in the same order (Keras's own shuffle of the indices), without the parallel
            # reads.
            inner.enqueuer = None
        return inner

    declared = keras.tree.flatten(data.element_spec)[0].shape[0] if full_size else None
    return WholeBatches(data, adapter, rows, masked, keep=keep, cut=cut, share=share,
                        full_size=full_size, declared=declared)


class WholeBatches(DataAdapter):
    """Keras's adapter of the input (`inner`, made by `adapter` when first asked for), each
    batch made whole (see `whole_batches`; `full_size`: where cut at the source, a full
    batch's rows, 0 elsewhere; `declared`: there, the batch the input declares).

    Keras's adapter is made when Keras would make it, not before: a generator's adapter
    reads its first batches as it is made, and a fit's validation generator is first asked
    for at the first validation, after the first epoch's training batches (plain Keras makes
    its validation iterator then). Made earlier, a validation generator that draws from
    NumPy's global generator would draw before the training batches do, and both would
    train and validate on other data than plain Keras's."""

    def __init__(self, data: Any, adapter: Callable[[], Any], rows: int, masked: bool, *,
                 keep: int, cut: bool, share: Callable[[Any], Any] | None, full_size: int,
                 declared: int | None) -> None:
        self.data, self.rows, self.masked = data, rows, masked
        self._adapter, self._inner = adapter, None
        self.keep, self.cut, self.share = keep, cut, share
        self.full_size, self._declared = full_size, declared
        self.full = 0  # the largest batch seen (after padding)
        self.fed: list = []  # the first `keep` batches of the latest pass
        self.reading = [0.0, 0]  # seconds spent reading batches, and how many
        self._passes: Iterator[int] | None = None  # the tf.data passes started (TensorFlow)

    @property
    def inner(self) -> Any:
        """Keras's own adapter of the input, made the first time it is asked for."""
        if self._inner is None:
            self._inner = self._adapter()
        return self._inner

    @property
    def declared(self) -> int | None:
        """The batch the input declares (Keras's adapter's, where not cut at the source)."""
        return self._declared if self.full_size else self.inner.batch_size

    def get_numpy_iterator(self) -> Iterator[Any]:
        self.fed = []
        batches = iter(self.inner.get_numpy_iterator())
        full_size, rows, masked, cut = self.full_size, self.rows, self.masked, self.cut
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            # cut at the source: (the batch, whether it is this process's rows already)
            batch, mine = batch if full_size else (batch, False)
            if mine:  # of a full batch: nothing to pad, as `whole` gives it for `rows=1`
                batch, self.full = whole(batch, 1, 0, masked, cut)[0], \
                    max(self.full, full_size)
            else:
                batch, self.full = whole(batch, rows, self.full, masked, cut)
            self.reading[0] += time.perf_counter() - start
            if batch is None:
                continue
            self.reading[1] += 1
            if len(self.fed) < self.keep:  # where cut at the source, this process's rows
                self.fed.append(batch)
            yield batch if self.share is None or mine else self.share(batch)

    def first(self, k: int) -> list:
        return self.fed[:k]

    def peek(self) -> Any:
        """The first batch, made whole, where it can be read without changing what Keras
        reads next (see `first_batch_safely`); None where it cannot."""
        first = first_batch_safely(self.data)
        return None if first is None else whole(first, self.rows, 0, self.masked, self.cut)[0]

    def read_seconds(self) -> tuple[float, int]:
        """Time spent reading and making batches whole as Keras read them, and how many
        batches (the input's share of a step, measured without reading it again)."""
        return self.reading[0], self.reading[1]

    def get_jax_iterator(self) -> Iterator[Any]:
        return self.get_numpy_iterator()  # Keras's JAX trainer places NumPy batches

    def get_tf_dataset(self) -> Any:
        """The batches as a tf.data dataset (TensorFlow's trainer), typed from the first
        whole batch. That batch is read from the first pass itself (a spec from Keras's
        own adapter would read a generator's first batches, lost to the epoch)."""
        import tensorflow as tf

        first_pass = self.get_numpy_iterator()
        first = next(first_pass, None)
        if first is None:
            return tf.data.Dataset.from_tensors(0).take(0)
        spec = tf.nest.map_structure(
            lambda a: tf.TensorSpec((None,) + np.shape(a)[1:], tf.as_dtype(np.asarray(a).dtype)),
            first)
        # Under a strategy Keras's TensorFlow trainer reads one batch of a first pass to
        # build the model (`_maybe_symbolic_build`, in fit, evaluate and predict alike)
        # and starts the epoch on a second: the first two passes read one tape of the
        # first pass's batches, so what the first read (that batch, and whatever
        # tf.data's prefetch took, even after it was left) reaches the second, and a
        # one-shot generator loses nothing. The second pass takes each batch off the
        # tape as it reads it (the tape holds at most the prefetched few).
        # Where tpu_magic skips that read for a built model (`build_pass_skipped`), the
        # pass it would have made is counted all the same, so the epoch is still the second.
        tape = _Tape(itertools.chain([first], first_pass))
        count = self._passes = itertools.count(1)

        def passes() -> Iterator[Any]:
            n = next(count)
            return tape.read(keep=n == 1) if n <= 2 else self.get_numpy_iterator()

        return tf.data.Dataset.from_generator(passes, output_signature=spec)

    def build_pass_skipped(self) -> None:
        """Keras's TensorFlow trainer did not read the pass it reads one batch of to build
        the model (`backends/tf/call_start.py`): the next pass is the call's own, as if that
        one had been read (after the first, a fresh pass; the first call's, the tape)."""
        if self._passes is not None:
            next(self._passes)

    @property
    def num_batches(self) -> int | None:
        return self.inner.num_batches

    @property
    def batch_size(self) -> int | None:
        return self.full or self.declared

    @property
    def has_partial_batch(self) -> bool | None:
        return self.inner.has_partial_batch

    @property
    def partial_batch_size(self) -> int | None:
        return self.inner.partial_batch_size

    def on_epoch_begin(self) -> None:
        self.inner.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.inner.on_epoch_end()


def _cut_at_source(data: Any, split: Any) -> tuple[Any, int]:
    """A tf.data dataset whose full batches leave its pipeline as this process's rows alone
    (`split.first` to `split.first + split.count - 1` of `split.rows` equal parts), each
    with a flag saying so, as Keras's own multi-process datasets are cut (`rebatch` and
    `shard`: every host runs the pipeline, and keeps its part of each batch); a short batch
    comes whole, flagged False, to be padded and shared as before. (data, 0) where it cannot
    be cut so: not tf.data, its batch size unknown or not divided by the rows, or this
    process holds every row.

    Returns:
        (the dataset to read, its full batch size or 0).
    """
    if not hasattr(data, "element_spec") or split.count == split.rows:
        return data, 0
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops.distribute import compute_batch_size

    try:
        size = int(compute_batch_size(data))
    except Exception:  # noqa: BLE001 - an op tf.data cannot see through: read it whole
        return data, 0
    if size <= 0 or size % split.rows:
        return data, 0
    part = size // split.rows
    first, last = split.first * part, (split.first + split.count) * part

    def cut(*element: Any) -> tuple[Any, Any]:
        element = element[0] if len(element) == 1 else element
        full = tf.equal(tf.shape(tf.nest.flatten(element)[0])[0], size)
        return tf.cond(full, lambda: tf.nest.map_structure(lambda v: v[first:last], element),
                       lambda: element), full

    try:
        return data.map(cut), size
    except (TypeError, ValueError):  # sparse or ragged parts: read it whole
        return data, 0


def _freed_at_once(data: Any) -> Any:
    """A tf.data dataset with tf.data's autotuning off, where its options leave it unset.

    Keras stops reading a pass at its last step, and freeing an iterator that autotunes
    waits for its autotune thread, which sleeps in ever longer periods (as on TensorFlow,
    `backends.tf.data._loaded`), so a fit could wait seconds after its last step. The
    batches, their order and their values are the same; only how tf.data tunes itself
    changes.
    """
    if not hasattr(data, "with_options") or data.options().autotune.enabled is not None:
        return data
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return data.with_options(options)


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
    if hasattr(source, "element_spec") and hasattr(source, "take") and not _shuffles(source):
        for batch in source.take(1):
            return keras.tree.map_structure(np.asarray, batch)
    return None


def drawn_alike(dataset: Any) -> bool:
    """Whether a user's input can be drawn again without changing what the next pass reads:
    a tf.data dataset with no shuffle in it (a new pass of a shuffling one draws the next
    order)."""
    return hasattr(dataset, "element_spec") and not _shuffles(dataset)


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


class _Tape:
    """One pass of batches read by two readers (see `WholeBatches.get_tf_dataset`): the
    first keeps what it reads on the tape, the second takes it off."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches, self._lock = batches, threading.Lock()
        self._held: dict[int, Any] = {}
        self._pulled = 0

    def read(self, keep: bool) -> Iterator[Any]:
        index = 0
        while True:
            with self._lock:
                while self._pulled <= index:
                    try:
                        self._held[self._pulled] = next(self._batches)
                    except StopIteration:
                        return
                    self._pulled += 1
                if index not in self._held:  # the second reader took it: the first is done
                    return
                batch = self._held[index] if keep else self._held.pop(index)
            yield batch
            index += 1
