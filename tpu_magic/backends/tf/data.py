"""NumPy inputs as tf.data pipelines of whole, static-shape batches (a user's own datasets:
`datasets`).

Every batch has exactly the global batch size (TPUs need static shapes; under
MirroredStrategy an uneven split fails). The samples that fill the last batch
are padding, masked out of losses and metrics by `exactness`'s packed sample weight.
An endless `repeat()` with `steps_per_epoch` and a prefetch keeps the replicas fed at
every epoch start, where NumPy arrays handed to Keras stall.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from tpu_magic.core.arrays import Pipeline, num_samples
from tpu_magic.core.batching import steps_for
from tpu_magic.core.random_state import order_seed
from tpu_magic.backends.tf.batch_parts import (PARALLEL_LOADS, ReplicaParts, packed,
                                              replica_cuts, splits_per_replica, traced_as_is,
                                              without_autotune)


def _as_tuples(x: Any) -> Any:
    """Lists become tuples at every level: tf.data keeps tuples as structures (several
    inputs or outputs) but would stack a list into one tensor."""
    if isinstance(x, (list, tuple)):
        return tuple(_as_tuples(v) for v in x)
    if isinstance(x, dict):
        return {k: _as_tuples(v) for k, v in x.items()}
    return x


def _index_batches(samples: int, batch: int, shuffle: bool, repeat: bool, seed: int | None = None,
                   first_epoch: int = 0, drop: bool = False) -> tuple[tf.data.Dataset, int, int]:
    """Batches of indices into the data, -1 for padding; `drop`: no padding, the remainder
    of each epoch's order is left out instead."""
    steps = steps_for(samples, batch, drop=drop)
    pad = 0 if drop else steps * batch - samples
    if shuffle and repeat:
        # Epoch e's order depends only on (seed, e): a run resumed at epoch e sees the
        # same order as the run it continues.
        seed_tensor = tf.constant(order_seed() if seed is None else seed, tf.int64)
        padding = tf.fill([pad], tf.constant(-1, tf.int64))

        def epoch_order(epoch):
            order = tf.random.experimental.stateless_shuffle(
                tf.range(samples, dtype=tf.int64), seed=tf.stack([seed_tensor, epoch]))
            return tf.data.Dataset.from_tensor_slices(tf.concat([order[:steps * batch - pad],
                                                                 padding], 0))

        indices = tf.data.Dataset.range(first_epoch, 2**62).flat_map(epoch_order)
        return indices.batch(batch, drop_remainder=True), steps, pad
    indices = tf.data.Dataset.range(samples)
    if shuffle:
        indices = indices.shuffle(samples, seed=seed, reshuffle_each_iteration=True)
    if pad:
        indices = indices.concatenate(tf.data.Dataset.from_tensors(tf.constant(-1, tf.int64)).repeat(pad))
    if repeat:
        indices = indices.repeat()
    return indices.batch(batch, drop_remainder=True), steps, pad


def _loaded(indices: tf.data.Dataset, load: Callable[[tf.Tensor], Any]) -> tf.data.Dataset:
    """Batches of indices → batches of data, a few batches ahead, with fixed parallelism.

    `load` is traced without AutoGraph (`traced_as_is`). tf.data's autotuning is off:
    freeing an iterator waits for its autotune thread. Its default graph rewrites are off
    too: this pipeline is already what they aim for, and looking costs every iterator's
    start (a user's dataset keeps them, `whole_batches`).
    """
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    return without_autotune(indices.map(traced_as_is(load), num_parallel_calls=PARALLEL_LOADS)
                             .prefetch(2).with_options(options))


