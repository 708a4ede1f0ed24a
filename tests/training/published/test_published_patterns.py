"""Keras code of kinds the first published-example suite did not cover, side by side with
plain Keras on one device (issue 21's classes), part one: custom steps, losses and inputs
(part two, models and the ways they are trained: test_published_models.py).

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

# guides/custom_train_step_in_tensorflow.py: a train_step with its own loss object, tracker
# and metric, and a test_step of the same kind.
CUSTOM_STEP = """
class CustomModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(self.loss_fn(y, y_pred))
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]
"""


def test_a_custom_train_step_with_a_loss_object_logs_and_learns_as_on_one_device(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA + CUSTOM_STEP, """
inputs = keras.Input(shape=(32,))
model = CustomModel(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer=keras.optimizers.SGD(0.1))
history = model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
evaluation = model.evaluate(x, y, batch_size=64, return_dict=True, verbose=0)
""")
    same_history(plain, ours)  # 1/8 of the loss before: Keras scales a Loss in a replica
    same_weights(plain, ours)
    for key, value in plain["evaluation"].items():
        assert ours["evaluation"][key] == pytest.approx(value, **TOLERANCE), key


# guides/custom_train_step_in_tensorflow.py, the low-level variant: a mean by hand, no loss
# object (Keras's gradient sum over replicas trained it 8 times too fast).
def test_a_custom_train_step_with_a_hand_written_mean_learns_as_on_one_device(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA + """
class ByHand(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {"loss": loss}
""", """
inputs = keras.Input(shape=(32,))
model = ByHand(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer=keras.optimizers.SGD(0.1))
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
""")
    same_weights(plain, ours)


# examples/keras_recipes/endpoint_layer_pattern.py: the loss is computed by a layer from a
# loss object and added with add_loss; compile has no loss.
def test_the_endpoint_layer_pattern_logs_and_learns_as_on_one_device(sim8):
    plain, ours, _ = both(sim8, """
class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets, logits, sample_weights=None):
        self.add_loss(self.loss_fn(targets, logits, sample_weights))
        return keras.ops.softmax(logits)

data = {"inputs": np.random.random((192, 3)).astype("float32"),
        "targets": np.random.randint(0, 2, (192, 10)).astype("float32")}
""", """
inputs = keras.Input(shape=(3,), name="inputs")
targets = keras.Input(shape=(10,), name="targets")
logits = keras.layers.Dense(10)(inputs)
predictions = LogisticEndpoint(name="predictions")(targets, logits)
model = keras.Model(inputs=[inputs, targets], outputs=predictions)
model.compile(optimizer=keras.optimizers.Adam(0.01))
history = model.fit(data, batch_size=64, epochs=3, shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# guides/customizing_what_happens_in_fit (jit_compile) / any model compiled with
# jit_compile=True: XLA under mirrored CPU replicas fails; the model runs without it.
def test_jit_compile_true_runs_with_a_note_and_the_same_numbers(sim8):
    plain, ours, report = both(sim8, REGRESSION_DATA, """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=True)
history = model.fit(x[:250], y[:250], batch_size=64, epochs=2, shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    assert any("jit_compile=True fails in TensorFlow under MirroredStrategy" in n
               for n in report.notes)


# examples/vision/image_classification_from_scratch.py predicts one image at a time;
# here with predict_on_batch, which Keras hands whole to every replica.
def test_predict_on_batch_returns_the_rows_it_was_given(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA, """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                          keras.layers.Dense(3, activation="softmax")])
model.compile("adam", "mse")
one = model.predict_on_batch(x[:1])
twelve = model.predict_on_batch(x[:12])
""")
    assert ours["one"].shape == (1, 3) and ours["twelve"].shape == (12, 3)
    np.testing.assert_allclose(ours["twelve"], plain["twelve"], atol=1e-6)
    sim8.run_cell("later = model.predict_on_batch(x[:5])")  # adopted: a later plain cell too
    assert ours["later"].shape == (5, 3)


# guides/training_with_built_in_methods.py, "Using a keras.utils.PyDataset": validation data
# as a PyDataset of its own.
def test_a_pydataset_as_validation_data(sim8):
    plain, ours, _ = both(sim8, REGRESSION_DATA + """
class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / self.batch_size))

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]
""", """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.05), "mse")
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                    validation_data=Batches(x[:128], y[:128], 64))
""")
    same_history(plain, ours)


# A user's loss function that takes the batch mean itself (as many notebooks write it):
# sample weights cannot mask its padded rows, so the magic says so and uses whole batches.
def test_a_loss_that_reduces_to_a_scalar_is_detected(sim8):
    plain, ours, report = both(sim8, REGRESSION_DATA + """
def my_mse(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred))
""", """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.05), loss=my_mse)
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
""")
    same_history(plain, ours)  # 256 samples: whole batches, nothing left out
    assert any("its loss my_mse reduces a batch to one number itself" in n for n in report.notes)


# The same kind of loss in evaluate (issue 30, 7c): replicas need whole batches of real
# samples, so the last 202 mod 64 run on one device and their metric states join the
# replicas'. Every sample counts, as in plain Keras, and nothing is said to be left out.
def test_evaluate_of_a_scalar_loss_counts_every_sample(sim8):
    plain, ours, report = both(sim8, REGRESSION_DATA + """
def my_mse(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred))
yc = (y > 0.5).astype("float32")
""", """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1, activation="sigmoid")])
model.compile(keras.optimizers.SGD(0.05), loss=my_mse,
              metrics=["binary_accuracy", keras.metrics.AUC(name="auc")])
