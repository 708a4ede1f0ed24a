"""Keras code of kinds the first published-example suite did not cover, side by side with
plain Keras on one device (issue 21's classes), part two: models (a GAN with its own compile,
masking, two outputs, an adapted layer, saving and loading), the ways they are trained (a
hand-written tape loop, schedules and early stopping, class weights, a user's callback) and
a `PyDataset` with workers. Part one (test_published_patterns.py): custom steps, losses and
inputs.

Each test follows one keras-io example or guide (named by its path in keras-team/keras-io),
written in our own words with small synthetic data. The plain run and the magic's run start
from the same seed and see the same batches in the same order (`shuffle=False`, a sample
count that whole batches cover where the model's own step cannot skip padding), so their
logged numbers must agree: a replica factor, a padded row or a lost sample shows up here.
"""

import numpy as np
import pytest

from support.data import REGRESSION_DATA
from support.same import (TOLERANCE, both, evaluate_equals_cpu_copy, imports, same_history,
                          same_weights)



GAN = """
from keras import layers, ops
images = np.random.rand(203, 8, 8, 1).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices(images).batch(64)

class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        z = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        combined = ops.concatenate([self.generator(z), real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        z = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(ops.zeros((batch_size, 1)),
                                  self.discriminator(self.generator(z)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}
"""


def test_a_gan_with_its_own_compile_and_two_optimizers_trains(sim8):
    plain, ours, report = both(sim8, GAN, """
discriminator = keras.Sequential([keras.Input((8, 8, 1)), layers.Flatten(), layers.Dense(1)])
generator = keras.Sequential([keras.Input((4,)), layers.Dense(64), layers.Reshape((8, 8, 1))])
gan = GAN(discriminator=discriminator, generator=generator, latent_dim=4)
gan.compile(d_optimizer=keras.optimizers.Adam(1e-3), g_optimizer=keras.optimizers.Adam(1e-3),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
history = gan.fit(dataset, epochs=2, verbose=0)
""")
    assert sorted(ours["history"].history) == sorted(plain["history"].history)
    assert all(np.isfinite(v).all() for v in ours["history"].history.values())
    gan = ours["gan"]
    assert int(gan.d_optimizer.iterations.numpy()) == int(gan.g_optimizer.iterations.numpy()) == 8
    # the losses are one device's size (a BCE near log 2), not an eighth of it
    for key in ("d_loss", "g_loss"):
        assert ours["history"].history[key][0] == pytest.approx(
            plain["history"].history[key][0], rel=0.5)


# guides/writing_a_training_loop_from_scratch.py: the cell's own GradientTape loop.
def test_a_hand_written_gradient_tape_loop_runs_on_one_device_with_a_note(sim8):
    plain, ours, report = both(sim8, REGRESSION_DATA, """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.05)
loss_fn = keras.losses.MeanSquaredError()
train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
losses = []
for epoch in range(2):
    for step, (x_batch, y_batch) in enumerate(train_dataset):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(y_batch, model(x_batch, training=True))
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        losses.append(float(loss_value))
""")
    assert ours["losses"] == pytest.approx(plain["losses"], **TOLERANCE)
    same_weights(plain, ours)
    assert any("its own tf.GradientTape loop, so it runs as a plain cell on one device" in n
               for n in report.notes)


# -- more of the kinds of code people publish, side by side with one device ------------------

