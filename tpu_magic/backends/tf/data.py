"""NumPy inputs as tf.data pipelines of whole, static-shape batches, and a user's batched
input made whole for the replicas (`user_batches`).

Every batch has exactly the global batch size (TPUs need static shapes; under
MirroredStrategy an uneven split fails). The samples that fill the last batch
are padding, masked out of losses and metrics by `exactness`'s packed sample weight.
An endless `repeat()` with `steps_per_epoch` and a prefetch keeps the replicas fed at
every epoch start, where NumPy arrays handed to Keras stall.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from tensorflow.python.distribute import distribute_utils, input_lib

from tpu_magic.core.arrays import Pipeline, num_samples
from tpu_magic.core.batching import steps_for
from tpu_magic.core.random_state import order_seed
from tpu_magic.core.packed import MASK, REAL, WEIGHT

_PARALLEL_LOADS = max(2, min(8, os.cpu_count() or 2))


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

    `load` is traced without AutoGraph (`_traced_as_is`). tf.data's autotuning is off:
    freeing an iterator waits for its autotune thread. Its default graph rewrites are off
    too: this pipeline is already what they aim for, and looking costs every iterator's
    start (a user's dataset keeps them, `whole_batches`).
    """
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    return _without_autotune(indices.map(_traced_as_is(load), num_parallel_calls=_PARALLEL_LOADS)
                             .prefetch(2).with_options(options))


