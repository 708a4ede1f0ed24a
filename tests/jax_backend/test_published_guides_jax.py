"""Published Keras code the other suites do not run, on Keras's JAX backend: keras-io guides,
Keras API docstrings and KerasHub model docstrings (small configurations, random weights,
nothing downloaded), written and compared as test_published_examples_jax.py says.
"""

import pytest

from support.cells import PER_CLASS_DATA, PER_CLASS_EVALUATE
from support.same import both, same_history, same_values, same_weights

# Models with a bias before a BatchNormalization, trained with Adam: that bias's gradient is
# float noise (BatchNorm subtracts it again), which Adam scales up to a full step, differently
# on any two devices; the moving mean carries it into inference. Their weights are not
# compared, and their predictions within this (a replica factor or a padded row is far more).
NOISY_BIAS = dict(rel=2e-3, abs=1e-4)


# guides/making_new_layers_and_models_via_subclassing.py: layers of the guide composed into a
# model: Linear (weights made in build), MLPBlock (layers tracked as attributes),
# ActivityRegularizationLayer (add_loss of a batch mean) and CustomDropout (a training
# argument and a SeedGenerator); 96 rows in whole batches.
def test_the_subclassing_guides_layers_composed(ip):
    plain, ours, _ = both(ip, """
ops = keras.ops
rs = np.random.RandomState(10)
x = rs.rand(96, 16).astype("float32")
y = (x[:, :4].sum(1, keepdims=True) + 0.1 * rs.rand(96, 1)).astype("float32")

class Linear(keras.layers.Layer):
    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units),
                                 initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b

class ActivityRegularizationLayer(keras.layers.Layer):
    def __init__(self, rate=1e-2):
        super().__init__()
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * ops.mean(inputs))
        return inputs

class CustomDropout(keras.layers.Layer):
    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs, training=None):
        if training:
            return keras.random.dropout(inputs, rate=self.rate, seed=self.seed_generator)
        return inputs

class MLPBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.linear_1 = Linear(32)
        self.regularization = ActivityRegularizationLayer(1e-2)
        self.dropout = CustomDropout(0.2)
        self.linear_2 = Linear(16)
        self.linear_3 = Linear(1)

    def call(self, inputs):
        x = keras.activations.relu(self.linear_1(inputs))
        x = self.dropout(self.regularization(x))
        x = keras.activations.relu(self.linear_2(x))
        return self.linear_3(x)
""", """
inputs = keras.Input((16,))
model = keras.Model(inputs, MLPBlock()(inputs))
model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
evaluation = model.evaluate(x, y, batch_size=32, verbose=0)
""")
    same_history(plain, ours)
    assert ours["evaluation"] == pytest.approx(plain["evaluation"], rel=1e-5)
    same_weights(plain, ours)


