"""Keras code of kinds the first published-example suite did not cover, side by side with
plain Keras on one device (issue 21's classes).

Each test follows one keras-io example or guide (named by its path in keras-team/keras-io),
written in our own words with small synthetic data. The plain run and the magic's run start
from the same seed and see the same batches in the same order (`shuffle=False`, a sample
count that whole batches cover where the model's own step cannot skip padding), so their
logged numbers must agree: a replica factor, a padded row or a lost sample shows up here.
"""

import numpy as np
import pytest

from test_published import IMPORTS, both

TOLERANCE = dict(rel=1e-4, abs=1e-5)


def same_history(plain, ours, name="history"):
    assert sorted(ours[name].history) == sorted(plain[name].history)
    for key, values in plain[name].history.items():
        assert ours[name].history[key] == pytest.approx(values, **TOLERANCE), key


def same_weights(plain, ours, model="model", atol=1e-5):
    for a, b in zip(plain[model].get_weights(), ours[model].get_weights()):
        np.testing.assert_allclose(b, a, atol=atol)


REGRESSION_DATA = """
x = np.random.random((256, 32)).astype("float32")
y = np.random.random((256, 1)).astype("float32")
"""

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
    sim8.run_cell(IMPORTS + REGRESSION_DATA + """
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
    assert report.fits == 1 and report.rewrapped == ["model"]
    assert sim8.user_ns["model"].predict(sim8.user_ns["x"][:3], verbose=0).shape == (3, 1)