def _traced_as_is(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` for tf.data's `map`, traced without AutoGraph's conversion: tpu_magic's
    loaders branch only on Python values, never on tensors, so converting them only costs
    tracing time at every fit."""
    return tf.autograph.experimental.do_not_convert(function)


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
    if not _splits_per_replica(strategy):
        dataset = _loaded(indices, lambda index: load(index, _whole))
        return dataset, _shapes(dataset.element_spec, batch)
    replicas = strategy.num_replicas_in_sync
    cuts = _replica_cuts(batch, strategy) if not whole else \
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


def _splits_per_replica(strategy: Any) -> bool:
    """Whether tpu_magic cuts every global batch into the replicas' parts itself:
    MirroredStrategy, several replicas."""
    return getattr(strategy, "num_replicas_in_sync", 1) > 1 and \
        type(strategy).__name__ == "MirroredStrategy"


def _replica_cuts(batch: int, strategy: Any) -> list[Callable[[Any], Any]]:
    """One function a replica: it cuts a whole batch (any structure) down to that replica's
    rows, in the replicas' order."""
    rows = batch // strategy.num_replicas_in_sync

    def cut_from(first: int) -> Callable[[Any], Any]:
        return lambda element: tf.nest.map_structure(lambda t: t[first:first + rows], element)

    return [cut_from(replica * rows) for replica in range(strategy.num_replicas_in_sync)]


class ReplicaParts(input_lib.DistributedDataset):
    """A host pipeline whose elements are tuples of the replicas' parts of a global batch,
    as Keras's TensorFlow trainer takes a distributed dataset: each element a structure of
    `PerReplica` values (`regroup`), which `strategy.run` hands out, a part to a replica.

    Not TensorFlow's own distribution: `experimental_distribute_dataset` (what Keras does
    with a plain dataset) frees its MultiDeviceIterator after a `fit`'s last step only once
    its per-device autotune threads wake, long enough to dominate a cell (and it can hang);
    `distribute_datasets_from_function` starts one pipeline per replica at every `fit`, a
    noticeable share of a short cell.

    Iterating gives a Python iterator, so Keras runs a step a call (under several mirrored
    replicas tpu_magic runs one step an execution anyway, keras-team/keras#19246); each part
    is read on the host and copied to its replica's device by the step. Only what Keras and
    tpu_magic use of a distributed dataset is here (iterating, its element spec, its
    cardinality); TensorFlow's own constructor is not run.
    """

    def __init__(self, parts: tf.data.Dataset,  # pylint: disable=super-init-not-called
                 whole: Callable[[int], tf.data.Dataset] | None = None):
        self._parts = parts
        # the batches after the first `read`, each the whole batch for every replica
        self._whole = whole
        self.whole = False  # every replica takes the whole batch (`every_replica_whole`)

    @property
    def gives_whole(self) -> bool:
        """Whether these parts can switch to every replica taking the whole batch."""
        return self._whole is not None

    def every_replica_whole(self) -> bool:
        """From the next batch on (in an iteration under way too), every replica takes the
        whole global batch, without padding: each computes what one device does. Returns
        whether it can (False: these parts cannot be given whole)."""
        if self._whole is None:
            return False
        self.whole = True
        return True

    def whole_batches(self, steps: int) -> list:
        """The first `steps` batches as every replica takes them whole, each a structure of
        `PerReplica` values as the iteration gives them."""
        return [distribute_utils.regroup(parts) for parts in self._whole(0).take(steps)]

    def __iter__(self) -> Iterator[Any]:
        whole = self.whole
        source, read = iter(self._whole(0) if whole else self._parts), 0
        while True:
            if self.whole and not whole:  # switched while this iteration was under way
                whole, source = True, iter(self._whole(read))
            try:
                parts = next(source)
            except StopIteration:
                return
            read += 1
            yield distribute_utils.regroup(parts)

    @property
    def element_spec(self) -> Any:
        """A replica's part, as a per-replica distributed dataset's spec is."""
        return self._parts.element_spec[0]

    @property
    def cardinality(self) -> int:
        """Global batches in the pipeline (negative: endless or unknown), as TensorFlow's
        distributed datasets give it: a number, not a method."""
        return int(self._parts.cardinality())


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
            return labelled + (_packed(tf.cast(real, tf.float32), picked.get("w"), share),)
        return labelled if sample_weight is None else labelled + (picked["w"],)

    return load


def _real_share(index: tf.Tensor) -> tf.Tensor:
    """The share of a batch of indices that are real samples (-1: padding)."""
    return tf.reduce_mean(tf.cast(index >= 0, tf.float32))


def _packed(mask: tf.Tensor, weight: tf.Tensor | None, share: tf.Tensor | None = None) -> dict:
    """`exactness`'s packed sample weight of a batch's rows: their real-sample mask, the
    user's weights (1 where none), and the whole batch's share of real samples (`share`;
    None: these rows are the whole batch) on every row."""
    share = tf.reduce_mean(mask) if share is None else share
    return {MASK: mask, WEIGHT: tf.ones_like(mask) if weight is None else tf.cast(weight, tf.float32),
            REAL: tf.fill(tf.shape(mask), share)}


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
            for batch in indices.take(k).map(_traced_as_is(load))]


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


def whole_batches(dataset: Any, batch: int, strategy: Any) -> Any:
    """A user's batched tf.data dataset of (x, y[, sample_weight]), every batch made whole.

    A batch with fewer rows (the last one, without `drop_remainder`) is padded to `batch`
    and every batch carries `exactness`'s packed sample weight (the user's weights, if
    any, inside it), so a partial batch splits over the replicas and counts by its real
    samples. Under a MirroredStrategy with several replicas every whole batch is cut into
    the replicas' parts on the host, as for NumPy inputs (`ReplicaParts` says why). The
    dataset's own steps (its maps, its shuffle, seeded or not) run once, in one pipeline,
    so every replica's part is of the same global batch. Switched to every replica taking
    the whole batch (`ReplicaParts.every_replica_whole`, before an iteration starts), each
    replica takes the dataset's own batches as they are.
    """
    def padded(*element):
        x, y = element[0], element[1]
        rows = tf.shape(tf.nest.flatten(x)[0])[0]
        pad = batch - rows

        def fill(t):
            return tf.pad(t, [[0, pad]] + [[0, 0]] * (len(t.shape) - 1))

        mask = tf.pad(tf.ones([rows], tf.float32), [[0, pad]])
        return (tf.nest.map_structure(fill, x), tf.nest.map_structure(fill, y),
                _packed(mask, fill(element[2]) if len(element) > 2 else None))

    whole = dataset.map(_traced_as_is(padded), num_parallel_calls=_PARALLEL_LOADS)
    if not _splits_per_replica(strategy):
        return whole
    cuts = _replica_cuts(batch, strategy)
    replicas = strategy.num_replicas_in_sync

    def whole_for_every_replica(read: int) -> tf.data.Dataset:  # the user's batches as given
        return _without_autotune(dataset.skip(read).map(
            _traced_as_is(lambda *element: (element,) * replicas)).prefetch(2))

    return ReplicaParts(_without_autotune(
        whole.map(_traced_as_is(lambda *element: tuple(cut(element) for cut in cuts)))
        .prefetch(2)), whole_for_every_replica)


def _without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """tf.data's autotuning off for the whole pipeline (options reach every input): see
    `_loaded` for why."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def equal_shares(dataset: Any, replicas: int) -> Any:
    """Each batch cut to a whole number of rows per replica (a partial last batch of 13 rows
    on 8 replicas keeps 8), and a batch with fewer rows than replicas dropped: no replica
    gets an empty share or a smaller one than the others. For steps that cannot skip
    padding (a custom `train_step`, a dataset of inputs only)."""
    def cut(*element):
        rows = tf.shape(tf.nest.flatten(element)[0])[0]
        keep = rows - rows % replicas
        parts = tf.nest.map_structure(lambda t: t[:keep], element)
        return parts if len(element) > 1 else parts[0]

    def not_empty(*element):
        return tf.shape(tf.nest.flatten(element)[0])[0] >= replicas

    batches = int(dataset.cardinality())
    last = _last_batch_rows(dataset)
    if batches < 0 or last is None:
        # Unknown: a filter (Keras then runs one step more per epoch on empty replica
        # batches, as for any dataset of unknown length under MirroredStrategy).
        return dataset.filter(not_empty).map(cut)
    if last < replicas:  # the last batch would leave a replica empty: it goes
        dataset = dataset.take(batches - 1)
    return dataset.map(cut)


def _last_batch_rows(dataset: Any) -> int | None:
    """Rows in the last batch of `rows.batch(B)` (maps after it allowed), where the rows'
    count is known; None where it cannot be told without reading the data."""
    node = dataset
    while node is not None:
        size = getattr(node, "_batch_size", None)
        if size is not None:
            batch = int(size)
            if bool(getattr(node, "_drop_remainder", False)):
                return batch
            rows = int(node._input_dataset.cardinality())
            return None if rows < 0 else (rows % batch or batch)
        node = getattr(node, "_input_dataset", None)
    return None


def labelled(dataset: Any) -> bool:
    """Whether a dataset's elements are (x, y) or (x, y, sample_weight)."""
    spec = dataset.element_spec
    return isinstance(spec, tuple) and len(spec) in (2, 3)


def dataset_batch_size(dataset: Any) -> int | None:
    """The batch size of a batched tf.data dataset, from its element spec or its batch op."""
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None
    for leaf in tf.nest.flatten(spec):
        shape = getattr(leaf, "shape", None)
        if shape is not None and shape.rank and shape[0] is not None:
            return int(shape[0])
    # An unknown first dimension (a last partial batch is possible): find the batch op.
    node = dataset
    while node is not None:
        size = getattr(node, "_batch_size", None)
        if size is not None:
            try:
                return int(size.numpy() if hasattr(size, "numpy") else size)
            except (TypeError, ValueError):
                return None
        node = getattr(node, "_input_dataset", None)
    return None


def user_batches(data: Any, strategy: Any, note: Callable[[str], None], masked: bool = True,
                 *, batch: int | None = None, shuffle: bool = False, class_weight: Any = None,
                 steps: int | None = None, keep: int = 1) -> tuple[Any, bool]:
    """A tf.data dataset split per replica with its batches made whole (Keras maps class
    weights into one itself). A `PyDataset` read by Keras's own adapter, one batch for one,
    as a tf.data dataset of whole batches Keras distributes (`keras_inputs.whole_batches`):
    short batches padded and masked, or cut to a whole number of rows per replica where the
    loss takes no mask (a replica cannot run an uneven share). A generator or a grain
    dataset goes to Keras's own adapter as it is (a wrapper would lose a one-shot
    generator's batches to Keras's build-time peek). `note` is the protocol's: nothing here
    needs to say anything."""
    import keras

    if hasattr(data, "element_spec"):
        if class_weight:
            return data, False
        return _whole_dataset(data, batch, strategy, masked), False
    from tpu_magic.backends.keras_inputs import whole_batches as whole_keras_batches

    replicas = getattr(strategy, "num_replicas_in_sync", 1)
    if replicas < 2 or not isinstance(data, keras.utils.PyDataset):
        return data, False
    return whole_keras_batches(data, replicas, masked, shuffle=shuffle,
                               class_weight=class_weight, steps=steps, keep=keep,
                               cut=True), True


def _whole_dataset(data: Any, batch: int | None, strategy: Any, masked: bool) -> Any:
    replicas = getattr(strategy, "num_replicas_in_sync", 1)
    if not (masked and batch and labelled(data)):
        return equal_shares(data, replicas) if replicas > 1 else data
    return whole_batches(data, batch, strategy)
