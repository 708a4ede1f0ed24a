"""What both TensorFlow input builders share (`data`: NumPy pipelines; `datasets`: a user's
datasets): a global batch cut into the replicas' parts on the host (`ReplicaParts`, under a
MirroredStrategy with several replicas), `exactness`'s packed sample weight, and tf.data's
map and options as tpu_magic uses them."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import tensorflow as tf
from tensorflow.python.distribute import distribute_utils, input_lib

from tpu_magic.core.packed import MASK, REAL, WEIGHT

PARALLEL_LOADS = max(2, min(8, os.cpu_count() or 2))


def traced_as_is(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` for tf.data's `map`, traced without AutoGraph's conversion: tpu_magic's
    loaders branch only on Python values, never on tensors, so converting them only costs
    tracing time at every fit."""
    return tf.autograph.experimental.do_not_convert(function)


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """tf.data's autotuning off for the whole pipeline (options reach every input): see
    `_loaded` for why."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def splits_per_replica(strategy: Any) -> bool:
    """Whether tpu_magic cuts every global batch into the replicas' parts itself:
    MirroredStrategy, several replicas."""
    return getattr(strategy, "num_replicas_in_sync", 1) > 1 and \
        type(strategy).__name__ == "MirroredStrategy"


def replica_cuts(batch: int, strategy: Any) -> list[Callable[[Any], Any]]:
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


def packed(mask: tf.Tensor, weight: tf.Tensor | None, share: tf.Tensor | None = None) -> dict:
    """`exactness`'s packed sample weight of a batch's rows: their real-sample mask, the
    user's weights (1 where none), and the whole batch's share of real samples (`share`;
    None: these rows are the whole batch) on every row."""
    share = tf.reduce_mean(mask) if share is None else share
    return {MASK: mask, WEIGHT: tf.ones_like(mask) if weight is None else tf.cast(weight, tf.float32),
            REAL: tf.fill(tf.shape(mask), share)}