scores = model.evaluate(x[:202], yc[:202], batch_size=64, verbose=0, return_dict=True)
listed = model.evaluate(x[:202], yc[:202], batch_size=64, verbose=0)
""")
    assert ours["scores"] == pytest.approx(plain["scores"], **TOLERANCE)
    assert ours["listed"] == pytest.approx(plain["listed"], **TOLERANCE)
    assert "evaluate" not in report.left_out
    assert any("evaluate runs its last few samples on one device" in n for n in report.notes)


def test_a_per_sample_loss_function_keeps_the_exact_padded_path(sim8):
    plain, ours, report = both(sim8, REGRESSION_DATA + """
def my_mse(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)
""", """
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.05), loss=my_mse)
history = model.fit(x[:250], y[:250], batch_size=64, epochs=2, shuffle=False, verbose=0)
""")
    same_history(plain, ours)  # a partial last batch, padded and masked
    assert not report.notes and not report.left_out


# guides/making_new_layers_and_models_via_subclassing.py: a subclassed model compiled in one
# cell and trained in the next (it has no weights until its first call).
def test_a_subclassed_model_compiled_but_not_built_outside_trains(sim8):
    sim8.run_cell(imports() + REGRESSION_DATA + """
class TwoLayers(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

model = TwoLayers()
model.compile(keras.optimizers.SGD(0.05), "mse")
""")
    report = sim8.run_cell_magic("tpu_train", "--no-progress",
                                 "history = model.fit(x, y, batch_size=64, epochs=1, verbose=0)")
    # compiled again inside the strategy (the same object), and built there by Keras before
    # its first step: built inside a replica's step it failed ("You must feed a value for
    # placeholder tensor")
    assert report.fits == 1 and report.rewrapped == ()
    assert any("compiled outside MirroredStrategy: compiled again inside it" in note
               for note in report.notes)
    assert sim8.user_ns["model"].predict(sim8.user_ns["x"][:3], verbose=0).shape == (3, 1)
    assert report.parity.agrees, report.parity


# examples/vision/image_classification_from_scratch.py, "run inference on new data": one
# image as a tensor into a model with BatchNormalization; and a batch of tensors.
def test_tensor_inputs_take_the_exact_path(sim8):
    plain, ours, report = both(sim8, """
images = np.random.rand(204, 8, 8, 1).astype("float32")
labels = np.random.randint(0, 10, 204)
""", """
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Flatten(),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.SGD(0.0), "sparse_categorical_crossentropy", metrics=["accuracy"])
one = model.predict(tf.constant(images[:1]), verbose=0)
many = model.predict(tf.constant(images), verbose=0)
evaluation = model.evaluate(tf.constant(images[:203]), tf.constant(labels[:203]),
                            return_dict=True, verbose=0)
""")
    assert ours["one"].shape == (1, 10) and ours["many"].shape == (204, 10)
    np.testing.assert_allclose(ours["many"], plain["many"], atol=1e-5)
    for key, value in plain["evaluation"].items():
        assert ours["evaluation"][key] == pytest.approx(value, **TOLERANCE), key


# guides/transfer_learning.py: a base model and a classifier on it, both built before the
# training cell; freeze, train, unfreeze, recompile, fine-tune, in later cells.
def test_a_base_model_and_the_model_on_it_stay_one_family(sim8):
    sim8.run_cell(imports() + """
x = np.random.rand(160, 16).astype("float32")
y = np.random.randint(0, 2, 160).astype("float32")
base = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                         keras.layers.Dense(32, activation="relu")], name="base")
inputs = keras.Input((16,))
model = keras.Model(inputs, keras.layers.Dense(1)(base(inputs, training=False)))
""")
    report = sim8.run_cell_magic("tpu_train", "--no-progress", """
base.trainable = False
model.compile(keras.optimizers.Adam(0.01), keras.losses.BinaryCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
""")
    ns = sim8.user_ns
    assert report.rewrapped == ("model",)
    assert any(layer is ns["base"] for layer in ns["model"].layers)  # still one family
    assert len(ns["model"].trainable_weights) == 2  # the head only
    frozen = [w.copy() for w in ns["base"].get_weights()]
    sim8.run_cell_magic("tpu_train", "--no-progress", """
base.trainable = True
model.compile(keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
""")
    assert len(ns["model"].trainable_weights) == 6  # fine-tuning trains the base too
    assert any(not np.array_equal(a, b) for a, b in zip(frozen, ns["base"].get_weights()))


# examples/vision/mnist_convnet.py-like with BatchNormalization and a small per-replica batch
# (4 rows a replica): the trained model and its CPU copy must answer alike.
def test_batchnorm_with_a_small_per_replica_batch_answers_as_its_cpu_copy(sim8):
    sim8.run_cell(imports() + """
images = np.random.rand(200, 8, 8, 1).astype("float32")
labels = np.random.randint(0, 10, 200)
""")
    sim8.run_cell_magic("tpu_train", "--no-progress", """
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Flatten(),
                          keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(images[:160], labels[:160], batch_size=32, epochs=2, verbose=0,
                    validation_data=(images[160:], labels[160:]))
""")
    evaluate_equals_cpu_copy(sim8, "model", "images", "labels")
    sim8.run_cell("last = model.evaluate(images[160:], labels[160:], return_dict=True, verbose=0)")
    ns = sim8.user_ns
    assert ns["history"].history["val_loss"][-1] == pytest.approx(ns["last"]["loss"], abs=1e-5)


# examples/generative/dcgan_overriding_train_step.py: a custom compile keeping two
# optimizers, a train_step with two tapes, a dataset of images only whose last batch is
# partial (203 = 3 x 64 + 11: cut to 8, one row a replica).