# examples/nlp/bidirectional_lstm_imdb.py-like with mask_zero: padded word sequences whose
# zeros are masked in the LSTM; 203 reviews, a partial last batch.
def test_masking_with_mask_zero(sim8):
    plain, ours, _ = both(sim8, """
words = np.random.randint(1, 200, (203, 20))
for i in range(203):
    words[i, np.random.randint(5, 20):] = 0  # padded tails
labels = np.random.randint(0, 2, 203).astype("float32")
""", """
model = keras.Sequential([keras.Input((20,), dtype="int32"),
                          keras.layers.Embedding(200, 8, mask_zero=True),
                          keras.layers.LSTM(8), keras.layers.Dense(1, activation="sigmoid")])
model.compile(keras.optimizers.SGD(0.0), "binary_crossentropy", metrics=["accuracy"])
history = model.fit(words, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)
evaluation = model.evaluate(words, labels, return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    for key, value in plain["evaluation"].items():
        assert ours["evaluation"][key] == pytest.approx(value, **TOLERANCE), key


# guides/understanding_masking_and_padding.py: a tagger whose per-word output keeps the
# Embedding's mask. Keras divides such a loss by the mask's true entries, not the batch's
# elements; padded rows that kept their copied mask gave 1.6023 for 1.6086 (a silently
# different loss) until the padded rows were taken out of the output's mask.
def test_a_masked_sequence_output_with_a_partial_batch(sim8):
    plain, ours, _ = both(sim8, """
words = np.random.randint(1, 50, (45, 12))
words[np.random.rand(45, 12) < 0.3] = 0
tags = np.random.randint(0, 5, (45, 12))
""", """
model = keras.Sequential([keras.Input((12,), dtype="int32"),
                          keras.layers.Embedding(50, 16, mask_zero=True),
                          keras.layers.LSTM(16, return_sequences=True), keras.layers.Dense(5)])
model.compile(keras.optimizers.Adam(0.01),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
history = model.fit(words, tags, batch_size=16, epochs=2, shuffle=False, verbose=0)
evaluation = model.evaluate(words, tags, batch_size=16, return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)
    for key, value in plain["evaluation"].items():
        assert ours["evaluation"][key] == pytest.approx(value, **TOLERANCE), key


# guides/preprocessing_layers.py: Normalization adapted on the data, inside the model.
def test_an_adapted_normalization_layer_inside_the_model(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA + "x = x * 10 + 3\n", """
norm = keras.layers.Normalization()
norm.adapt(x)
model = keras.Sequential([keras.Input((32,)), norm, keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.01), "mse")
history = model.fit(x[:250], y[:250], batch_size=64, epochs=2, shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# guides/training_with_built_in_methods.py: two outputs with loss weights and metrics each.
def test_two_outputs_with_loss_weights_and_metrics(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA + "classes = np.random.randint(0, 3, 256)\n", """
inputs = keras.Input((32,))
hidden = keras.layers.Dense(16, activation="relu")(inputs)
score = keras.layers.Dense(1, name="score")(hidden)
kind = keras.layers.Dense(3, activation="softmax", name="kind")(hidden)
model = keras.Model(inputs, [score, kind])
model.compile(keras.optimizers.SGD(0.0), loss=["mse", "sparse_categorical_crossentropy"],
              loss_weights=[1.0, 0.2], metrics=[["mae"], ["accuracy"]])
history = model.fit(x[:250], [y[:250], classes[:250]], batch_size=64, epochs=1,
                    shuffle=False, verbose=0)
evaluation = model.evaluate(x[:250], [y[:250], classes[:250]], batch_size=256,
                            return_dict=True, verbose=0)
""")
    assert sorted(ours["history"].history) == sorted(plain["history"].history)
    for key in ("loss", "score_mae", "kind_accuracy"):
        assert ours["history"].history[key] == pytest.approx(plain["history"].history[key],
                                                             **TOLERANCE), key
    for key, value in plain["evaluation"].items():
        assert ours["evaluation"][key] == pytest.approx(value, **TOLERANCE), key


# guides/serialization_and_saving.py: save the trained model as .keras, load it in a later
# cell, keep training it there through the magic.
def test_save_load_and_train_on(sim8, tmp_path):
    path = tmp_path / "model.keras"
    plain, ours, _ = both(sim8, REGRESSION_DATA + f"path = {str(path)!r}\n", """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.05), "mse")
model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
model.save(path)
loaded = keras.models.load_model(path)
history = loaded.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
rows = loaded.predict(x[:5], verbose=0)
""")
    same_history(plain, ours)
    np.testing.assert_allclose(ours["rows"], plain["rows"], atol=1e-5)


# guides/training_with_built_in_methods.py: a learning-rate schedule and EarlyStopping with
# restore_best_weights, on validation data.
def test_a_schedule_and_early_stopping_restoring_the_best_weights(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA, """
schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=4, decay_rate=0.5)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(schedule), "mse")
stop = keras.callbacks.EarlyStopping(patience=1, restore_best_weights=True)
history = model.fit(x[:192], y[:192], batch_size=64, epochs=6, shuffle=False, verbose=0,
                    validation_data=(x[192:], y[192:]), callbacks=[stop])
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# examples/timeseries/timeseries_classification_from_scratch.py-like: Conv1D over time with
# GlobalAveragePooling, a custom metric class.
def test_conv1d_timeseries_with_a_custom_metric(sim8):
    plain, ours, _ = both(sim8, """
series = np.random.rand(203, 50, 1).astype("float32")
labels = np.random.randint(0, 2, 203)

class Share(keras.metrics.Mean):
    def update_state(self, y_true, y_pred, sample_weight=None):
        hit = keras.ops.cast(keras.ops.cast(keras.ops.argmax(y_pred, -1), "int32") == keras.ops.cast(
            keras.ops.reshape(y_true, (-1,)), "int32"), "float32")
        return super().update_state(hit, sample_weight)
""", """
model = keras.Sequential([keras.Input((50, 1)), keras.layers.Conv1D(8, 3, activation="relu"),
                          keras.layers.GlobalAveragePooling1D(),
                          keras.layers.Dense(2, activation="softmax")])
model.compile(keras.optimizers.SGD(0.0), "sparse_categorical_crossentropy",
              metrics=[Share(name="share")])
history = model.fit(series, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)
""")
    same_history(plain, ours)


