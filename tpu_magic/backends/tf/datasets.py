"""A user's batched input made whole for the replicas (`user_batches`): a tf.data dataset's
short batches padded and masked (`whole_batches`) or cut to a whole number of rows per
replica (`equal_shares`), its batch size read from its element spec or its batch op (the
dataset's chain walked once, `_batch_op`); a `PyDataset` through Keras's own adapter."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tpu_magic.backends.tf.batch_parts import (PARALLEL_LOADS, ReplicaParts, packed,
                                              replica_cuts, splits_per_replica, traced_as_is,
                                              without_autotune)


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
                packed(mask, fill(element[2]) if len(element) > 2 else None))

    whole = dataset.map(traced_as_is(padded), num_parallel_calls=PARALLEL_LOADS)
    if not splits_per_replica(strategy):
        return whole
    cuts = replica_cuts(batch, strategy)
    replicas = strategy.num_replicas_in_sync

    def whole_for_every_replica(read: int) -> tf.data.Dataset:  # the user's batches as given
        return without_autotune(dataset.skip(read).map(
            traced_as_is(lambda *element: (element,) * replicas)).prefetch(2))

    return ReplicaParts(without_autotune(
        whole.map(traced_as_is(lambda *element: tuple(cut(element) for cut in cuts)))
        .prefetch(2)), whole_for_every_replica)


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
    node = _batch_op(dataset)
    if node is None:
        return None
    batch = int(node._batch_size)
    if bool(getattr(node, "_drop_remainder", False)):
        return batch
    rows = int(node._input_dataset.cardinality())
    return None if rows < 0 else (rows % batch or batch)


def _batch_op(dataset: Any) -> Any | None:
    """The dataset's last `batch` op (the first found walking back through its inputs, maps
    after it allowed: TensorFlow's private `_input_dataset` chain, walked here alone); None
    where it has none."""
    node = dataset
    while node is not None:
        if getattr(node, "_batch_size", None) is not None:
            return node
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
    node = _batch_op(dataset)
    if node is None:
        return None
    size = node._batch_size
    try:
        return int(size.numpy() if hasattr(size, "numpy") else size)
    except (TypeError, ValueError):
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
