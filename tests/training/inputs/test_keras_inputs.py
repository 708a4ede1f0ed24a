"""A user's batched input read by Keras's own adapter (`backends.keras_inputs`): on several
hosts a tf.data dataset's full batches are cut inside its pipeline (issue 32), giving each
host exactly the rows it gave when it read every batch whole and kept its own; a tf.data
dataset is read with tf.data's autotuning off where the user left it unset (issue 33)."""

import keras
import numpy as np
import tensorflow as tf

from tpu_magic.backends.jax.data import RowSplit
from tpu_magic.backends.keras_inputs import _cut_at_source, whole_batches
from tpu_magic.core.packed import MASK

SECOND_OF_TWO = RowSplit(rows=2, first=1, count=1)  # the second host's half of each batch


def _dataset():  # 203 = 6 x 32 + 11: a short last batch
    x = np.arange(203, dtype="float32")[:, None]
    return tf.data.Dataset.from_tensor_slices((x, np.arange(203) % 10)).map(
        lambda a, b: (a * 2.0, b)).batch(32)


def _own_rows(batch):  # what a host keeps of a whole batch (`jax.data.process_share`)
    return keras.tree.map_structure(lambda v: SECOND_OF_TWO.mine(np.asarray(v)), batch)


def test_a_hosts_rows_of_a_tf_data_batch_leave_the_pipeline_alone():
    cut, size = _cut_at_source(_dataset(), SECOND_OF_TWO)
    assert size == 32
    first, full = next(iter(cut))
    assert bool(full) and first[0].shape == (16, 1)  # half of the batch, cut inside tf.data
    np.testing.assert_array_equal(first[0].numpy()[:, 0], 2.0 * np.arange(16, 32))
    last, full = list(cut)[-1]
    assert not bool(full) and last[0].shape == (11, 1)  # the short batch, whole


def test_the_cut_gives_each_host_the_rows_it_kept_of_whole_batches():
    for masked in (True, False):
        ours = list(whole_batches(_dataset(), 2, masked, share=_own_rows,
                                  split=SECOND_OF_TWO).get_numpy_iterator())
        whole = list(whole_batches(_dataset(), 2, masked, share=_own_rows).get_numpy_iterator())
        assert len(ours) == len(whole) == 7
        for a, b in zip(ours, whole):
            keras.tree.map_structure(np.testing.assert_array_equal, a, b)
    assert ours[0][0].shape == (16, 1)
    masked = list(whole_batches(_dataset(), 2, True, share=_own_rows,
                                split=SECOND_OF_TWO).get_numpy_iterator())
    assert masked[-1][2][MASK].sum() == 0  # the short batch padded to 32: its rows 16-31


def test_what_cannot_be_cut_is_read_whole():
    assert _cut_at_source(np.arange(4), SECOND_OF_TWO)[1] == 0  # not tf.data
    assert _cut_at_source(_dataset(), RowSplit(2, 0, 2))[1] == 0  # every row is this host's
    odd = tf.data.Dataset.from_tensor_slices(np.arange(10.0)).batch(3)
    assert _cut_at_source(odd, SECOND_OF_TWO)[1] == 0  # 3 rows do not halve
    unknown = tf.data.Dataset.from_generator(lambda: iter([np.zeros((4, 1))]),
                                             output_signature=tf.TensorSpec((None, 1)))
    assert _cut_at_source(unknown, SECOND_OF_TWO)[1] == 0  # no batch size tf.data can see


def test_a_tf_data_dataset_is_read_without_autotuning_and_gives_the_same_batches():
    # Freeing a partly read iterator that autotunes waits for its autotune thread: a Gemma
    # LoRA cell on JAX waited up to 4 s after its last step. Keras stops at the last step.
    adapter = whole_batches(_dataset(), 8, masked=False)
    assert adapter.inner.get_tf_dataset().options().autotune.enabled is False
    ours = list(adapter.get_numpy_iterator())
    plain = [keras.tree.map_structure(np.asarray, batch) for batch in _dataset()]
    assert len(ours) == len(plain) == 7
    for mine, theirs in zip(ours, plain):
        for a, b in zip(keras.tree.flatten(mine), keras.tree.flatten(theirs)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    options = tf.data.Options()
    options.autotune.enabled = True  # the user's own choice stays
    chosen = whole_batches(_dataset().with_options(options), 8, masked=False)
    assert chosen.inner.get_tf_dataset().options().autotune.enabled is True
