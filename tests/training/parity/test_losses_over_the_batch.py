"""A loss the replicas cannot split trains exactly anyway (issue 55), on TensorFlow's 8
mirrored replicas: where a model's loss is computed over the whole batch (a loss summed
over the batch with `add_loss`, a loss combining the batch's rows), the first-step check
sees the split step differ from one device's, runs it again with every replica computing
the whole batch, and the fit goes on so: its loss history and weights are plain Keras's on
one device, and it says so in one line. A later cell of the same setup runs so from its
start, without checking again.
"""

from support.cells import train
from support.same import both, same_history, same_weights

EXACT = dict(rel=1e-5, abs=1e-6)

# keras-io guides/training_with_built_in_methods.py, "Handling losses and metrics that don't
# fit the standard signature": the activity-regularization layer adds a loss summed over the
# batch. 300 rows in batches of 64: the last batch is short (44 rows), as in plain Keras.
GUIDE_DATA = """
from keras import layers, ops
rs = np.random.RandomState(0)
x_train = rs.rand(300, 784).astype("float32")
y_train = rs.randint(0, 10, 300)
x_val, y_val = rs.rand(70, 784).astype("float32"), rs.randint(0, 10, 70)

class ActivityRegularizationLayer(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(ops.sum(inputs) * 0.1)
        return inputs
"""
GUIDE = """
inputs = keras.Input(shape=(784,), name="digits")
x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
x = ActivityRegularizationLayer()(x)
x = layers.Dense(64, activation="relu", name="dense_2")(x)
outputs = layers.Dense(10, name="predictions")(x)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
history = model.fit(x_train, y_train, batch_size=64, epochs=2, shuffle=False,
                    validation_data=(x_val, y_val), verbose=0)
"""
SAID = "every replica computes the whole batch instead, from the first step on"


def _ran_whole(report, out):
    assert report.parity is not None and report.parity.whole_batch, report.parity
    assert not report.parity.agrees  # split over the replicas, it differed
    assert SAID in out and "differs from the same step on one device" not in out, out
    assert sum(SAID in note for note in report.notes) == 1, report.notes


def test_the_guides_summed_activity_loss_trains_as_plain_keras(sim8, capsys):
    plain, ours, report = both(sim8, GUIDE_DATA, GUIDE)
    same_history(plain, ours, tolerance=EXACT)  # loss, accuracy and the validation's
    same_weights(plain, ours, atol=1e-6)
    _ran_whole(report, capsys.readouterr().out)


def test_a_later_cell_of_the_same_setup_runs_whole_without_checking(sim8, capsys):
    # a setup of its own (dense_2 narrower): no earlier test's memory applies
    plain, ours, report = both(sim8, GUIDE_DATA, GUIDE.replace("epochs=2", "epochs=1")
                               .replace('Dense(64, activation="relu", name="dense_2")',
                                        'Dense(32, activation="relu", name="dense_2")'))
    same_history(plain, ours, tolerance=EXACT)
    assert report.parity.whole_batch
    capsys.readouterr()
    again = """
more = model.fit(x_train, y_train, batch_size=64, epochs=1, shuffle=False, verbose=0)
"""
    exec(again, plain)
    later = train(sim8, again)
    out = capsys.readouterr().out
    from tpu_magic.training.parity.compare import WHOLE_EARLIER

    assert later.parity is None  # not compared again
    assert WHOLE_EARLIER in later.notes and WHOLE_EARLIER in out, out
    same_history(plain, ours, "more", tolerance=EXACT)
    same_weights(plain, ours, atol=1e-6)


# A loss over the batch's sum: a layer penalizing the square of the batch's summed
# activations (no replica's share sums to the batch's), in a binary classifier whose
# metrics count (true positives: a count summed over the replicas would count each row
# once a replica).
BATCH_SUM = """
rs = np.random.RandomState(2)
x = rs.rand(256, 12).astype("float32")
y = (x[:, :3].sum(1) > 1.5).astype("float32")

class BatchSumPenalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(1e-4 * keras.ops.square(keras.ops.sum(inputs)))
        return inputs
"""
BATCH_SUM_CELL = """
inputs = keras.Input((12,))
hidden = BatchSumPenalty()(keras.layers.Dense(8, activation="relu")(inputs))
model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
              metrics=[keras.metrics.TruePositives(name="tp"), "accuracy"])
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
"""


def test_a_loss_over_the_batchs_sum_trains_as_plain_keras(sim8, capsys):
    plain, ours, report = both(sim8, BATCH_SUM, BATCH_SUM_CELL)
    same_history(plain, ours, tolerance=EXACT)  # the count of true positives too
    same_weights(plain, ours, atol=1e-6)
    _ran_whole(report, capsys.readouterr().out)


# keras-io examples/vision/supervised-contrastive-learning.py's loss, small: each row's
# negatives are the rest of the batch (the same class as tests/training/parity/test_parity.py's).
CONTRASTIVE = """
rs = np.random.RandomState(3)
x = rs.rand(256, 8).astype("float32")
y = rs.randint(0, 4, 256)

class SupervisedContrastiveLoss(keras.losses.Loss):
    def __init__(self, temperature=0.5, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        features = keras.ops.normalize(feature_vectors, axis=1)
        logits = keras.ops.matmul(features, keras.ops.transpose(features)) / self.temperature
        labels = keras.ops.reshape(labels, (-1, 1))
        same = keras.ops.cast(keras.ops.equal(labels, keras.ops.transpose(labels)), "float32")
        targets = same / keras.ops.sum(same, axis=1, keepdims=True)
        return keras.ops.mean(keras.losses.categorical_crossentropy(targets, logits,
                                                                   from_logits=True))
"""
CONTRASTIVE_CELL = """
inputs = keras.Input((8,))
features = keras.layers.Dense(16, activation="relu")(inputs)
encoder = keras.Model(inputs, keras.layers.Dense(8)(features))
encoder.compile(keras.optimizers.Adam(0.01), loss=SupervisedContrastiveLoss(0.1))
history = encoder.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
"""


def test_a_supervised_contrastive_loss_trains_as_plain_keras(sim8, capsys):
    plain, ours, report = both(sim8, CONTRASTIVE, CONTRASTIVE_CELL)
    same_history(plain, ours, tolerance=EXACT)
    same_weights(plain, ours, "encoder", atol=1e-6)
    _ran_whole(report, capsys.readouterr().out)


def test_a_first_step_that_agrees_split_stays_split(sim8):
    # the guide's model with its loss written as a mean, as docs/limits.md advises
    plain, ours, report = both(sim8, GUIDE_DATA.replace("ops.sum(inputs)", "ops.mean(inputs)"),
                               GUIDE.replace("epochs=2", "epochs=1"))
    assert report.parity is not None and report.parity.agrees, report.summary()
    same_history(plain, ours, tolerance=EXACT)
