"""Published Keras code whose numbers a grouped loop could change (issue 55), each example
defined once, for the 8-device suite (tests/jax_backend/test_grouped_examples_jax.py) and
the one-device process (tests/support/examples_run.py).

On JAX, `%%tpu_train` runs a small model's steps K an execution, a `lax.scan` over K stacked
batches of Keras's own step. What K single steps carry from one step to the next must then
be carried through the scan: per-step randomness (Dropout, noise, augmentation layers, a
layer's own `SeedGenerator`), a learning rate read from the step count, optimizer slots
(EMA, gradient accumulation), stateful metrics, callbacks that stop the fit, a model's own
`train_step`, mixed precision, sample and class weights, `steps_per_epoch` over a repeated
input, generators and a `PyDataset` that draw from NumPy as they are read, several inputs
and outputs, a model compiled again and fine-tuned in a later cell. Each example is a data
cell, a training cell (the model built, compiled and fit, then used) and a later plain cell
that draws new data from NumPy's global generator and predicts it (some train again).
Written in our own words on small synthetic data; each names its source (a path in
keras-team/keras-io, or the Keras class whose docstring it follows).

`compare` runs an example plainly (one device, no tpu_magic), then through `%%tpu_train`
with each line, and returns what differs: the histories, the weights, named values (the
later draws, predictions, evaluations), and the notebook's random state after the later
cell.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the later plain cell most examples end with: new data drawn after the training cell, and
# the trained model's predictions of it
LATER = """
later = np.random.random((64, 8)).astype("float32")
predicted = model.predict(later, verbose=0)
"""

# the data most examples train on: 8 features, 3 classes, 12 batches of 16 (3 groups of 4)
ROWS = """
x = np.random.rand(192, 8).astype("float32")
y = np.random.randint(0, 3, 192)
x_val = np.random.RandomState(2).rand(48, 8).astype("float32")
y_val = np.random.RandomState(3).randint(0, 3, 48)
"""

# binary labels a model can learn, for the threshold metrics
BINARY = """
x = np.random.rand(240, 8).astype("float32")
y = (x[:, :3].sum(1) + 0.3 * np.random.rand(240) > 1.6).astype("float32")
x_val, y_val = x[192:], y[192:]
x, y = x[:192], y[:192]
"""


def _classifier(optimizer: str, *, hidden: str = "") -> str:
    """A small classifier of ROWS, compiled with `optimizer`; `hidden`: layers between."""
    return f"""
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          {hidden}keras.layers.Dense(3, activation="softmax")])
model.compile({optimizer}, "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


# fit of ROWS with validation, then an evaluation and the rate the optimizer ends at
_FIT = """
history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                    validation_data=(x_val, y_val))
evaluation = model.evaluate(x_val, y_val, verbose=0, return_dict=True)
rate = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
steps = int(model.optimizer.iterations)
"""


@dataclass(frozen=True)
class Example:
    """One published example: its cells, and what both runs must share."""

    source: str  # where it comes from: a keras-io path or a Keras docstring
    data: str  # the data cell (plainly, in both runs)
    cell: str  # the training cell (through %%tpu_train)
    later: str = LATER  # the later plain cell
    histories: tuple[str, ...] = ("history",)
    models: tuple[str, ...] = ("model",)
    values: tuple[str, ...] = ("later", "predicted")
    # on several replicas, where their partial sums round more coarsely than the suite's
    # tolerance allows (None: the suite's)
    replicas_tolerance: dict | None = None


EXAMPLES: dict[str, Example] = {}


def example(name: str, source: str, data: str, cell: str, **kwargs) -> None:
    EXAMPLES[name] = Example(source, data, cell, **kwargs)


# -- per-step randomness ---------------------------------------------------------------------

example(
    "dropout_and_class_weights_on_imbalanced_data",
    "keras-io examples/structured_data/imbalanced_classification.py (Dropout, class_weight, "
    "the confusion-matrix metrics, Precision and Recall; fit's default shuffle)",
    """
features = np.random.rand(208, 8).astype("float32")
targets = (np.random.rand(208) < 0.15).astype("float32")
counts = np.bincount(targets.astype("int64"))
weight_for_0, weight_for_1 = 1.0 / counts[0], 1.0 / counts[1]
""", """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.3),
                          keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.3),
                          keras.layers.Dense(1, activation="sigmoid")])
metrics = [keras.metrics.FalseNegatives(name="fn"), keras.metrics.FalsePositives(name="fp"),
           keras.metrics.TrueNegatives(name="tn"), keras.metrics.TruePositives(name="tp"),
           keras.metrics.Precision(name="precision"), keras.metrics.Recall(name="recall")]
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
              metrics=metrics)
history = model.fit(features[:160], targets[:160], batch_size=16, epochs=3, verbose=0,
                    validation_data=(features[160:], targets[160:]),
                    class_weight={0: weight_for_0, 1: weight_for_1})
""")

example(
    "noise_and_dropout_layers_from_their_docstrings",
    "keras.layers.GaussianNoise, GaussianDropout, AlphaDropout and SpatialDropout1D "
    "docstrings",
    """
sequences = np.random.rand(192, 6, 8).astype("float32")
labels = np.random.randint(0, 3, 192)
""", """
model = keras.Sequential([keras.Input((6, 8)), keras.layers.GaussianNoise(0.1),
                          keras.layers.SpatialDropout1D(0.2), keras.layers.Flatten(),
                          keras.layers.Dense(16, activation="selu"),
                          keras.layers.AlphaDropout(0.1),
                          keras.layers.GaussianDropout(0.2),
                          keras.layers.Dense(3, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(sequences, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
""", later="""
later = np.random.random((64, 6, 8)).astype("float32")
predicted = model.predict(later, verbose=0)
""")

# (the example's RandomRotation and RandomZoom agree as well, but on the CPU each compiles a
# hundred one-op programs in every run, tripling this example's cost: not run here)
example(
    "augmentation_layers_before_an_mlp_with_adamw",
    "keras-io examples/vision/mlp_image_classification.py (data_augmentation: Normalization "
    "adapted in the cell, RandomFlip, RandomContrast; AdamW with weight decay)",
    """
images = np.random.rand(96, 8, 8, 1).astype("float32")
labels = np.random.randint(0, 3, 96)
""", """
data_augmentation = keras.Sequential([keras.layers.Normalization(),
                                      keras.layers.RandomFlip("horizontal"),
                                      keras.layers.RandomContrast(factor=0.1)],
                                     name="data_augmentation")
data_augmentation.layers[0].adapt(images)
inputs = keras.Input((8, 8, 1))
h = keras.layers.Flatten()(data_augmentation(inputs))
h = keras.layers.Dense(16, activation="gelu")(h)
h = keras.layers.Dropout(0.2)(h)
model = keras.Model(inputs, keras.layers.Dense(3)(h))
model.compile(optimizer=keras.optimizers.AdamW(learning_rate=5e-3, weight_decay=1e-4),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")])
history = model.fit(images, labels, batch_size=8, epochs=2, shuffle=False, verbose=0,
                    validation_split=0.2)
""", later="""
later = np.random.random((16, 8, 8, 1)).astype("float32")
predicted = model.predict(later, verbose=0)
""")

example(
    "sampling_layer_of_a_variational_autoencoder",
    "keras-io examples/generative/vae.py (Sampling: keras.random.normal with a "
    "SeedGenerator; the KL term added as a loss)",
    """
class Sampling(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = keras.ops.shape(z_mean)[0]
        dim = keras.ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon

class KLDivergence(keras.layers.Layer):
    def call(self, inputs):
        z_mean, z_log_var = inputs
        kl = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
        self.add_loss(0.1 * keras.ops.mean(keras.ops.sum(kl, axis=1)))
        return z_mean

x = np.random.rand(192, 8).astype("float32")
""", """
inputs = keras.Input((8,))
h = keras.layers.Dense(16, activation="relu")(inputs)
z_mean = keras.layers.Dense(2, name="z_mean")(h)
z_log_var = keras.layers.Dense(2, name="z_log_var")(h)
z = Sampling()([z_mean, z_log_var])
KLDivergence()([z_mean, z_log_var])
decoded = keras.layers.Dense(16, activation="relu")(z)
model = keras.Model(inputs, keras.layers.Dense(8, activation="sigmoid")(decoded))
model.compile(keras.optimizers.Adam(1e-2), "binary_crossentropy")
history = model.fit(x, x, batch_size=16, epochs=3, shuffle=False, verbose=0)
""")

example(
    "a_recurrent_layer_with_dropout_and_recurrent_dropout",
    "keras.layers.SimpleRNN docstring (dropout, recurrent_dropout; an LSTM's agree as "
    "well, at three times the compile time)",
    """
sequences = np.random.rand(192, 3, 4).astype("float32")
labels = (sequences[:, :, 0].mean(1) > 0.5).astype("int32")
""", """
model = keras.Sequential([keras.Input((3, 4)),
                          keras.layers.SimpleRNN(8, dropout=0.2, recurrent_dropout=0.2),
                          keras.layers.Dense(2, activation="softmax")])
model.compile("rmsprop", "sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(sequences, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
""", later="""
later = np.random.random((32, 3, 4)).astype("float32")
predicted = model.predict(later, verbose=0)
""")

# -- learning-rate schedules read each step -------------------------------------------------

example(
    "cosine_decay_with_linear_warmup",
    "keras.optimizers.schedules.CosineDecay docstring (warmup_target, warmup_steps)",
    ROWS, """
schedule = keras.optimizers.schedules.CosineDecay(0.0, decay_steps=20, alpha=0.1,
                                                  warmup_target=0.05, warmup_steps=7)
""" + _classifier("keras.optimizers.SGD(learning_rate=schedule, momentum=0.9)") + _FIT,
    values=("later", "predicted", "evaluation", "rate", "steps"))

example(
    "exponential_decay_in_steps_of_a_staircase",
    "keras-io guides/training_with_built_in_methods.py, 'Using learning rate schedules' "
    "(ExponentialDecay, staircase=True)",
    ROWS, """
lr_schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=5,
                                                          decay_rate=0.8, staircase=True)
""" + _classifier("keras.optimizers.RMSprop(learning_rate=lr_schedule)") + _FIT,
    values=("later", "predicted", "evaluation", "rate", "steps"))

example(
    "a_custom_learning_rate_schedule",
    "keras.optimizers.schedules.LearningRateSchedule docstring (MyLRSchedule)",
    """
class MyLRSchedule(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, initial_learning_rate):
        self.initial_learning_rate = initial_learning_rate

    def __call__(self, step):
        return self.initial_learning_rate / (step + 1)
""" + ROWS, _classifier("keras.optimizers.SGD(learning_rate=MyLRSchedule(0.5))") + _FIT,
    values=("later", "predicted", "evaluation", "rate", "steps"))

# -- optimizer state -------------------------------------------------------------------------

example(
    "exponential_moving_average_written_into_the_weights",
    "keras.optimizers.Optimizer docstring (use_ema, ema_momentum, ema_overwrite_frequency)",
    ROWS, _classifier("keras.optimizers.AdamW(learning_rate=0.02, use_ema=True, "
                      "ema_momentum=0.9, ema_overwrite_frequency=6)",
                      hidden='keras.layers.Dropout(0.2), ') + _FIT,
    values=("later", "predicted", "evaluation", "steps"))

example(
    "gradients_accumulated_over_steps_a_group_does_not_divide",
    "keras.optimizers.Optimizer docstring (gradient_accumulation_steps)",
    ROWS, _classifier("keras.optimizers.Adam(learning_rate=0.02, "
                      "gradient_accumulation_steps=3)") + _FIT,
    values=("later", "predicted", "evaluation", "steps"))

# -- stateful metrics ------------------------------------------------------------------------

example(
    "auc_precision_and_recall_at_their_own_thresholds",
    "keras.metrics.AUC (curve 'ROC' and 'PR'), Precision, Recall and RecallAtPrecision "
    "docstrings (thresholds of their own)",
    BINARY, """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer="sgd", loss="binary_crossentropy",
              metrics=[keras.metrics.AUC(num_thresholds=50, name="auc"),
                       keras.metrics.AUC(curve="PR", num_thresholds=50, name="pr_auc"),
                       keras.metrics.Precision(thresholds=0.3, name="precision_at_0.3"),
                       keras.metrics.Recall(thresholds=0.7, name="recall_at_0.7"),
                       keras.metrics.RecallAtPrecision(0.6, name="recall_at_precision")])
history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                    validation_data=(x_val, y_val))
evaluation = model.evaluate(x_val, y_val, verbose=0, return_dict=True)
""", values=("later", "predicted", "evaluation"))

example(
    "mean_iou_over_per_position_classes",
    "keras.metrics.MeanIoU and keras.metrics.OneHotMeanIoU docstrings",
    """
tokens = np.random.rand(208, 6, 4).astype("float32")
classes = (tokens.sum(-1) * 3 / 4).astype("int32").clip(0, 2)
one_hot = keras.utils.to_categorical(classes, 3)
""", """
model = keras.Sequential([keras.Input((6, 4)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(optimizer="adam", loss="categorical_crossentropy",
              metrics=[keras.metrics.OneHotMeanIoU(num_classes=3, name="iou"),
                       keras.metrics.MeanIoU(num_classes=3, sparse_y_true=False,
                                             sparse_y_pred=False, name="mean_iou")])
history = model.fit(tokens[:160], one_hot[:160], batch_size=16, epochs=2, shuffle=False,
                    verbose=0, validation_data=(tokens[160:], one_hot[160:]))
""", later="""
later = np.random.random((32, 6, 4)).astype("float32")
predicted = model.predict(later, verbose=0)
""")

# -- callbacks that stop training ------------------------------------------------------------

example(
    "early_stopping_restores_its_best_weights",
    "keras.callbacks.EarlyStopping docstring (patience, restore_best_weights)",
    ROWS, _classifier("keras.optimizers.Adam(0.05)") + """
stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2,
                                        restore_best_weights=True)
history = model.fit(x, y, batch_size=16, epochs=12, shuffle=False, verbose=0,
                    validation_data=(x_val, y_val), callbacks=[stopper])
stopped = [stopper.stopped_epoch, stopper.best_epoch]
""", values=("later", "predicted", "stopped"))

example(
    "a_callback_that_stops_at_the_lowest_loss",
    "keras-io guides/writing_your_own_callbacks.py (EarlyStoppingAtMinLoss: stop_training "
    "set in on_epoch_end, the best weights restored in on_train_end)",
    """
class EarlyStoppingAtMinLoss(keras.callbacks.Callback):
    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        self.best_weights = None

    def on_train_begin(self, logs=None):
        self.wait = 0
        self.stopped_epoch = 0
        self.best = np.inf

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("val_loss")
        if np.less(current, self.best):
            self.best = current
            self.wait = 0
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                self.model.set_weights(self.best_weights)

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")
""" + ROWS, _classifier("keras.optimizers.Adam(0.05)", hidden='keras.layers.Dropout(0.1), ')
    + """
stopper = EarlyStoppingAtMinLoss(patience=1)
history = model.fit(x, y, batch_size=16, epochs=12, shuffle=False, verbose=0,
                    validation_data=(x_val, y_val), callbacks=[stopper])
stopped = stopper.stopped_epoch
""", values=("later", "predicted", "stopped"))

# -- a model trained again -------------------------------------------------------------------

example(
    "fine_tuning_a_frozen_base_recompiled_in_a_later_cell",
    "keras-io guides/transfer_learning.py, 'Fine-tuning' (the base frozen and called with "
    "training=False, then unfrozen and compiled again with a metric object, at a low rate)",
    ROWS + """
labels = (y == 1).astype("float32")
val_labels = (y_val == 1).astype("float32")
""", """
base_model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, use_bias=False),
                               keras.layers.BatchNormalization(),
                               keras.layers.Activation("relu")], name="base")
base_model.trainable = False
inputs = keras.Input((8,))
h = base_model(inputs, training=False)
h = keras.layers.Dropout(0.2)(h)
model = keras.Model(inputs, keras.layers.Dense(1)(h))
model.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras.losses.BinaryCrossentropy(from_logits=True),
              metrics=[keras.metrics.BinaryAccuracy()])
history = model.fit(x, labels, batch_size=16, epochs=2, shuffle=False, verbose=0,
                    validation_data=(x_val, val_labels))
""", later="""
base_model.trainable = True
model.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss=keras.losses.BinaryCrossentropy(from_logits=True),
              metrics=[keras.metrics.BinaryAccuracy()])
tuned = model.fit(x, labels, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  validation_data=(x_val, val_labels))
""" + LATER, histories=("history", "tuned"))

# -- a model's own train_step ----------------------------------------------------------------

_JAX_TRAIN_STEP = """
import jax

class CustomModel(keras.Model):
    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables,
                                 metrics_variables, x, y, sample_weight, training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        loss, (trainable_variables, non_trainable_variables, metrics_variables) = \\
            self.stateless_compute_loss(trainable_variables, non_trainable_variables,
                                        metrics_variables, x=x, y=y, y_pred=y_pred,
                                        sample_weight=sample_weight, training=training)
        return loss, (y_pred, non_trainable_variables, metrics_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, \\
            metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, metrics_variables, x, y,
            sample_weight, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, loss, sample_weight=sample_weight)
            else:
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, y, y_pred, sample_weight=sample_weight)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        state = (trainable_variables, non_trainable_variables, optimizer_variables,
                 new_metrics_vars)
        return logs, state
"""

example(
    "a_stateless_jax_train_step_with_compiled_metrics",
    "keras-io guides/custom_train_step_in_jax.py, 'A first simple example'",
    _JAX_TRAIN_STEP, """
inputs = keras.Input(shape=(8,))
h = keras.layers.Dropout(0.2)(keras.layers.Dense(16, activation="relu")(inputs))
model = CustomModel(inputs, keras.layers.Dense(1)(h))
model.compile(optimizer="adam", loss="mse", metrics=["mae"])
x = np.random.random((203, 8))
y = np.random.random((203, 1))
history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
""")

example(
    "a_lower_level_jax_train_step_and_test_step",
    "keras-io guides/custom_train_step_in_jax.py, 'Going lower-level' and 'Providing your "
    "own evaluation step'",
    """
import jax

class CustomModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                 sample_weight, training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        loss = self.loss_fn(y, y_pred, sample_weight=sample_weight)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, \\
            metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, sample_weight, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        loss_tracker_vars = metrics_variables[:len(self.loss_tracker.variables)]
        mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
        loss_tracker_vars = self.loss_tracker.stateless_update_state(
            loss_tracker_vars, loss, sample_weight=sample_weight)
        mae_metric_vars = self.mae_metric.stateless_update_state(
            mae_metric_vars, y, y_pred, sample_weight=sample_weight)
        logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars)}
        state = (trainable_variables, non_trainable_variables, optimizer_variables,
                 loss_tracker_vars + mae_metric_vars)
        return logs, state

    def test_step(self, state, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        trainable_variables, non_trainable_variables, metrics_variables = state
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=False)
        loss = self.loss_fn(y, y_pred, sample_weight=sample_weight)
        loss_tracker_vars = metrics_variables[:len(self.loss_tracker.variables)]
        mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
        loss_tracker_vars = self.loss_tracker.stateless_update_state(
            loss_tracker_vars, loss, sample_weight=sample_weight)
        mae_metric_vars = self.mae_metric.stateless_update_state(
            mae_metric_vars, y, y_pred, sample_weight=sample_weight)
        logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars)}
        return logs, (trainable_variables, non_trainable_variables,
                      loss_tracker_vars + mae_metric_vars)

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]
""", """
inputs = keras.Input(shape=(8,))
h = keras.layers.GaussianNoise(0.1)(inputs)
model = CustomModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(h)))
model.compile(optimizer="adam")
x = np.random.random((192, 8))
y = np.random.random((192, 1))
history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                    validation_data=(x[:50], y[:50]))
evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
""", values=("later", "predicted", "evaluation"))

# -- mixed precision -------------------------------------------------------------------------

# bfloat16 on 8 replicas: each replica's partial sums (a kernel's gradient over its rows) are
# rounded to bfloat16 before they are added, where one device rounds the whole batch's sum
# once; plain Keras's own DataParallel over 8 devices moves these weights by up to 5e-4
# from one device's, as the magic does. One device is compared to 1e-5 all the same.
BFLOAT16_REPLICAS = dict(rel=2e-3, abs=2e-3)

example(
    "mixed_bfloat16_with_a_float32_output",
    "keras.mixed_precision.set_global_policy and keras.DTypePolicy docstrings "
    "('mixed_bfloat16', the last layer's dtype float32)",
    ROWS, """
keras.mixed_precision.set_global_policy("mixed_bfloat16")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dropout(0.2), keras.layers.Dense(3),
                          keras.layers.Activation("softmax", dtype="float32")])
model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                    validation_data=(x_val, y_val))
keras.mixed_precision.set_global_policy("float32")
""", replicas_tolerance=BFLOAT16_REPLICAS)

# -- the data: weights, steps, several inputs and outputs ------------------------------------

example(
    "sample_weights_with_weighted_metrics_and_validation_weights",
    "keras-io guides/training_with_built_in_methods.py, 'Using sample weighting and class "
    "weighting' (sample weights, weighted_metrics)",
    ROWS + """
sample_weight = np.ones(shape=(len(y),))
sample_weight[y == 2] = 2.0
val_weight = np.where(y_val == 2, 2.0, 1.0)
""", """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dropout(0.2),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-2),
              loss="sparse_categorical_crossentropy",
              weighted_metrics=["sparse_categorical_accuracy"])
history = model.fit(x, y, sample_weight=sample_weight, batch_size=16, epochs=2,
                    shuffle=False, verbose=0, validation_data=(x_val, y_val, val_weight))
""", later=LATER + """
second = model.fit(later, np.random.randint(0, 3, 64), batch_size=16, epochs=1,
                   shuffle=False, verbose=0)
""", histories=("history", "second"))

example(
    "steps_per_epoch_over_a_repeated_input",
    "keras-io guides/training_with_built_in_methods.py, 'Using a tf.data Dataset' "
    "(steps_per_epoch over a repeated input; a generator here)",
    ROWS + """
def repeated(batch):
    while True:
        for start in range(0, 192, batch):
            yield x[start:start + batch], y[start:start + batch]
""", _classifier("keras.optimizers.Adam(1e-2)", hidden='keras.layers.Dropout(0.2), ') + """
history = model.fit(repeated(16), steps_per_epoch=7, epochs=3, verbose=0,
                    validation_data=(x_val, y_val))
steps = int(model.optimizer.iterations)
""", values=("later", "predicted", "steps"))

example(
    "generators_that_draw_training_and_validation_batches",
    "keras.Model.fit docstring (x a generator with steps_per_epoch, validation_data a "
    "generator with validation_steps), batches drawn from NumPy as they are asked for",
    """
def synthetic(batch_size):
    while True:
        features = np.random.rand(batch_size, 8).astype("float32")
        labels = (features[:, :4].sum(1) > 2).astype("int32")
        yield features, labels + (features[:, 4:].sum(1) > 2).astype("int32")
""", _classifier("keras.optimizers.Adam(1e-2)", hidden='keras.layers.Dropout(0.2), ') + """
history = model.fit(synthetic(16), steps_per_epoch=6, epochs=3, verbose=0,
                    validation_data=synthetic(16), validation_steps=2)
""")

example(
    "a_py_dataset_that_adds_noise_to_each_batch_it_serves",
    "keras.utils.PyDataset docstring (a batch made in __getitem__; noise drawn from NumPy "
    "there, the indices shuffled by fit)",
    ROWS + """
import math

class NoisyRows(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y
        self.batch_size = batch_size

    def __len__(self):
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, idx):
        low = idx * self.batch_size
        high = min(low + self.batch_size, len(self.x))
        batch_x = self.x[low:high]
        noise = np.random.normal(0.0, 0.1, batch_x.shape).astype("float32")
        return batch_x + noise, self.y[low:high]
""", _classifier("keras.optimizers.Adam(1e-2)") + """
history = model.fit(NoisyRows(x, y, 16), epochs=2, verbose=0,
                    validation_data=NoisyRows(x_val, y_val, 16))
""")

example(
    "ticket_classifier_with_dict_inputs_losses_and_loss_weights",
    "keras-io guides/functional_api.py, 'Models with multiple inputs and outputs' (title, "
    "body and tags to priority and department; pooled embeddings for its LSTMs)",
    """
num_tags, num_words, num_departments = 6, 50, 3
title_data = np.random.randint(num_words, size=(203, 5))
body_data = np.random.randint(num_words, size=(203, 12))
tags_data = np.random.randint(2, size=(203, num_tags)).astype("float32")
priority_targets = np.random.random(size=(203, 1))
dept_targets = np.random.randint(2, size=(203, num_departments))
""", """
title_input = keras.Input(shape=(None,), name="title")
body_input = keras.Input(shape=(None,), name="body")
tags_input = keras.Input(shape=(num_tags,), name="tags")
title_features = keras.layers.GlobalAveragePooling1D()(
    keras.layers.Embedding(num_words, 8)(title_input))
body_features = keras.layers.GlobalAveragePooling1D()(
    keras.layers.Embedding(num_words, 8)(body_input))
h = keras.layers.concatenate([title_features, body_features, tags_input])
h = keras.layers.Dropout(0.2)(h)
priority_pred = keras.layers.Dense(1, name="priority")(h)
department_pred = keras.layers.Dense(num_departments, name="department")(h)
model = keras.Model(inputs=[title_input, body_input, tags_input],
                    outputs={"priority": priority_pred, "department": department_pred})
model.compile(optimizer=keras.optimizers.RMSprop(1e-2),
              loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                    "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
              loss_weights={"priority": 1.0, "department": 0.2})
history = model.fit({"title": title_data, "body": body_data, "tags": tags_data},
                    {"priority": priority_targets, "department": dept_targets},
                    epochs=2, batch_size=16, shuffle=False, verbose=0)
""", later="""
later = [np.random.randint(num_words, size=(32, 5)), np.random.randint(num_words, size=(32, 12)),
         np.random.randint(2, size=(32, num_tags)).astype("float32")]
predicted = model.predict({"title": later[0], "body": later[1], "tags": later[2]}, verbose=0)
""")

example(
    "image_and_timeseries_inputs_to_a_score_and_a_class",
    "keras-io guides/training_with_built_in_methods.py, 'Passing data to multi-input, "
    "multi-output models' (loss lists, loss_weights, a metric per output)",
    """
img_data = np.random.random_sample(size=(96, 8, 8, 3))
ts_data = np.random.random_sample(size=(96, 6, 4))
score_targets = np.random.random_sample(size=(96, 1))
class_targets = np.random.random_sample(size=(96, 3))
""", """
image_input = keras.Input(shape=(8, 8, 3), name="img_input")
timeseries_input = keras.Input(shape=(None, 4), name="ts_input")
x1 = keras.layers.GlobalMaxPooling2D()(keras.layers.Conv2D(3, 3)(image_input))
x2 = keras.layers.GlobalMaxPooling1D()(keras.layers.Conv1D(3, 3)(timeseries_input))
h = keras.layers.concatenate([x1, x2])
score_output = keras.layers.Dense(1, name="score_output")(h)
class_output = keras.layers.Dense(3, name="class_output")(h)
model = keras.Model(inputs=[image_input, timeseries_input],
                    outputs=[score_output, class_output])
model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
              loss=[keras.losses.MeanSquaredError(),
                    keras.losses.CategoricalCrossentropy(from_logits=True)],
              metrics=[[keras.metrics.MeanAbsolutePercentageError(),
                        keras.metrics.MeanAbsoluteError()],
                       [keras.metrics.CategoricalAccuracy()]],
              loss_weights=[2.0, 1.0])
history = model.fit([img_data, ts_data], [score_targets, class_targets], batch_size=8,
                    epochs=2, shuffle=False, verbose=0)
""", later="""
later = [np.random.random_sample(size=(16, 8, 8, 3)), np.random.random_sample(size=(16, 6, 4))]
predicted = model.predict(later, verbose=0)
""")


# -- running and comparing -------------------------------------------------------------------

def compare(shell, name: str, lines: list[str], tolerance: dict) -> dict:
    """Runs EXAMPLES[name] plainly, then in `shell` through `%%tpu_train LINE` for each line.
    Returns the plain run's seconds ("seconds"), and for each line ("lines") its differences
    from the plain run within `tolerance` (`rel`, `abs`; "differ", empty where none), the
    steps an execution its last fit ran ("k") and its seconds."""
    import time

    import keras

    from support.random_states import states
    from support.same import imports, plainly

    example = EXAMPLES[name]
    start = time.perf_counter()
    try:
        plain = plainly(example.data, example.cell)
        exec(example.later, plain)
        theirs = states()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    found = {"seconds": round(time.perf_counter() - start, 2), "lines": {}}
    for line in lines:
        k, start = None, time.perf_counter()
        try:
            shell.run_cell(imports() + example.data).raise_error()
            report = shell.run_cell_magic("tpu_train", f"--no-progress {line}".strip(),
                                          example.cell)
            k = report.execution.k if report.execution is not None else None
            shell.run_cell(example.later).raise_error()
            differ = differences(plain, shell.user_ns, example, tolerance)
            if (mine := states()) != theirs:
                differ.append(f"random state: plain {theirs}, magic {mine}")
        except Exception as exc:  # noqa: BLE001 - an error the magic adds is a difference too
            differ = [f"{type(exc).__name__}: {exc}"]
        finally:
            keras.mixed_precision.set_global_policy("float32")
        found["lines"][line] = {"differ": differ, "k": k,
                       "seconds": round(time.perf_counter() - start, 2)}
    return found


def differences(plain: dict, ours: dict, example: Example, tolerance: dict) -> list[str]:
    """What differs between the two runs' namespaces, one line each."""
    found = []
    for name in example.histories:
        theirs, mine = plain[name].history, ours[name].history
        if sorted(mine) != sorted(theirs):
            found.append(f"{name} keys: plain {sorted(theirs)}, magic {sorted(mine)}")
            continue
        for key, values in theirs.items():
            if not _close(values, mine[key], tolerance):
                found.append(f"{name}[{key!r}]: plain {_short(values)}, magic "
                             f"{_short(mine[key])}")
    for name in example.models:
        theirs, mine = plain[name].get_weights(), ours[name].get_weights()
        if len(theirs) != len(mine):
            found.append(f"{name}: plain {len(theirs)} weights, magic {len(mine)}")
            continue
        for index, (a, b) in enumerate(zip(theirs, mine)):
            if not _close(a, b, tolerance):
                found.append(f"{name} weight {index} {plain[name].weights[index].path}: "
                             f"plain {_short(a)}, magic {_short(b)}")
    for name in example.values:
        if not _close(plain[name], ours[name], tolerance):
            found.append(f"{name}: plain {_short(plain[name])}, magic {_short(ours[name])}")
    return found


def _close(theirs, mine, tolerance: dict) -> bool:
    import keras

    if isinstance(theirs, dict):
        if not isinstance(mine, dict) or sorted(theirs) != sorted(mine):
            return False
        return all(_close(theirs[key], mine[key], tolerance) for key in theirs)
    flat_theirs, flat_mine = keras.tree.flatten(theirs), keras.tree.flatten(mine)
    if len(flat_theirs) != len(flat_mine):
        return False
    for a, b in zip(flat_theirs, flat_mine):
        a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
        if a.shape != b.shape or not np.allclose(b, a, rtol=tolerance["rel"],
                                                 atol=tolerance["abs"]):
            return False
    return True


def _short(value) -> str:
    if isinstance(value, dict):
        return str({key: _short(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)) and not np.isscalar(value):
        if all(np.isscalar(v) for v in value) and len(value) <= 12:
            return str([float(f"{v:.7g}") for v in value])
        return f"{type(value).__name__} of {len(value)}: [{_short(value[0])}, ...]"
    array = np.asarray(value)
    if array.size > 6:
        return f"array{array.shape} first {array.ravel()[:3]} mean {array.mean():.7g}"
    return str(array.tolist())