def _distributed(indices: tf.data.Dataset, load: Callable[..., Any], batch: int,
                 strategy: Any, whole: bool = False,
                 real_load: Callable[[tf.Tensor], Any] | None = None) -> tuple[Any, Any]:
    """Under a MirroredStrategy with several replicas: one pipeline on the host whose every
    element is a global batch already cut into the replicas' rows (`ReplicaParts`);
    otherwise the plain dataset (Keras distributes it). Returns the dataset and
    `arrays.batch_shapes` of one global batch (None where a shape is not static), told from
    the pipeline's element spec, without reading.

    `load(index, keep)` maps a global batch of indices to data, gathering only the rows
    `keep` cuts from it: each replica's part is gathered on its own, since a cut of a
    gathered whole batch would share, and so keep alive, the whole batch's buffer. `whole`:
    every replica takes the whole batch (fewer samples than replicas, for a loss that
    cannot skip padding). `real_load` maps a batch of real indices (no padding) to data as
    plain Keras gets it: given, the parts can switch to every replica taking the whole
    batch, its padding left out (`ReplicaParts.every_replica_whole`).
    """
    if not splits_per_replica(strategy):
        dataset = _loaded(indices, lambda index: load(index, _whole))
        return dataset, _shapes(dataset.element_spec, batch)
    replicas = strategy.num_replicas_in_sync
    cuts = replica_cuts(batch, strategy) if not whole else \
        [_whole] * replicas  # each replica: the whole batch
    dataset = _loaded(indices, lambda index: tuple(load(index, cut) for cut in cuts))

    def whole_batches(read: int) -> tf.data.Dataset:
        real = indices.skip(read).map(lambda index: tf.boolean_mask(index, index >= 0))
        return _loaded(real, lambda index: (real_load(index),) * replicas)

    # a replica's rows of every array of the global batch: the same but the first dimension
    return (ReplicaParts(dataset, whole_batches if real_load is not None else None),
            _shapes(dataset.element_spec[0], batch))


def _shapes(spec: Any, batch: int) -> tuple | None:
    """`arrays.batch_shapes` of a global batch whose arrays have `spec` but for their first
    dimension, `batch`; None where another dimension is not static."""
    flat = keras.tree.flatten_with_path(spec)
    if not all(s.shape.rank and None not in s.shape.as_list()[1:] for _, s in flat):
        return None
    return tuple((path, (batch, *s.shape.as_list()[1:]), s.dtype.name) for path, s in flat)


def _whole(t: Any) -> Any:
    return t


def _gather(data: Any, index: tf.Tensor) -> Any:
    return tf.nest.map_structure(lambda a: tf.gather(a, index), data)


def _constants(arrays: Any) -> Any:
    with tf.device("/cpu:0"):
        return tf.nest.map_structure(tf.convert_to_tensor, _as_tuples(arrays))


def _labelled_loader(x: Any, y: Any, sample_weight: Any, pad: int) -> Callable[[tf.Tensor], Any]:
    """Maps a batch of indices (-1 = padding) to (x[, y][, weight]).

    With padding, the weight is `exactness`'s packed one (the real-sample mask, the user's
    weights, the batch's share of real samples); without, the user's weights as given.
    """
    data = _constants({key: value for key, value in (("x", x), ("y", y), ("w", sample_weight))
                       if value is not None})

    def load(index, keep=_whole):
        if pad:  # -1 marks padding; the share is of the whole batch a replica's rows are cut from
            share = _real_share(index)
            index = keep(index)
            real = index >= 0
            picked = _gather(data, tf.where(real, index, 0))
        else:  # every index real: a gather alone (fewer ops to trace for every replica's pipeline)
            picked = _gather(data, keep(index))
        if y is None:  # as Keras gives it: the inputs alone (a custom train_step gets `x`)
            return picked["x"]
        labelled = (picked["x"], picked["y"])
        if pad:
            return labelled + (packed(tf.cast(real, tf.float32), picked.get("w"), share),)
        return labelled if sample_weight is None else labelled + (picked["w"],)

    return load


def _real_share(index: tf.Tensor) -> tf.Tensor:
    """The share of a batch of indices that are real samples (-1: padding)."""
    return tf.reduce_mean(tf.cast(index >= 0, tf.float32))