# guides/training_with_built_in_methods.py, "Custom losses" and "Custom metrics": CustomMSE (a
# Loss subclass with a regularization factor) on one-hot targets; CategoricalTruePositives
# (a Metric with its own variable) with per-sample weights (class 5 weighted twice).
def test_the_guides_custom_loss_and_custom_metric_with_sample_weights(ip):
    plain, ours, _ = both(ip, """
ops = keras.ops
rs = np.random.RandomState(11)
x_train = rs.rand(203, 20).astype("float32")
y_train = rs.randint(0, 10, 203)
y_train_one_hot = keras.utils.to_categorical(y_train, num_classes=10)
sample_weight = np.ones(shape=(len(y_train),))
sample_weight[y_train == 5] = 2.0

class CustomMSE(keras.losses.Loss):
    def __init__(self, regularization_factor=0.1, name="custom_mse"):
        super().__init__(name=name)
        self.regularization_factor = regularization_factor

    def call(self, y_true, y_pred):
        mse = ops.mean(ops.square(y_true - y_pred), axis=-1)
        reg = ops.mean(ops.square(0.5 - y_pred), axis=-1)
        return mse + reg * self.regularization_factor

class CategoricalTruePositives(keras.metrics.Metric):
    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
        values = ops.cast(y_true, "int32") == ops.cast(y_pred, "int32")
        values = ops.cast(values, "float32")
        if sample_weight is not None:
            values = ops.multiply(values, ops.cast(sample_weight, "float32"))
        self.true_positives.assign_add(ops.sum(values))

    def result(self):  # the guide returns the variable; JAX 0.10 needs its value
        return self.true_positives.value

    def reset_state(self):
        self.true_positives.assign(0.0)

def get_uncompiled_model():
    inputs = keras.Input(shape=(20,), name="digits")
    h = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    h = keras.layers.Dense(32, activation="relu", name="dense_2")(h)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax",
                                                  name="predictions")(h))
""", """
model = get_uncompiled_model()
model.compile(optimizer=keras.optimizers.Adam(), loss=CustomMSE())
history = model.fit(x_train, y_train_one_hot, batch_size=64, epochs=2, shuffle=False,
                    verbose=0)
counted = get_uncompiled_model()
counted.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(),
                metrics=[CategoricalTruePositives()])
weighted = counted.fit(x_train, y_train, sample_weight=sample_weight, batch_size=64,
                       epochs=2, shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_history(plain, ours, "weighted")
    same_weights(plain, ours)
    same_weights(plain, ours, "counted")


# examples/structured_data/wide_deep_cross_networks.py: a deep & cross network over named
# inputs (numeric features and an embedded categorical one): cross layers x0 * Dense(x) + x,
# a deep tower of Dense, BatchNorm, ReLU and Dropout, the two concatenated.
def test_deep_and_cross_network_over_named_inputs(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(12)
features = {"numeric": rs.rand(203, 5).astype("float32"),
            "category": rs.randint(0, 10, (203, 1)).astype("int32")}
targets = rs.randint(0, 3, 203)
""", """
numeric = keras.Input((5,), name="numeric")
category = keras.Input((1,), name="category", dtype="int32")
embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(category))
x0 = keras.layers.concatenate([numeric, embedded])
cross = x0
for _ in range(2):
    units = cross.shape[-1]
    h = keras.layers.Dense(units)(cross)
    cross = x0 * h + cross
cross = keras.layers.BatchNormalization()(cross)
deep = x0
for units in [16, 16]:
    deep = keras.layers.Dense(units)(deep)
    deep = keras.layers.BatchNormalization()(deep)
    deep = keras.layers.ReLU()(deep)
    deep = keras.layers.Dropout(0.1)(deep)
merged = keras.layers.concatenate([cross, deep])
model = keras.Model({"numeric": numeric, "category": category},
                    keras.layers.Dense(3, activation="softmax")(merged))
model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(),
              metrics=[keras.metrics.SparseCategoricalAccuracy()])
history = model.fit(features, targets, batch_size=32, epochs=2, shuffle=False, verbose=0)
probabilities = model.predict(features, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "probabilities", NOISY_BIAS)


# Keras's optimizer docstrings (keras/src/optimizers/): Lion, Nadam with the base optimizer's
# gradient_accumulation_steps, AdamW with global_clipnorm, each on the same small classifier.
@pytest.mark.parametrize("optimizer", [
    "keras.optimizers.Lion(learning_rate=0.003)",
    "keras.optimizers.Nadam(learning_rate=0.01, gradient_accumulation_steps=2)",
    "keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.05, global_clipnorm=1.0)",
])
def test_optimizers_from_their_docstrings(ip, optimizer):
    plain, ours, _ = both(ip, """
x = np.random.RandomState(13).rand(192, 8).astype("float32")
y = np.random.RandomState(14).randint(0, 3, 192)
""", f"""
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile({optimizer}, "sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
steps = int(model.optimizer.iterations)
""")
    assert ours["steps"] == plain["steps"]
    same_history(plain, ours)
    same_weights(plain, ours)


# keras.layers.Attention's docstring: a CNN over query and value token sequences, the
# attention of one over the other, both pooled and concatenated; binary labels.
def test_the_attention_layers_docstring_model(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(15)
query_tokens = rs.randint(1, 500, (203, 12)).astype("int32")
value_tokens = rs.randint(1, 500, (203, 20)).astype("int32")
labels = rs.randint(0, 2, 203)
""", """
query_input = keras.Input(shape=(None,), dtype="int32")
value_input = keras.Input(shape=(None,), dtype="int32")
token_embedding = keras.layers.Embedding(input_dim=500, output_dim=16)
query_embeddings = token_embedding(query_input)
value_embeddings = token_embedding(value_input)
cnn_layer = keras.layers.Conv1D(filters=16, kernel_size=4, padding="same")
query_seq_encoding = cnn_layer(query_embeddings)
value_seq_encoding = cnn_layer(value_embeddings)
query_value_attention_seq = keras.layers.Attention()([query_seq_encoding, value_seq_encoding])
query_encoding = keras.layers.GlobalAveragePooling1D()(query_seq_encoding)
query_value_attention = keras.layers.GlobalAveragePooling1D()(query_value_attention_seq)
joined = keras.layers.Concatenate()([query_encoding, query_value_attention])
model = keras.Model([query_input, value_input],
                    keras.layers.Dense(1, activation="sigmoid")(joined))
model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
history = model.fit([query_tokens, value_tokens], labels, batch_size=32, epochs=2,
                    shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# keras.losses.Huber, keras.metrics.AUC, keras.metrics.F1Score (micro average) and
# keras.metrics.PrecisionAtRecall as their docstrings compile them, with validation data of a
# partial batch.
def test_huber_loss_with_auc_f1_and_precision_at_recall(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(16)
x = rs.rand(203, 10).astype("float32")
y = (x[:, :3].sum(1, keepdims=True) + 0.3 * rs.rand(203, 1) > 1.6).astype("float32")
""", """
model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer="adam", loss=keras.losses.Huber(delta=0.5),
              metrics=[keras.metrics.AUC(name="auc"),
                       keras.metrics.F1Score(average="micro", threshold=0.5, name="f1"),
                       keras.metrics.PrecisionAtRecall(0.5, name="precision_at_recall")])
history = model.fit(x[:150], y[:150], batch_size=32, epochs=3, shuffle=False, verbose=0,
                    validation_data=(x[150:], y[150:]))
""")
    same_history(plain, ours)


# keras.metrics.F1Score's docstring default (average=None): one score per class, an array in
# plain Keras's evaluate results
def test_evaluate_with_a_per_class_metric_returns_it_as_plain_keras(ip):
    plain, ours, _ = both(ip, PER_CLASS_DATA, PER_CLASS_EVALUATE)
    assert ours["evaluation"]["f1_score"].shape == (3,)
    same_values(plain, ours, "evaluation")


# keras.layers.GroupNormalization, UnitNormalization and RMSNormalization from their
# docstrings, with Discretization (fixed boundaries) and CategoryEncoding feeding a
# categorical side input.
def test_normalization_and_encoding_layers_from_their_docstrings(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(17)
images = rs.rand(96, 8, 8, 4).astype("float32")
amounts = rs.rand(96, 1).astype("float32")
classes = rs.randint(0, 3, 96)
""", """
image = keras.Input((8, 8, 4))
amount = keras.Input((1,))
h = keras.layers.Conv2D(8, 3, padding="same")(image)
h = keras.layers.GroupNormalization(groups=4)(h)
h = keras.layers.GlobalAveragePooling2D()(h)
h = keras.layers.UnitNormalization()(h)
bins = keras.layers.Discretization(bin_boundaries=[0.25, 0.5, 0.75])(amount)
one_hot = keras.layers.CategoryEncoding(num_tokens=4, output_mode="one_hot")(bins)
h = keras.layers.concatenate([h, one_hot])
h = keras.layers.RMSNormalization()(keras.layers.Dense(8)(h))
model = keras.Model([image, amount], keras.layers.Dense(3, activation="softmax")(h))
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit([images, amounts], classes, batch_size=16, epochs=2, shuffle=False,
                    verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# keras_hub.models.DistilBertClassifier's docstring, "Preprocessed integer data", with a small
# DistilBertBackbone of random weights (its own docstring's arguments, made smaller).
def test_kerashub_distilbert_classifier_on_preprocessed_integers(ip):
    plain, ours, _ = both(ip, """
import keras_hub
rs = np.random.RandomState(18)
lengths = rs.randint(4, 13, 96)
padding_mask = np.arange(12)[None, :] < lengths[:, None]
features = {"token_ids": np.where(padding_mask, rs.randint(1, 600, (96, 12)), 0)
                         .astype("int32"),
            "padding_mask": padding_mask}
labels = rs.randint(0, 3, 96)
""", """
backbone = keras_hub.models.DistilBertBackbone(vocabulary_size=600, num_layers=1,
                                               num_heads=2, hidden_dim=16,
                                               intermediate_dim=32, max_sequence_length=12,
                                               dropout=0.0)
classifier = keras_hub.models.DistilBertClassifier(backbone=backbone, num_classes=3,
                                                   preprocessor=None, dropout=0.0)
classifier.compile(optimizer=keras.optimizers.Adam(5e-4),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=["accuracy"])
history = classifier.fit(x=features, y=labels, batch_size=16, epochs=2, shuffle=False,
                         verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours, "classifier")


# keras_hub.models.LlamaCausalLM's docstring, "Custom backbone and vocabulary" without a
# preprocessor: a tiny LlamaBackbone (grouped-query attention), next-token targets with a
# padding weight.
def test_kerashub_llama_causal_lm_with_a_tiny_backbone(ip):
    plain, ours, _ = both(ip, """
import keras_hub
rs = np.random.RandomState(19)
token_ids = rs.randint(1, 300, (40, 9)).astype("int32")
features = {"token_ids": token_ids[:, :-1], "padding_mask": np.ones((40, 8), bool)}
labels, weights = token_ids[:, 1:], (rs.rand(40, 8) > 0.1).astype("float32")
""", """
backbone = keras_hub.models.LlamaBackbone(vocabulary_size=300, num_layers=1,
                                          num_query_heads=4, num_key_value_heads=2,
                                          hidden_dim=16, intermediate_dim=32)
causal_lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
causal_lm.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
history = causal_lm.fit(x=features, y=labels, sample_weight=weights, batch_size=8, epochs=2,
                        shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours, "causal_lm")
