"""Inputs under 8 mirrored replicas (`backends.tf.data`, `backends.tf.datasets`): one pipeline on the host whose every
global batch is cut into the replicas' parts (`ReplicaParts`). Each replica gathers only its
own rows of a NumPy batch, the padding's packed weight carries the whole batch's share of
real samples, and a user's dataset runs its steps once a global batch, not once a replica."""

import numpy as np
import tensorflow as tf

from tpu_magic.backends.tf import batch_parts, data, datasets
from tpu_magic.core.packed import MASK, REAL


def _replica_batches(pipeline, strategy):
    """Each replica's rows of the first step: {replica: (x, y, packed)} as NumPy."""
    step = next(iter(pipeline.dataset))
    per_replica = strategy.experimental_local_results(step)
    return [tf.nest.map_structure(lambda t: t.numpy(), part) for part in per_replica]


def test_each_replica_reads_its_rows_and_the_whole_batchs_share(sim8):
    import tpu_magic

    strategy = tpu_magic.session().strategy
    x = np.arange(20, dtype="float32")[:, None] * 10.0
    y = np.arange(20) % 3
    # 20 samples in batches of 16: the second batch has 4 real rows and 12 of padding.
    pipeline = data.train_pipeline(x, y, None, batch=16, shuffle=False, repeat=False,
                                   strategy=strategy)
    assert (pipeline.steps, pipeline.padded) == (2, 12)
    whole = pipeline.first(2)  # the global batches, read on their own
    for step, batch in enumerate(iter(pipeline.dataset)):
        parts = [tf.nest.map_structure(lambda t: t.numpy(), p)
                 for p in strategy.experimental_local_results(batch)]
        assert len(parts) == 8
        for replica, (rx, ry, packed) in enumerate(parts):
            rows = slice(2 * replica, 2 * replica + 2)
            np.testing.assert_array_equal(rx, whole[step][0][rows])
            np.testing.assert_array_equal(ry, whole[step][1][rows])
            np.testing.assert_array_equal(packed[MASK], whole[step][2][MASK][rows])
            # the share of real samples is the global batch's, on every replica
            np.testing.assert_allclose(packed[REAL], [1.0, 1.0] if step == 0 else [0.25] * 2)
    np.testing.assert_array_equal(whole[1][2][MASK], [1.0] * 4 + [0.0] * 12)


def test_predict_replicas_read_their_rows(sim8):
    import tpu_magic

    strategy = tpu_magic.session().strategy
    x = np.arange(12, dtype="float32")[:, None]
    pipeline = data.predict_pipeline(x, batch=16, strategy=strategy)
    parts = _replica_batches(pipeline, strategy)
    got = np.concatenate([p[0] for p in parts])[:, 0]
    np.testing.assert_array_equal(got, list(range(12)) + [0.0] * 4)  # padding repeats sample 0


def test_a_users_dataset_runs_once_a_global_batch_and_each_replica_gets_its_rows(sim8):
    import tpu_magic

    strategy = tpu_magic.session().strategy
    x = np.arange(20, dtype="float32")[:, None]
    y = np.arange(20) % 3
    reads = []

    def read(batch):  # a step of the user's pipeline, counted each time it runs
        reads.append(len(batch))
        return batch

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(
        lambda bx, by: (tf.ensure_shape(tf.numpy_function(read, [bx], tf.float32), [None, 1]),
                        by))
    whole = datasets.whole_batches(dataset, 16, strategy)
    assert isinstance(whole, batch_parts.ReplicaParts)
    assert len(whole.element_spec) == 3  # a replica's part: (x, y, packed weight)
    steps = [[tf.nest.map_structure(lambda t: t.numpy(), p)
              for p in strategy.experimental_local_results(batch)] for batch in whole]
    assert reads == [16, 4]  # one pipeline a replica would run the map 8 times a batch
    assert len(steps) == 2 and all(len(parts) == 8 for parts in steps)
    for step, parts in enumerate(steps):
        got = np.concatenate([rx for rx, _, _ in parts])[:, 0]
        real = x[16 * step:16 * step + 16, 0]
        np.testing.assert_array_equal(got, np.pad(real, (0, 16 - len(real))))
        mask = np.concatenate([packed[MASK] for _, _, packed in parts])
        np.testing.assert_array_equal(mask, [1.0] * len(real) + [0.0] * (16 - len(real)))


def test_a_fits_pipeline_goes_when_the_fit_returns(digits, monkeypatch):
    """The pipeline a fit's NumPy arrays were copied into is freed when the fit returns, not
    at Python's next full collection: a cell's objects refer to each other, and before the
    cell dropped its inputs every fit's copy stayed until then."""
    import gc
    import weakref

    made = []
    build = data.train_pipeline

    def recorded(*args, **kwargs):
        pipeline = build(*args, **kwargs)
        made.append(weakref.ref(pipeline.dataset))
        return pipeline

    monkeypatch.setattr(data, "train_pipeline", recorded)
    digits.run_cell("import keras\n"
                    "model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])\n"
                    "model.compile('adam', keras.losses.SparseCategoricalCrossentropy(True))")
    gc.disable()  # no collection may free them
    try:
        for _ in range(2):
            digits.run_cell_magic("tpu_train", "--no-progress",
                                  "model.fit(x, y, batch_size=64, epochs=1, verbose=0)")
            assert made and all(ref() is None for ref in made)
    finally:
        gc.enable()
    assert len(made) == 2