def train_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, shuffle: bool | str,
                   repeat: bool = True, seed: int | None = None, first_epoch: int = 0,
                   strategy: Any = None, remainder: str = "pad",
                   build_pass: bool = False) -> Pipeline:
    """Shuffled whole batches for `fit`: the last one padded (see `exactness`), or with
    `remainder="drop"` (no padding may reach the model's loss) the remainder of each epoch's
    order left out: replicas need equal shares.

    With `repeat`, the dataset is endless and `fit` gets `steps_per_epoch`; without,
    it is one pass per epoch (needed with steps_per_execution > 1, where Keras runs
    whole executions of K steps on an endless dataset and so overshoots the epoch).
    With `repeat`, the order of epoch `e` follows from `seed` and `e` alone
    (`first_epoch` is the epoch `fit` starts at). Under a MirroredStrategy the result is
    already distributed (see `_distributed`). The order is tf.data's, drawn from `seed`
    (`core.random_state.order_seed` where None): like plain Keras's shuffle on TensorFlow (a
    graph-level seed), it draws nothing from the notebook's generators, so `build_pass`
    changes nothing here; `shuffle="batch"` shuffles whole passes.
    """
    samples = num_samples(x)
    shuffle = bool(shuffle)
    seed = order_seed() if seed is None else seed  # every replica's pipeline needs the same order
    indices, steps, pad = _index_batches(samples, batch, shuffle, repeat=repeat, seed=seed,
                                         first_epoch=first_epoch, drop=_drops(remainder))
    load = _labelled_loader(x, y, sample_weight, pad)
    # Each epoch's order follows from (seed, epoch) alone, except a reshuffle of one pass
    # per epoch, whose next order cannot be read again.
    first = None if shuffle and not repeat else _FirstBatches(indices, load)
    dataset, one = _distributed(indices, load, batch, strategy, whole=remainder == "whole",
                                real_load=_labelled_loader(x, y, sample_weight, 0))
    return Pipeline(dataset, steps, samples, pad,
                    left_out=samples - steps * batch if _drops(remainder) else 0, first=first,
                    shapes=None if one is None else lambda k: [one] * min(k, steps))


class _FirstBatches:
    """A pipeline's first `k` batches (`_first`), read once: a later ask for as many or fewer
    (the first step's check after the fit's plan) reads nothing again."""

    def __init__(self, indices: tf.data.Dataset, load: Callable[[tf.Tensor], Any]) -> None:
        self.indices, self.load, self.read = indices, load, []

    def __call__(self, k: int) -> list:
        if len(self.read) < k:
            self.read = _first(self.indices, self.load, k)
        return self.read[:k]


def _first(indices: tf.data.Dataset, load: Callable[[tf.Tensor], Any], k: int) -> list:
    """The first `k` whole batches of a pipeline, as NumPy, read on their own."""
    return [tf.nest.map_structure(lambda t: t.numpy(), batch)
            for batch in indices.take(k).map(traced_as_is(load))]


def eval_pipeline(x: Any, y: Any, sample_weight: Any, batch: int, strategy: Any = None,
                  remainder: str = "pad") -> Pipeline:
    """One ordered pass for `evaluate`, the last batch padded (or left out: "drop")."""
    samples = num_samples(x)
    indices, steps, pad = _index_batches(samples, batch, shuffle=False, repeat=False,
                                         drop=_drops(remainder))
    load = _labelled_loader(x, y, sample_weight, pad)
    return Pipeline(_distributed(indices, load, batch, strategy, whole=remainder == "whole",
                                 real_load=_labelled_loader(x, y, sample_weight, 0))[0],
                    steps, samples, pad,
                    left_out=samples - steps * batch if _drops(remainder) else 0)


def _drops(remainder: str) -> bool:
    """TensorFlow's replicas take equal shares: a remainder is padded or left out (or, with
    "whole", one batch of every sample goes to each replica)."""
    if remainder not in ("pad", "drop", "whole"):
        raise ValueError(f"remainder {remainder!r}: TensorFlow pads, drops or gives whole")
    return remainder == "drop"


def predict_pipeline(x: Any, batch: int, strategy: Any = None,
                     remainder: str = "pad") -> Pipeline:
    """One ordered pass of inputs only; padding repeats sample 0 and is trimmed afterwards."""
    samples = num_samples(x)
    indices, steps, pad = _index_batches(samples, batch, shuffle=False, repeat=False)
    data = _constants(x)
    return Pipeline(_distributed(indices, lambda i, keep: (_gather(data, tf.maximum(keep(i), 0)),),
                                 batch, strategy)[0], steps, samples, pad)