# examples/nlp/lstm_seq2seq-like outputs: return_sequences with TimeDistributed and
# per-timestep sample weights.
def test_per_timestep_outputs_with_sequence_sample_weights(sim8):
    plain, ours, _ = both(sim8, """
steps = np.random.rand(203, 6, 4).astype("float32")
targets = np.random.rand(203, 6, 2).astype("float32")
weights = np.random.rand(203, 6).astype("float32")
""", """
model = keras.Sequential([keras.Input((6, 4)), keras.layers.GRU(8, return_sequences=True),
                          keras.layers.TimeDistributed(keras.layers.Dense(2))])
model.compile(keras.optimizers.SGD(0.0), "mse", weighted_metrics=["mae"])
history = model.fit(steps, targets, sample_weight=weights, batch_size=32, epochs=1,
                    shuffle=False, verbose=0)
""")
    same_history(plain, ours)


# guides/functional_api.py: inputs by name, a dict of arrays.
def test_named_inputs_as_a_dict(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA + "meta = np.random.rand(256, 3).astype('float32')\n", """
features = keras.Input((32,), name="features")
extra = keras.Input((3,), name="meta")
merged = keras.layers.concatenate([features, extra])
model = keras.Model({"features": features, "meta": extra}, keras.layers.Dense(1)(merged))
model.compile(keras.optimizers.SGD(0.05), "mse")
history = model.fit({"features": x[:250], "meta": meta[:250]}, y[:250], batch_size=64,
                    epochs=2, shuffle=False, verbose=0)
rows = model.predict({"features": x[:3], "meta": meta[:3]}, verbose=0)
""")
    same_history(plain, ours)
    assert ours["rows"].shape == (3, 1)
    np.testing.assert_allclose(ours["rows"], plain["rows"], atol=1e-5)


# guides/training_with_built_in_methods.py: class weights on an imbalanced binary problem.
def test_class_weight_on_imbalanced_labels(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA + "labels = (np.random.rand(256) < 0.1).astype('float32')\n", """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1, activation="sigmoid")])
model.compile(keras.optimizers.SGD(0.05), "binary_crossentropy",
              weighted_metrics=["accuracy"])
history = model.fit(x[:250], labels[:250], batch_size=64, epochs=2, shuffle=False,
                    class_weight={0: 1.0, 1: 9.0}, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# guides/writing_your_own_callbacks.py: a callback that reads logs and the model's weights
# each epoch (what a user's own logging does).
def test_a_users_callback_sees_the_same_logs(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA + """
class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []
    def on_epoch_end(self, epoch, logs=None):
        self.seen.append((epoch, round(float(logs["loss"]), 5),
                          float(np.abs(self.model.get_weights()[0]).sum())))
""", """
record = Record()
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.05), "mse")
history = model.fit(x[:250], y[:250], batch_size=64, epochs=2, shuffle=False, verbose=0,
                    callbacks=[record])
""")
    for (e1, l1, w1), (e2, l2, w2) in zip(plain["record"].seen, ours["record"].seen):
        assert e1 == e2 and l1 == pytest.approx(l2, **TOLERANCE) and w1 == pytest.approx(w2, rel=1e-5)


# guides/understanding_masking_and_padding.py / examples with Dropout: a model that
# behaves differently in training, evaluated the same way as its CPU copy.
def test_dropout_model_evaluates_as_its_cpu_copy(sim8):
    sim8.run_cell(imports() + REGRESSION_DATA)
    sim8.run_cell_magic("tpu_train", "--no-progress", """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dropout(0.5), keras.layers.Dense(1)])
model.compile("adam", "mse", metrics=["mae"])
model.fit(x, y, batch_size=32, epochs=2, verbose=0)
""")
    evaluate_equals_cpu_copy(sim8, "model", "x[:203]", "y[:203]")


# Issue 30, class 7: a PyDataset with workers (it hung the cell at step 1), its last batch
# short of the replicas (202 rows in batches of 32: 10 left), read by Keras's own adapter,
# padded and masked: the same epochs as on one device.
PYDATASET = """
x = np.random.RandomState(0).rand(202, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 4, 202)

class Rows(keras.utils.PyDataset):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def __len__(self):
        return 7

    def __getitem__(self, i):
        return x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32]
"""


def test_a_pydataset_with_workers_trains_and_evaluates_as_on_one_device(sim8):
    plain, ours, _ = both(sim8, PYDATASET, """
keras.utils.set_random_seed(4)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(4)])
model.compile(keras.optimizers.Adam(0.01),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = model.fit(Rows(workers=4), validation_data=Rows(workers=2), epochs=2, shuffle=False,
                    verbose=0)
evaluation = model.evaluate(Rows(workers=4), return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)
    for key, value in plain["evaluation"].items():
        assert ours["evaluation"][key] == pytest.approx(value, **TOLERANCE), key

