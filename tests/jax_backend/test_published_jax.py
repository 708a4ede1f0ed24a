"""Published Keras code on Keras's JAX backend: 8 simulated devices beside one.

Each test follows one keras-io example or guide, or a KerasHub fine-tuning pattern, named by
its path in keras-team/keras-io (or keras-team/keras-hub) in a comment above it. The code is
written here in our own words with the example's layers, compile and fit arguments, on small
synthetic data of the example's shapes instead of its download (no network), with sample
counts that 8 does not divide. None of these examples is used by the other published-code
suites (tests/test_published.py, tests/test_published_patterns.py).

Every cell runs twice from the same seed (`support.same.both`): plainly, with Keras on JAX on
one device and no tpu_magic, and through `%%tpu_train` over 8 simulated devices
(`keras.distribution.DataParallel`, TensorFlow blocked as on Colab's TPU image, so the data
comes as NumPy arrays, grain datasets, `keras.utils.PyDataset`s or Python generators). What
the two runs must share is what plain Keras makes deterministic: the same history (losses
and metrics, rel 1e-4) where both see the same batches in the same order, the same
`predict` rows and values, `evaluate` equal to the `%tpu_sync` CPU copy's, and `fit` at
learning rate 0 equal to `evaluate` where the model has no Dropout or BatchNorm.

The cells are ordinary notebook cells: unseeded layers (the seed is the notebook's), a
vocabulary large enough that the embedding dominates, layers adapted or models built in an
earlier plain cell, trainable sets changed between fits, the user's own
`keras.distribution`, `*_on_batch` calls with row counts 8 does not divide.
"""

import pytest

from support.same import (both, evaluate_equals_cpu_copy, fit_equals_evaluate_at_lr0,
                          run_cell, same_history, same_values, same_weights)


# -- The user's own keras.distribution -------------------------------------------------------

# guides/distribution.py, "DataParallel": the guide sets a DataParallel over all devices
# process-wide with `set_distribution`, then builds, compiles and trains its MNIST MLP.
# 200 samples: plain Keras under the user's own DataParallel needs whole per-device shares.
def test_the_distribution_guides_data_parallel_set_in_the_cell(ip):
    setup = """
x = np.random.random((200, 28, 28, 1)).astype("float32")
y = keras.utils.to_categorical(np.random.randint(0, 10, 200), 10)
"""
    cell = """
data_parallel = keras.distribution.DataParallel()
keras.distribution.set_distribution(data_parallel)
inputs = keras.layers.Input(shape=(28, 28, 1))
h = keras.layers.Flatten()(inputs)
h = keras.layers.Dense(units=200, activation="relu")(h)
h = keras.layers.Dropout(0.4)(h)
outputs = keras.layers.Dense(units=10, activation="softmax")(h)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(loss="mse", optimizer="adam")
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
active = type(keras.distribution.distribution()).__name__
"""
    try:
        plain, ours, _ = both(ip, setup, cell)
        same_history(plain, ours)
        assert ours["active"] == plain["active"] == "DataParallel"
        # set_distribution is process-wide in Keras: the next cell still has it
        run_cell(ip, "still = type(keras.distribution.distribution()).__name__")
        assert ip.user_ns["still"] == "DataParallel"
    finally:
        run_cell(ip, "keras.distribution.set_distribution(None)")


# guides/distribution.py, "ModelParallel and LayoutMap": a 2x4 mesh, d1's kernel and bias
# split over "model", d2's output over "data". 202 samples: the last batch (10) splits
# over the 2 "data" rows, as plain Keras needs.
def test_the_distribution_guides_model_parallel_layout_map_is_kept(ip):
    setup = """
x = np.random.random((202, 784)).astype("float32")
y = np.random.randint(0, 10, 202)
"""
    cell = """
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=["data", "model"], devices=devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*d1/kernel"] = (None, "model")  # Keras 3.15 matches a key to a whole path
layout_map[".*d1/bias"] = ("model",)
layout_map[".*d2/output"] = ("data", None)
model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
keras.distribution.set_distribution(model_parallel)
model = keras.Sequential([
    keras.layers.Input(shape=(784,)),
    keras.layers.Dense(200, activation="relu", name="d1"),
    keras.layers.Dense(10, activation="softmax", name="d2"),
])
model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
kernel_spec = tuple(model.get_layer("d1").kernel.value.sharding.spec)
evaluation = model.evaluate(x, y, batch_size=64, return_dict=True, verbose=0)
rows = model.predict(x[:10], verbose=0)
"""
    try:
        plain, ours, _ = both(ip, setup, cell)
        assert ours["kernel_spec"] == plain["kernel_spec"] == (None, "model")
        same_history(plain, ours)
        same_values(plain, ours, "evaluation")
        same_values(plain, ours, "rows")
    finally:
        run_cell(ip, "keras.distribution.set_distribution(None)")


# -- Structured data -------------------------------------------------------------------------

# examples/structured_data/structured_data_classification_with_feature_space.py: FeatureSpace
# needs tf.data, so its preprocessing (one-hot categories, normalized numbers) is done in
# NumPy; the model, compile and fit are the example's, fed grain datasets of batch 32 with a
# short last batch (203 = 6 x 32 + 11), validation as a dataset too.
FEATURES = """
import grain
rs = np.random.RandomState(1)
def encoded(n):
    categorical = np.concatenate([np.eye(k)[rs.randint(0, k, n)] for k in (2, 4, 5, 3, 2, 4, 3)], 1)
    numerical = rs.normal(size=(n, 6))
    numerical = (numerical - numerical.mean(0)) / numerical.std(0)
    return np.concatenate([categorical, numerical], 1).astype("float32")
train_features, val_features = encoded(203), encoded(51)
train_target = rs.randint(0, 2, (203, 1)).astype("float32")
val_target = rs.randint(0, 2, (51, 1)).astype("float32")
def rows(features, target):
    return grain.MapDataset.source(np.arange(len(features))).map(
        lambda i: (features[i], target[i]))
train_ds = rows(train_features, train_target).batch(32)
val_ds = rows(val_features, val_target).batch(32)
"""


def test_feature_space_classification_on_grain_datasets(ip):
    plain, ours, _ = both(ip, FEATURES, """
inputs = keras.Input(shape=(train_features.shape[1],))
h = keras.layers.Dense(32, activation="relu")(inputs)
h = keras.layers.Dropout(0.5)(h)
predictions = keras.layers.Dense(1, activation="sigmoid")(h)
model = keras.Model(inputs, predictions)
model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
history = model.fit(train_ds, epochs=3, validation_data=val_ds, verbose=0)
evaluation = model.evaluate(val_ds, return_dict=True, verbose=0)
probabilities = model.predict(val_ds, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    assert ours["probabilities"].shape == (51, 1)
    same_values(plain, ours, "probabilities")


# examples/structured_data/collaborative_filtering_movielens.py: a subclassed RecommenderNet,
# user and movie embeddings (the embeddings are nearly all of its weights) with L2, a dot
# product by `keras.ops.tensordot`, BinaryCrossentropy; fit with validation data.
# (The example shuffles; here shuffle=False so both runs see the same batches.)
def test_collaborative_filtering_with_big_embeddings(ip):
    plain, ours, _ = both(ip, """
num_users, num_movies, EMBEDDING_SIZE = 610, 9724, 50
rs = np.random.RandomState(2)
pairs = np.stack([rs.randint(0, num_users, 1003), rs.randint(0, num_movies, 1003)], 1)
ratings = rs.uniform(0, 1, 1003).astype("float32")
x_train, x_val, y_train, y_val = pairs[:901], pairs[901:], ratings[:901], ratings[901:]

class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = keras.layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.user_bias = keras.layers.Embedding(num_users, 1)
        self.movie_embedding = keras.layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.movie_bias = keras.layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = keras.ops.tensordot(user_vector, movie_vector, 2)
        x = dot_user_movie + user_bias + movie_bias
        return keras.ops.nn.sigmoid(x)
""", """
model = RecommenderNet(num_users, num_movies, EMBEDDING_SIZE)
model.compile(loss=keras.losses.BinaryCrossentropy(),
              optimizer=keras.optimizers.Adam(learning_rate=0.001))
history = model.fit(x=x_train, y=y_train, batch_size=64, epochs=3, shuffle=False, verbose=0,
                    validation_data=(x_val, y_val))
scores = model.predict(x_val[:13], verbose=0)
evaluation = model.evaluate(x_val, y_val, return_dict=True, verbose=0)
""")
    # The dot product sums over the whole batch too: padded rows would change every row's
    # score, so on JAX nothing is padded. (RecommenderNet has no get_config, so %tpu_sync
    # refuses it with the fix, as Keras's own saving does.)
    same_history(plain, ours)
    same_values(plain, ours, "scores")
    same_values(plain, ours, "evaluation")
    same_weights(plain, ours)


# -- Custom layers with keras.ops ------------------------------------------------------------

# examples/keras_recipes/antirectifier.py: a layer of its own written with keras.ops
# (centering, L2 normalization, both signs' ReLUs concatenated, its own kernel), in an MLP
# compiled with RMSprop and SparseCategoricalAccuracy; fit with validation_split=0.15.
ANTIRECTIFIER = """
class Antirectifier(keras.layers.Layer):
    def __init__(self, initializer="he_normal", **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        output_dim = input_shape[-1]
        self.kernel = self.add_weight(shape=(output_dim * 2, output_dim),
                                      initializer=self.initializer, name="kernel",
                                      trainable=True)

    def call(self, inputs):
        inputs -= keras.ops.mean(inputs, axis=-1, keepdims=True)
        pos = keras.ops.relu(inputs)
        neg = keras.ops.relu(-inputs)
        concatenated = keras.ops.concatenate([pos, neg], axis=-1)
        return keras.ops.matmul(concatenated, self.kernel)

    def get_config(self):
        config = super().get_config()
        config.update({"initializer": keras.initializers.serialize(self.initializer)})
        return config

x_train = np.random.random((611, 784)).astype("float32")
y_train = np.random.randint(0, 10, 611)
"""


def test_antirectifier_layer_written_with_keras_ops(ip):
    plain, ours, _ = both(ip, ANTIRECTIFIER, """
model = keras.Sequential([
    keras.Input(shape=(784,)),
    keras.layers.Dense(256),
    Antirectifier(),
    keras.layers.Dense(256),
    Antirectifier(),
    keras.layers.Dense(10),
])
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=keras.optimizers.RMSprop(),
              metrics=[keras.metrics.SparseCategoricalAccuracy()])
history = model.fit(x_train, y_train, batch_size=128, epochs=2, validation_split=0.15,
                    shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)
    evaluate_equals_cpu_copy(ip, "model", "x_train[:77]", "y_train[:77]")
    fit_equals_evaluate_at_lr0(ip, "model", "x_train[:203]", "y_train[:203]", 64)


# -- KerasHub fine-tuning, tiny configs, random weights, no downloads ------------------------

TOKENS = """
import grain, keras_hub
VOCAB = 5000
rs = np.random.RandomState(0)
ids = rs.randint(1, VOCAB, (37, 17)).astype("int32")
mask = np.ones((37, 16), bool)
mask[::3, 11:] = False  # every third sequence ends early: padding tokens
features = {"token_ids": ids[:, :-1] * mask, "padding_mask": mask}
labels = ids[:, 1:] * mask
weights = mask.astype("float32")
def example(i):
    return ({"token_ids": features["token_ids"][i], "padding_mask": mask[i]}, labels[i],
            weights[i])
"""


# examples/keras_recipes/parameter_efficient_finetuning_of_gemma_with_lora_and_qlora.py,
# "LoRA Fine-tuning": enable_lora(rank=4) on the backbone, SGD, weighted
# SparseCategoricalAccuracy, fit on a dataset of preprocessed (x, y, sample_weight) batches
# (here grain, batches of 8 of 37 sequences: the last has 5), then predict.
def test_gemma_lora_fine_tuning_on_a_grain_dataset(ip):
    plain, ours, _ = both(ip, TOKENS, """
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
    hidden_dim=32, intermediate_dim=64, head_dim=16)
gemma_lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
gemma_lm.backbone.enable_lora(rank=4)
gemma_lm.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 optimizer=keras.optimizers.SGD(learning_rate=1e-4),
                 weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
train_ds = grain.MapDataset.source(np.arange(37)).map(example).batch(8)
history = gemma_lm.fit(train_ds, epochs=2, verbose=0)
logits = gemma_lm.predict(train_ds, verbose=0)
""")
    same_history(plain, ours)
    assert ours["logits"].shape == (37, 16, 5000)
    same_values(plain, ours, "logits")


# examples/keras_recipes/parameter_efficient_finetuning_of_gemma_with_lora_and_qlora.py,
# "QLoRA Fine-tuning": quantize("int8") first, then enable_lora; here fed NumPy arrays with
# sample weights (KerasHub tasks batch arrays themselves), then evaluate and predict.
def test_gemma_qlora_int8_then_lora_on_numpy(ip):
    plain, ours, _ = both(ip, TOKENS, """
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
    hidden_dim=32, intermediate_dim=64, head_dim=16)
gemma_lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
gemma_lm.quantize("int8")
gemma_lm.backbone.enable_lora(rank=4)
gemma_lm.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 optimizer=keras.optimizers.SGD(learning_rate=1e-4),
                 weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
history = gemma_lm.fit(features, labels, sample_weight=weights, batch_size=8, epochs=2,
                       shuffle=False, verbose=0)
evaluation = gemma_lm.evaluate(features, labels, sample_weight=weights, batch_size=8,
                               return_dict=True, verbose=0)
logits = gemma_lm.predict({k: v[:5] for k, v in features.items()}, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    assert ours["logits"].shape == (5, 16, 5000)
    same_values(plain, ours, "logits")


# examples/nlp/parameter_efficient_finetuning_of_gpt2_with_lora.py: the example's own LoRA
# layer wraps the query and value EinsumDense of every GPT-2 block, every other leaf is
# frozen, AdamW with global_clipnorm and weight-decay exclusions; then `trainable = False`
# and the A·B product merged into the original kernels, and the merged model predicts.
# Data: NumPy arrays with sample weights (KerasHub tasks take no PyDataset).
GPT2_LORA = TOKENS + """
import math
class LoraLayer(keras.layers.Layer):
    def __init__(self, original_layer, rank=8, alpha=32, layer_idx=0, trainable=False, **kwargs):
        config = original_layer.get_config()
        kwargs.pop("name", None)
        super().__init__(name=config["name"], trainable=trainable, **kwargs)
        self.rank, self.alpha, self._scale = rank, alpha, alpha / rank
        self.original_layer = original_layer
        self.original_layer.trainable = False
        self.A = keras.layers.Dense(
            units=rank, use_bias=False, trainable=trainable, name=f"A_{layer_idx}",
            kernel_initializer=keras.initializers.VarianceScaling(
                scale=math.sqrt(5), mode="fan_in", distribution="uniform"))
        self.B = keras.layers.EinsumDense(
            equation=config["equation"], output_shape=config["output_shape"],
            kernel_initializer="zeros", trainable=trainable, name=f"B_{layer_idx}")

    def call(self, inputs):
        original_output = self.original_layer(inputs)
        if self.trainable:
            return original_output + self.B(self.A(inputs)) * self._scale
        return original_output
"""


def test_gpt2_with_its_own_lora_layers_trains_merges_and_predicts(ip):
    plain, ours, _ = both(ip, GPT2_LORA, """
RANK, ALPHA = 4, 32.0
backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                         hidden_dim=32, intermediate_dim=64,
                                         max_sequence_length=16, dropout=0.0)
lora_model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
for layer_idx in range(backbone.num_layers):
    attention = backbone.get_layer(f"transformer_layer_{layer_idx}")._self_attention_layer
    attention._tracker.unlock()  # Keras 3 locks a built layer's attributes
    attention._query_dense = LoraLayer(attention._query_dense, rank=RANK, alpha=ALPHA,
                                       layer_idx=layer_idx, trainable=True)
    attention._value_dense = LoraLayer(attention._value_dense, rank=RANK, alpha=ALPHA,
                                       layer_idx=layer_idx, trainable=True)
    attention._tracker.lock()
lora_model({"token_ids": features["token_ids"][:1], "padding_mask": mask[:1]})
for layer in lora_model._flatten_layers():
    if len(list(layer._flatten_layers())) == 1:
        layer.trainable = "A_" in layer.name or "B_" in layer.name
optimizer = keras.optimizers.AdamW(learning_rate=5e-3, weight_decay=0.01, epsilon=1e-6,
                                   global_clipnorm=1.0)
optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
lora_model.compile(optimizer=optimizer,
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   weighted_metrics=["accuracy"])
history = lora_model.fit(features, labels, sample_weight=weights, batch_size=8, epochs=2,
                         shuffle=False, verbose=0)
trainable_count = len(lora_model.trainable_weights)

lora_model.trainable = False
for layer_idx in range(backbone.num_layers):
    attention = backbone.get_layer(f"transformer_layer_{layer_idx}")._self_attention_layer
    for lora in (attention._query_dense, attention._value_dense):
        increment = keras.ops.einsum("ab,bcd->acd", lora.A.kernel, lora.B.kernel) * (ALPHA / RANK)
        lora.original_layer.kernel.assign_add(increment)
merged = lora_model.predict({"token_ids": features["token_ids"][:5], "padding_mask": mask[:5]},
                            verbose=0)
""")
    assert ours["trainable_count"] == plain["trainable_count"] == 8
    same_history(plain, ours)
    assert ours["merged"].shape == (5, 16, 5000)
    same_values(plain, ours, "merged")


# guides/keras_hub/getting_started.py, "Fine tuning with user-controlled preprocessing": a
# BERT classifier with `preprocessor=None` fit on already-preprocessed batches
# ({"token_ids", "segment_ids", "padding_mask"}, label) with validation data, 3 epochs;
# here grain datasets of batch 16 (93 and 29 examples: short last batches).
BERT_DATA = """
import grain, keras_hub
VOCAB = 8000
rs = np.random.RandomState(3)
def packed(n, length=24):
    token_ids = rs.randint(5, VOCAB, (n, length)).astype("int32")
    lengths = rs.randint(6, length + 1, n)
    padding_mask = np.arange(length)[None, :] < lengths[:, None]
    token_ids = token_ids * padding_mask
    token_ids[:, 0] = 2  # [CLS]
    return {"token_ids": token_ids, "segment_ids": np.zeros_like(token_ids),
            "padding_mask": padding_mask}
train_x, test_x = packed(93), packed(29)
train_y, test_y = rs.randint(0, 2, 93), rs.randint(0, 2, 29)
def dataset(x, y, batch_size=16):
    return grain.MapDataset.source(np.arange(len(y))).map(
        lambda i: ({k: v[i] for k, v in x.items()}, y[i])).batch(batch_size)
"""


def test_bert_classifier_without_preprocessor_on_grain_datasets(ip):
    plain, ours, _ = both(ip, BERT_DATA, """
backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                         hidden_dim=32, intermediate_dim=64,
                                         max_sequence_length=24)
classifier = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                 preprocessor=None)
classifier.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   optimizer=keras.optimizers.Adam(5e-5), metrics=["accuracy"])
history = classifier.fit(dataset(train_x, train_y), validation_data=dataset(test_x, test_y),
                         epochs=3, verbose=0)
evaluation = classifier.evaluate(dataset(test_x, test_y), return_dict=True, verbose=0)
scores = classifier.predict(dataset(test_x, test_y), verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    assert ours["scores"].shape == (29, 2)
    same_values(plain, ours, "scores")


# guides/keras_hub/getting_started.py, "Fine tuning with a custom model": the BERT backbone
# frozen (`backbone.trainable = False`), two TransformerEncoder layers on its sequence
# output, a Dense on the [CLS] position; AdamW(5e-5), jit_compile=True; here fed NumPy.
def test_frozen_bert_backbone_under_new_transformer_layers(ip):
    plain, ours, _ = both(ip, BERT_DATA, """
backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                         hidden_dim=32, intermediate_dim=64,
                                         max_sequence_length=24)
backbone.trainable = False
inputs = backbone.input
sequence = backbone(inputs)["sequence_output"]
for _ in range(2):
    sequence = keras_hub.layers.TransformerEncoder(num_heads=2, intermediate_dim=64,
                                                   dropout=0.1)(sequence)
outputs = keras.layers.Dense(2)(sequence[:, backbone.cls_token_index, :])
model = keras.Model(inputs, outputs)
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=keras.optimizers.AdamW(5e-5),
              metrics=[keras.metrics.SparseCategoricalAccuracy()], jit_compile=True)
history = model.fit(train_x, train_y, validation_data=(test_x, test_y), batch_size=16,
                    epochs=3, shuffle=False, verbose=0)
frozen = [w.copy() for w in backbone.get_weights()]
""")
    same_history(plain, ours)
    same_values(plain, ours, "frozen")
    evaluate_equals_cpu_copy(ip, "model", "test_x", "test_y")


# guides/keras_hub/getting_started.py, "Build and train your own transformer from scratch":
# TokenAndPositionEmbedding over a 20,000-word vocabulary (nearly all the weights), one
# TransformerEncoder, a Dense on the first position, jit_compile=True; the data as a
# Python generator of batches (one pass: epochs=1), validation as a generator too.
def test_tiny_transformer_from_scratch_on_a_generator(ip):
    plain, ours, _ = both(ip, """
import keras_hub
rs = np.random.RandomState(4)
token_ids = rs.randint(0, 20000, (203, 32)).astype("int32")
classes = rs.randint(0, 2, 203)
def batches(start, stop, batch_size=32):
    for i in range(start, stop, batch_size):
        yield token_ids[i:min(i + batch_size, stop)], classes[i:min(i + batch_size, stop)]
""", """
token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
outputs = keras_hub.layers.TokenAndPositionEmbedding(vocabulary_size=20000, sequence_length=32,
                                                     embedding_dim=64)(token_id_input)
outputs = keras_hub.layers.TransformerEncoder(num_heads=2, intermediate_dim=128,
                                              dropout=0.1)(outputs)
outputs = keras.layers.Dense(2)(outputs[:, 0, :])
model = keras.Model(inputs=token_id_input, outputs=outputs)
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=keras.optimizers.AdamW(5e-5),
              metrics=[keras.metrics.SparseCategoricalAccuracy()], jit_compile=True)
history = model.fit(batches(0, 171), validation_data=batches(171, 203), epochs=1, verbose=0)
scores = model.predict(batches(171, 203), verbose=0)
""")
    same_history(plain, ours)
    assert ours["scores"].shape == (32, 2)
    same_values(plain, ours, "scores")


# examples/nlp/data_parallel_training_with_keras_hub.py: BertMaskedLM (preprocessor=None:
# {"token_ids", "segment_ids", "padding_mask", "mask_positions"}, mask ids, mask weights),
# its pooled_dense frozen, AdamW on a PolynomialDecay schedule, weighted
# SparseCategoricalAccuracy, a callback printing the learning rate each epoch, validation
# data; then evaluate on a test set. (The example's tf.data pipelines are grain here.)
def test_bert_masked_lm_with_a_decaying_learning_rate(ip):
    plain, ours, _ = both(ip, """
import grain, keras_hub
VOCAB = 6000
rs = np.random.RandomState(5)
def masked(n, length=20, picks=4):
    token_ids = rs.randint(5, VOCAB, (n, length)).astype("int32")
    positions = np.sort(np.stack([rs.choice(np.arange(1, length), picks, replace=False)
                                  for _ in range(n)]), 1).astype("int32")
    mask_ids = np.take_along_axis(token_ids, positions, 1)
    masked_ids = token_ids.copy()
    np.put_along_axis(masked_ids, positions, 4, 1)  # [MASK]
    mask_weights = np.ones((n, picks), "float32")
    mask_weights[::4, -1] = 0.0
    x = {"token_ids": masked_ids, "segment_ids": np.zeros_like(masked_ids),
         "padding_mask": np.ones_like(masked_ids, bool), "mask_positions": positions}
    return x, mask_ids, mask_weights
def dataset(parts, batch_size=16):
    x, y, w = parts
    return grain.MapDataset.source(np.arange(len(y))).map(
        lambda i: ({k: v[i] for k, v in x.items()}, y[i], w[i])).batch(batch_size)
train_parts, val_parts, test_parts = masked(77), masked(21), masked(19)
learning_rates = []
class PrintLR(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        learning_rates.append(float(self.model.optimizer.learning_rate))
""", """
backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                         hidden_dim=32, intermediate_dim=64,
                                         max_sequence_length=20)
model_dist = keras_hub.models.BertMaskedLM(backbone=backbone, preprocessor=None)
model_dist.backbone.get_layer("pooled_dense").trainable = False
EPOCHS = 3
lr_schedule = keras.optimizers.schedules.PolynomialDecay(
    initial_learning_rate=1e-4 * 8, decay_steps=5 * EPOCHS, end_learning_rate=0.0)
model_dist.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   optimizer=keras.optimizers.AdamW(learning_rate=lr_schedule),
                   weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
                   jit_compile=False)
history = model_dist.fit(dataset(train_parts), validation_data=dataset(val_parts),
                         epochs=EPOCHS, callbacks=[PrintLR()], verbose=0)
evaluation = model_dist.evaluate(dataset(test_parts), return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "learning_rates")
    same_values(plain, ours, "evaluation")


# examples/generative/opt2_text_generation_with_distribution.py: the user's own
# ModelParallel over a (1, 8) "batch" x "model" mesh with a LayoutMap written for OPT's
# variables (embeddings, query/key/value, attention output, feed-forward kernels), set
# process-wide before the model is built; a tiny OPT fine-tuned and asked to predict.
def test_opt_under_the_users_own_model_parallel_layout(ip):
    setup = TOKENS
    cell = """
mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"],
                                     devices=keras.distribution.list_devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[r"embeddings.*"] = (None, "model")
layout_map[r"self_attention.*(query|key|value).*kernel.*"] = (None, None, "model")
layout_map[r"self_attention.*(query|key|value).*bias.*"] = ("model", None)
layout_map[r"self_attention.*attention_output.*kernel.*"] = (None, "model", None)
layout_map[r"intermediate_dense.*kernel.*"] = (None, "model")
layout_map[r"intermediate_dense.*bias.*"] = ("model",)
layout_map[r"output_dense.*kernel.*"] = ("model", None)
layout_map[r"output_dense.*bias.*"] = (None,)
model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
keras.distribution.set_distribution(model_parallel)
backbone = keras_hub.models.OPTBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                        hidden_dim=32, intermediate_dim=64,
                                        max_sequence_length=16, dropout=0.0)
large_model = keras_hub.models.OPTCausalLM(backbone=backbone, preprocessor=None)
large_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    optimizer=keras.optimizers.Adam(1e-3), weighted_metrics=["accuracy"])
history = large_model.fit(features, labels, sample_weight=weights, batch_size=8, epochs=2,
                          shuffle=False, verbose=0)
specs = sorted({str(tuple(v.value.sharding.spec)) for v in large_model.weights})
logits = large_model.predict({k: v[:5] for k, v in features.items()}, verbose=0)
"""
    try:
        plain, ours, _ = both(ip, setup, cell)
        assert ours["specs"] == plain["specs"]
        assert "(None, 'model')" in ours["specs"]
        same_history(plain, ours)
        same_values(plain, ours, "logits")
    finally:
        run_cell(ip, "keras.distribution.set_distribution(None)")


# -- Vision ----------------------------------------------------------------------------------

IMAGES = """
rs = np.random.RandomState(6)
x_train = rs.randint(0, 256, (203, 32, 32, 3)).astype("float32")
y_train = rs.randint(0, 10, (203, 1))
x_test = rs.randint(0, 256, (45, 32, 32, 3)).astype("float32")
y_test = rs.randint(0, 10, (45, 1))
"""


# examples/vision/image_classification_efficientnet_fine_tuning.py: an image-augmentation
# Sequential in front of a pretrained base set `trainable = False`, a new top
# (GlobalAveragePooling2D, BatchNormalization, Dropout, softmax), Adam(1e-2); then the last
# layers of the base unfrozen except BatchNormalization, recompiled with Adam(1e-5), fit
# again, and predict. A small conv base stands in for EfficientNetB0 (no weights download).
def test_efficientnet_style_fine_tuning_freezes_then_unfreezes(ip):
    plain, ours, _ = both(ip, IMAGES + """
NUM_CLASSES = 10
y_train_hot = keras.utils.to_categorical(y_train, NUM_CLASSES)
y_test_hot = keras.utils.to_categorical(y_test, NUM_CLASSES)
img_augmentation_layers = [
    keras.layers.RandomRotation(factor=0.15),
    keras.layers.RandomTranslation(height_factor=0.1, width_factor=0.1),
    keras.layers.RandomFlip(),
    keras.layers.RandomContrast(factor=0.1),
]
def img_augmentation(images):
    for layer in img_augmentation_layers:
        images = layer(images)
    return images
def small_base(inputs, input_tensor):
    # like EfficientNetB0(include_top=False, input_tensor=...): its layers join the graph
    h = keras.layers.Rescaling(1.0 / 255)(input_tensor)
    for filters in (16, 32, 32):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("swish")(h)
        h = keras.layers.MaxPooling2D()(h)
    return keras.Model(inputs, h, name="base")
""", """
inputs = keras.layers.Input(shape=(32, 32, 3))
x = img_augmentation(inputs)
base = small_base(inputs, x)
base.trainable = False
x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(base.output)
x = keras.layers.BatchNormalization()(x)
x = keras.layers.Dropout(0.2, name="top_dropout")(x)
outputs = keras.layers.Dense(NUM_CLASSES, activation="softmax", name="pred")(x)
model = keras.Model(inputs, outputs, name="EfficientNet")
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2),
              loss="categorical_crossentropy", metrics=["accuracy"])
history = model.fit(x_train, y_train_hot, batch_size=64, epochs=2, shuffle=False, verbose=0,
                    validation_data=(x_test, y_test_hot))

for layer in model.layers[-12:]:
    if not isinstance(layer, keras.layers.BatchNormalization):
        layer.trainable = True
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-5),
              loss="categorical_crossentropy", metrics=["accuracy"])
trainable_after = len(model.trainable_weights)
tuned = model.fit(x_train, y_train_hot, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  validation_data=(x_test, y_test_hot))
probabilities = model.predict(x_test[:13], verbose=0)
""")
    assert ours["trainable_after"] == plain["trainable_after"]
    same_history(plain, ours)
    same_history(plain, ours, "tuned")
    same_values(plain, ours, "probabilities")
    evaluate_equals_cpu_copy(ip, "model", "x_test", "y_test_hot")


# examples/vision/image_classification_with_vision_transformer.py: a data-augmentation
# Sequential whose Normalization is adapted to the training images in an EARLIER cell, a
# Patches layer (keras.ops.image.extract_patches), a PatchEncoder (projection + position
# Embedding), transformer blocks of MultiHeadAttention, AdamW, top-5 accuracy, fit with
# validation_split=0.1 and a ModelCheckpoint of the best weights, then load_weights and
# evaluate on the test set.
VIT = IMAGES + """
import os, tempfile
image_size, patch_size, projection_dim, num_heads = 32, 8, 32, 2
num_patches = (image_size // patch_size) ** 2
transformer_units = [projection_dim * 2, projection_dim]
data_augmentation = keras.Sequential([
    keras.layers.Normalization(),
    keras.layers.Resizing(image_size, image_size),
    keras.layers.RandomFlip("horizontal"),
    keras.layers.RandomRotation(factor=0.02),
    keras.layers.RandomZoom(height_factor=0.2, width_factor=0.2),
], name="data_augmentation")
data_augmentation.layers[0].adapt(x_train)  # this cell runs before the training cell

def mlp(x, hidden_units, dropout_rate):
    for units in hidden_units:
        x = keras.layers.Dense(units, activation=keras.activations.gelu)(x)
        x = keras.layers.Dropout(dropout_rate)(x)
    return x

class Patches(keras.layers.Layer):
    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size
    def call(self, images):
        shape = keras.ops.shape(images)
        patches = keras.ops.image.extract_patches(images, size=self.patch_size)
        rows, columns = shape[1] // self.patch_size, shape[2] // self.patch_size
        return keras.ops.reshape(patches, (shape[0], rows * columns,
                                           self.patch_size * self.patch_size * shape[-1]))
    def get_config(self):
        return {**super().get_config(), "patch_size": self.patch_size}

class PatchEncoder(keras.layers.Layer):
    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection = keras.layers.Dense(units=projection_dim)
        self.position_embedding = keras.layers.Embedding(input_dim=num_patches,
                                                         output_dim=projection_dim)
    def call(self, patch):
        positions = keras.ops.expand_dims(keras.ops.arange(0, self.num_patches, 1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)
    def get_config(self):
        return {**super().get_config(), "num_patches": self.num_patches,
                "projection_dim": self.projection.units}

checkpoint_filepath = os.path.join(tempfile.mkdtemp(), "checkpoint.weights.h5")
"""


def test_vision_transformer_with_an_augmentation_adapted_in_an_earlier_cell(ip):
    plain, ours, _ = both(ip, VIT, """
inputs = keras.Input(shape=(32, 32, 3))
augmented = data_augmentation(inputs)
encoded_patches = PatchEncoder(num_patches, projection_dim)(Patches(patch_size)(augmented))
for _ in range(2):
    x1 = keras.layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
    attention_output = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=projection_dim,
                                                       dropout=0.1)(x1, x1)
    x2 = keras.layers.Add()([attention_output, encoded_patches])
    x3 = keras.layers.LayerNormalization(epsilon=1e-6)(x2)
    x3 = mlp(x3, hidden_units=transformer_units, dropout_rate=0.1)
    encoded_patches = keras.layers.Add()([x3, x2])
representation = keras.layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
representation = keras.layers.Flatten()(representation)
representation = keras.layers.Dropout(0.5)(representation)
features = mlp(representation, hidden_units=[64, 32], dropout_rate=0.5)
logits = keras.layers.Dense(10)(features)
model = keras.Model(inputs=inputs, outputs=logits)
model.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                       keras.metrics.SparseTopKCategoricalAccuracy(5, name="top-5-accuracy")])
checkpoint_callback = keras.callbacks.ModelCheckpoint(
    checkpoint_filepath, monitor="val_accuracy", save_best_only=True, save_weights_only=True)
history = model.fit(x=x_train, y=y_train, batch_size=32, epochs=3, validation_split=0.1,
                    callbacks=[checkpoint_callback], shuffle=False, verbose=0)
model.load_weights(checkpoint_filepath)
_, accuracy, top_5_accuracy = model.evaluate(x_test, y_test, verbose=0)
""")
    same_history(plain, ours)
    assert ours["accuracy"] == pytest.approx(plain["accuracy"])
    assert ours["top_5_accuracy"] == pytest.approx(plain["top_5_accuracy"])


# examples/vision/mlp_image_classification.py (MLP-Mixer): the augmentation's Normalization
# adapted inside the training cell, Patches, MLPMixer blocks (token mixing by transposing
# with keras.ops), AdamW, top-5 accuracy, ReduceLROnPlateau and EarlyStopping with
# restore_best_weights, validation_split=0.1; then evaluate.
def test_mlp_mixer_with_reduce_lr_on_plateau_and_early_stopping(ip):
    plain, ours, _ = both(ip, VIT + """
class MLPMixerLayer(keras.layers.Layer):
    def __init__(self, num_patches, hidden_units, dropout_rate, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mlp1 = keras.Sequential([
            keras.layers.Dense(units=num_patches, activation="gelu"),
            keras.layers.Dense(units=num_patches), keras.layers.Dropout(rate=dropout_rate)])
        self.mlp2 = keras.Sequential([
            keras.layers.Dense(units=num_patches, activation="gelu"),
            keras.layers.Dense(units=hidden_units), keras.layers.Dropout(rate=dropout_rate)])
        self.normalize = keras.layers.LayerNormalization(epsilon=1e-6)

    def build(self, input_shape):
        return super().build(input_shape)

    def call(self, inputs):
        x = self.normalize(inputs)
        x_channels = keras.ops.transpose(x, axes=(0, 2, 1))
        mlp1_outputs = self.mlp1(x_channels)
        mlp1_outputs = keras.ops.transpose(mlp1_outputs, axes=(0, 2, 1))
        x = mlp1_outputs + inputs
        x_patches = self.normalize(x)
        return x + self.mlp2(x_patches)
""", """
data_augmentation.layers[0].adapt(x_train)
inputs = keras.Input(shape=(32, 32, 3))
augmented = data_augmentation(inputs)
patches = Patches(patch_size)(augmented)
x = keras.layers.Dense(units=32)(patches)
for _ in range(2):
    x = MLPMixerLayer(num_patches, 32, 0.2)(x)
representation = keras.layers.GlobalAveragePooling1D()(x)
representation = keras.layers.Dropout(rate=0.2)(representation)
logits = keras.layers.Dense(10)(representation)
model = keras.Model(inputs=inputs, outputs=logits)
model.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.005, weight_decay=0.0001),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc"),
                       keras.metrics.SparseTopKCategoricalAccuracy(5, name="top5-acc")])
reduce_lr = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1)
early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2,
                                               restore_best_weights=True)
history = model.fit(x=x_train, y=y_train, batch_size=32, epochs=4, validation_split=0.1,
                    callbacks=[early_stopping, reduce_lr], shuffle=False, verbose=0)
_, accuracy, top_5_accuracy = model.evaluate(x_test, y_test, verbose=0)
""")
    same_history(plain, ours)
    assert ours["accuracy"] == pytest.approx(plain["accuracy"])
    assert ours["top_5_accuracy"] == pytest.approx(plain["top_5_accuracy"])


# examples/vision/cct.py (Compact Convolutional Transformer): a convolutional tokenizer,
# learned position embeddings, StochasticDepth drawing from keras.random with its own
# SeedGenerator, sequence pooling, CategoricalCrossentropy(label_smoothing=0.1), AdamW,
# top-5 accuracy, validation_split=0.1, a best-weights ModelCheckpoint.
def test_compact_convolutional_transformer_with_label_smoothing(ip):
    plain, ours, _ = both(ip, IMAGES + """
import os, tempfile
y_train_hot = keras.utils.to_categorical(y_train, 10)
checkpoint_filepath = os.path.join(tempfile.mkdtemp(), "checkpoint.weights.h5")

class CCTTokenizer(keras.layers.Layer):
    def __init__(self, kernel_size=3, stride=1, padding=1, pooling_kernel_size=3,
                 pooling_stride=2, num_conv_layers=2, num_output_channels=(32, 32), **kwargs):
        super().__init__(**kwargs)
        self.conv_model = keras.Sequential()
        for i in range(num_conv_layers):
            self.conv_model.add(keras.layers.Conv2D(
                num_output_channels[i], kernel_size, stride, padding="valid", use_bias=False,
                activation="relu", kernel_initializer="he_normal"))
            self.conv_model.add(keras.layers.ZeroPadding2D(padding))
            self.conv_model.add(keras.layers.MaxPooling2D(pooling_kernel_size, pooling_stride,
                                                          "same"))

    def call(self, images):
        outputs = self.conv_model(images)
        shape = keras.ops.shape(outputs)
        return keras.ops.reshape(outputs, (-1, shape[1] * shape[2], shape[-1]))

class PositionEmbedding(keras.layers.Layer):
    def __init__(self, sequence_length, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = int(sequence_length)
    def build(self, input_shape):
        self.position_embeddings = self.add_weight(
            shape=[self.sequence_length, input_shape[-1]], initializer="glorot_uniform",
            trainable=True)
    def call(self, inputs, start_index=0):
        shape = keras.ops.shape(inputs)
        position_embeddings = keras.ops.convert_to_tensor(self.position_embeddings)
        position_embeddings = keras.ops.slice(position_embeddings, (start_index, 0),
                                              (shape[-2], shape[-1]))
        return inputs + keras.ops.broadcast_to(position_embeddings, shape)

class SequencePooling(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.Dense(1)
    def call(self, x):
        attention_weights = keras.ops.softmax(self.attention(x), axis=1)
        attention_weights = keras.ops.transpose(attention_weights, axes=(0, 2, 1))
        weighted_representation = keras.ops.matmul(attention_weights, x)
        return keras.ops.squeeze(weighted_representation, -2)

class StochasticDepth(keras.layers.Layer):
    def __init__(self, drop_prop, **kwargs):
        super().__init__(**kwargs)
        self.drop_prob = drop_prop
        self.seed_generator = keras.random.SeedGenerator(1337)
    def call(self, x, training=None):
        if training:
            keep_prob = 1 - self.drop_prob
            shape = (keras.ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
            random_tensor = keep_prob + keras.random.uniform(shape, 0, 1, seed=self.seed_generator)
            return (x / keep_prob) * keras.ops.floor(random_tensor)
        return x

data_augmentation = keras.Sequential([
    keras.layers.Rescaling(scale=1.0 / 255),
    keras.layers.RandomCrop(32, 32),
    keras.layers.RandomFlip("horizontal"),
], name="data_augmentation")
""", """
projection_dim, num_heads, transformer_layers, stochastic_depth_rate = 32, 2, 2, 0.1
inputs = keras.layers.Input((32, 32, 3))
augmented = data_augmentation(inputs)
encoded_patches = CCTTokenizer()(augmented)
encoded_patches = PositionEmbedding(sequence_length=encoded_patches.shape[1])(encoded_patches)
dpr = [x for x in np.linspace(0, stochastic_depth_rate, transformer_layers)]
for i in range(transformer_layers):
    x1 = keras.layers.LayerNormalization(epsilon=1e-5)(encoded_patches)
    attention_output = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=projection_dim,
                                                       dropout=0.1)(x1, x1)
    attention_output = StochasticDepth(dpr[i])(attention_output)
    x2 = keras.layers.Add()([attention_output, encoded_patches])
    x3 = keras.layers.LayerNormalization(epsilon=1e-5)(x2)
    x3 = keras.layers.Dense(projection_dim, activation=keras.activations.gelu)(x3)
    x3 = keras.layers.Dropout(0.1)(x3)
    x3 = StochasticDepth(dpr[i])(x3)
    encoded_patches = keras.layers.Add()([x3, x2])
representation = keras.layers.LayerNormalization(epsilon=1e-5)(encoded_patches)
weighted_representation = SequencePooling()(representation)
logits = keras.layers.Dense(10)(weighted_representation)
model = keras.Model(inputs=inputs, outputs=logits)
model.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
              loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
              metrics=[keras.metrics.CategoricalAccuracy(name="accuracy"),
                       keras.metrics.TopKCategoricalAccuracy(5, name="top-5-accuracy")])
checkpoint_callback = keras.callbacks.ModelCheckpoint(
    checkpoint_filepath, monitor="val_accuracy", save_best_only=True, save_weights_only=True)
history = model.fit(x=x_train, y=y_train_hot, batch_size=32, epochs=3, validation_split=0.1,
                    callbacks=[checkpoint_callback], shuffle=False, verbose=0)
model.load_weights(checkpoint_filepath)
evaluation = model.evaluate(x_train[:45], y_train_hot[:45], return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")


# examples/vision/knowledge_distillation.py: a teacher CNN trained in an EARLIER cell, then
# a Distiller (keras.Model holding teacher and student) whose compile takes a student loss,
# a KLDivergence distillation loss, alpha and temperature, and whose compute_loss mixes
# them (Keras 3 form of the example's step); fit with the default batch of 32 on 203
# images, then evaluate.
DISTILLER = """
x_train = np.random.random((203, 28, 28, 1)).astype("float32")
y_train = np.random.randint(0, 10, 203)
x_test, y_test = x_train[:61], y_train[:61]
teacher = keras.Sequential([
    keras.Input(shape=(28, 28, 1)),
    keras.layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
    keras.layers.LeakyReLU(negative_slope=0.2),
    keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
    keras.layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same"),
    keras.layers.Flatten(),
    keras.layers.Dense(10),
], name="teacher")
teacher.compile(optimizer=keras.optimizers.Adam(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy()])
teacher.fit(x_train, y_train, epochs=1, verbose=0)

class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            keras.ops.softmax(teacher_pred / self.temperature, axis=1),
            keras.ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)
"""


def test_knowledge_distillation_from_a_teacher_trained_in_an_earlier_cell(ip):
    plain, ours, _ = both(ip, DISTILLER, """
student = keras.Sequential([
    keras.Input(shape=(28, 28, 1)),
    keras.layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
    keras.layers.LeakyReLU(negative_slope=0.2),
    keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
    keras.layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
    keras.layers.Flatten(),
    keras.layers.Dense(10),
], name="student")
distiller = Distiller(student=student, teacher=teacher)
distiller.compile(optimizer=keras.optimizers.Adam(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
history = distiller.fit(x_train, y_train, epochs=2, shuffle=False, verbose=0)
evaluation = distiller.evaluate(x_test, y_test, return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    same_weights(plain, ours, "student")


# examples/vision/siamese_contrastive.py: pairs of images, a shared embedding tower
# (BatchNormalization, tanh convolutions, average pooling), a Lambda Euclidean distance, a
# contrastive loss of its own that ends in `ops.mean`, RMSprop, batch 16, validation data.
def test_siamese_network_with_a_contrastive_loss(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(7)
x_train_1 = rs.random((203, 28, 28, 1)).astype("float32")
x_train_2 = rs.random((203, 28, 28, 1)).astype("float32")
labels_train = rs.randint(0, 2, 203).astype("float32")
x_val_1 = rs.random((45, 28, 28, 1)).astype("float32")
x_val_2 = rs.random((45, 28, 28, 1)).astype("float32")
labels_val = rs.randint(0, 2, 45).astype("float32")

def euclidean_distance(vects):
    x, y = vects
    sum_square = keras.ops.sum(keras.ops.square(x - y), axis=1, keepdims=True)
    return keras.ops.sqrt(keras.ops.maximum(sum_square, keras.backend.epsilon()))

def loss(margin=1):
    def contrastive_loss(y_true, y_pred):
        square_pred = keras.ops.square(y_pred)
        margin_square = keras.ops.square(keras.ops.maximum(margin - (y_pred), 0))
        return keras.ops.mean((1 - y_true) * square_pred + (y_true) * margin_square)
    return contrastive_loss
""", """
input = keras.layers.Input((28, 28, 1))
x = keras.layers.BatchNormalization()(input)
x = keras.layers.Conv2D(4, (5, 5), activation="tanh")(x)
x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
x = keras.layers.Conv2D(16, (5, 5), activation="tanh")(x)
x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
x = keras.layers.Flatten()(x)
x = keras.layers.BatchNormalization()(x)
x = keras.layers.Dense(10, activation="tanh")(x)
embedding_network = keras.Model(input, x)
input_1 = keras.layers.Input((28, 28, 1))
input_2 = keras.layers.Input((28, 28, 1))
tower_1 = embedding_network(input_1)
tower_2 = embedding_network(input_2)
merge_layer = keras.layers.Lambda(euclidean_distance, output_shape=(1,))([tower_1, tower_2])
normal_layer = keras.layers.BatchNormalization()(merge_layer)
output_layer = keras.layers.Dense(1, activation="sigmoid")(normal_layer)
siamese = keras.Model(inputs=[input_1, input_2], outputs=output_layer)
siamese.compile(loss=loss(margin=1), optimizer="RMSprop", metrics=["accuracy"])
history = siamese.fit([x_train_1, x_train_2], labels_train,
                      validation_data=([x_val_1, x_val_2], labels_val),
                      batch_size=16, epochs=2, shuffle=False, verbose=0)
results = siamese.evaluate([x_val_1, x_val_2], labels_val, return_dict=True, verbose=0)
distances = siamese.predict([x_val_1[:5], x_val_2[:5]], verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "results")
    same_values(plain, ours, "distances")


# examples/vision/supervised-contrastive-learning.py: an encoder with a Normalization
# adapted before training, pretrained with a supervised contrastive loss (a Loss subclass
# whose __call__ compares every pair of feature vectors in the batch: the npairs loss, in
# keras.ops), then frozen (`layer.trainable = False` for every encoder layer) under a new
# classifier that is trained and evaluated. (The example's batch is 265; 8 does not divide
# it, so here 64.)
def test_supervised_contrastive_pretraining_then_a_frozen_encoder(ip):
    plain, ours, _ = both(ip, IMAGES + """
data_augmentation = keras.Sequential([keras.layers.Normalization(),
                                      keras.layers.RandomFlip("horizontal"),
                                      keras.layers.RandomRotation(0.02)])
data_augmentation.layers[0].adapt(x_train)

def create_encoder():
    inputs = keras.Input(shape=(32, 32, 3))
    x = data_augmentation(inputs)
    x = keras.layers.Conv2D(16, 3, activation="relu")(x)
    x = keras.layers.Conv2D(32, 3, strides=2, activation="relu")(x)
    outputs = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs=inputs, outputs=outputs, name="cifar10-encoder")

def create_classifier(encoder, trainable=True):
    for layer in encoder.layers:
        layer.trainable = trainable
    inputs = keras.Input(shape=(32, 32, 3))
    features = encoder(inputs)
    features = keras.layers.Dropout(0.5)(features)
    features = keras.layers.Dense(64, activation="relu")(features)
    features = keras.layers.Dropout(0.5)(features)
    outputs = keras.layers.Dense(10, activation="softmax")(features)
    model = keras.Model(inputs=inputs, outputs=outputs, name="cifar10-classifier")
    model.compile(optimizer=keras.optimizers.Adam(0.001),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model

class SupervisedContrastiveLoss(keras.losses.Loss):
    def __init__(self, temperature=1, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        normalized = feature_vectors / keras.ops.norm(feature_vectors, axis=1, keepdims=True)
        logits = keras.ops.divide(keras.ops.matmul(normalized, keras.ops.transpose(normalized)),
                                  self.temperature)
        labels = keras.ops.reshape(labels, (-1, 1))
        same_class = keras.ops.cast(keras.ops.equal(labels, keras.ops.transpose(labels)), "float32")
        same_class = same_class / keras.ops.sum(same_class, axis=1, keepdims=True)
        return keras.ops.mean(keras.ops.categorical_crossentropy(same_class, logits,
                                                                 from_logits=True))

def add_projection_head(encoder):
    inputs = keras.Input(shape=(32, 32, 3))
    outputs = keras.layers.Dense(32, activation="relu")(encoder(inputs))
    return keras.Model(inputs=inputs, outputs=outputs, name="encoder_with_projection-head")
""", """
encoder = create_encoder()
encoder_with_projection_head = add_projection_head(encoder)
encoder_with_projection_head.compile(optimizer=keras.optimizers.Adam(0.001),
                                     loss=SupervisedContrastiveLoss(0.05))
pretraining = encoder_with_projection_head.fit(x=x_train, y=y_train, batch_size=64, epochs=2,
                                               shuffle=False, verbose=0)
classifier = create_classifier(encoder, trainable=False)
history = classifier.fit(x=x_train, y=y_train, batch_size=64, epochs=2, shuffle=False,
                         verbose=0)
accuracy = classifier.evaluate(x_test, y_test, verbose=0)[1]
""")
    same_history(plain, ours, "pretraining")
    same_history(plain, ours)
    assert ours["accuracy"] == pytest.approx(plain["accuracy"])


# examples/vision/mixup.py: every training batch mixed with a second batch of the same size
# by a Beta-distributed weight (images and one-hot labels alike), the mixing done in the
# input pipeline (grain here; the example's is tf.data), a small CNN, validation data.
def test_mixup_in_a_grain_pipeline(ip):
    plain, ours, _ = both(ip, """
import grain
rs = np.random.RandomState(8)
x_train = rs.random((203, 28, 28, 1)).astype("float32")
y_train = keras.utils.to_categorical(rs.randint(0, 10, 203), 10).astype("float32")
x_val, y_val = x_train[:45], y_train[:45]
BATCH_SIZE = 64
partner = np.random.RandomState(9).permutation(203)
mixing = np.random.RandomState(10).beta(0.2, 0.2, 203).astype("float32")

def mix_up(i):
    l = mixing[i]
    j = partner[i]
    return (x_train[i] * l + x_train[j] * (1 - l), y_train[i] * l + y_train[j] * (1 - l))

train_ds_mu = grain.MapDataset.source(np.arange(203)).map(mix_up).batch(BATCH_SIZE)
val_ds = grain.MapDataset.source(np.arange(45)).map(
    lambda i: (x_val[i], y_val[i])).batch(BATCH_SIZE)
""", """
model = keras.Sequential([
    keras.layers.Input(shape=(28, 28, 1)),
    keras.layers.Conv2D(16, (5, 5), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Conv2D(32, (5, 5), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Dropout(0.2),
    keras.layers.GlobalAvgPool2D(),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(train_ds_mu, validation_data=val_ds, epochs=2, verbose=0)
_, test_acc = model.evaluate(val_ds, verbose=0)
""")
    same_history(plain, ours)
    assert ours["test_acc"] == pytest.approx(plain["test_acc"])


# examples/vision/3D_image_classification.py: a Conv3D network (BatchNormalization after
# every pooling), Adam on an ExponentialDecay(staircase=True) schedule, binary
# crossentropy, ModelCheckpoint and EarlyStopping(monitor="val_acc"), validation data; then
# predict one volume. (The example's batch of 2 is under the 8 devices: here 16.)
def test_3d_convolutions_with_an_exponential_decay_schedule(ip):
    plain, ours, _ = both(ip, """
import os, tempfile
rs = np.random.RandomState(11)
x_train = rs.random((53, 16, 16, 8, 1)).astype("float32")
y_train = rs.randint(0, 2, 53).astype("float32")
x_val, y_val = x_train[:21], y_train[:21]
checkpoint = os.path.join(tempfile.mkdtemp(), "3d_image_classification.keras")
""", """
inputs = keras.Input((16, 16, 8, 1))
x = keras.layers.Conv3D(filters=8, kernel_size=3, activation="relu")(inputs)
x = keras.layers.MaxPool3D(pool_size=2)(x)
x = keras.layers.BatchNormalization()(x)
x = keras.layers.Conv3D(filters=16, kernel_size=3, activation="relu", padding="same")(x)
x = keras.layers.MaxPool3D(pool_size=2)(x)
x = keras.layers.BatchNormalization()(x)
x = keras.layers.GlobalAveragePooling3D()(x)
x = keras.layers.Dense(units=32, activation="relu")(x)
x = keras.layers.Dropout(0.3)(x)
outputs = keras.layers.Dense(units=1, activation="sigmoid")(x)
model = keras.Model(inputs, outputs, name="3dcnn")
lr_schedule = keras.optimizers.schedules.ExponentialDecay(0.0001, decay_steps=2,
                                                          decay_rate=0.96, staircase=True)
model.compile(loss="binary_crossentropy",
              optimizer=keras.optimizers.Adam(learning_rate=lr_schedule), metrics=["acc"])
checkpoint_cb = keras.callbacks.ModelCheckpoint(checkpoint, save_best_only=True)
early_stopping_cb = keras.callbacks.EarlyStopping(monitor="val_acc", patience=15)
history = model.fit(x_train, y_train, validation_data=(x_val, y_val), epochs=3, batch_size=16,
                    shuffle=False, verbose=0, callbacks=[checkpoint_cb, early_stopping_cb])
prediction = model.predict(np.expand_dims(x_val[0], axis=0), verbose=0)[0]
iterations = int(model.optimizer.iterations)
""")
    same_history(plain, ours)
    assert ours["iterations"] == plain["iterations"] == 12
    same_values(plain, ours, "prediction")


# examples/vision/reptile.py: the meta-learning loop saves the weights, takes a few SGD
# steps on a 5-way 1-shot mini-batch (5 images), moves the saved weights part of the way
# and evaluates on held-out images. The example steps with a GradientTape (TensorFlow);
# written here as a JAX user writes it, with train_on_batch, test_on_batch and
# predict_on_batch on the 5-row batches (8 does not divide 5).
def test_reptile_loop_with_train_on_batch_on_five_rows(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(12)
images = rs.random((5, 28, 28, 1)).astype("float32")
labels = np.arange(5)
test_images = rs.random((5, 28, 28, 1)).astype("float32")
def conv_bn(x):
    x = keras.layers.Conv2D(filters=16, kernel_size=3, strides=2, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x)
""", """
inputs = keras.layers.Input(shape=(28, 28, 1))
x = conv_bn(inputs)
x = conv_bn(x)
x = keras.layers.Flatten()(x)
outputs = keras.layers.Dense(5, activation="softmax")(x)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.003),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
losses, tests = [], []
for meta_iter in range(3):
    cur_meta_step_size = (1 - meta_iter / 3) * 0.25
    old_vars = model.get_weights()
    for _ in range(4):
        losses.append(model.train_on_batch(images, labels))
    new_vars = model.get_weights()
    model.set_weights([old + (new - old) * cur_meta_step_size
                       for old, new in zip(old_vars, new_vars)])
    tests.append(model.test_on_batch(images, labels))
test_preds = model.predict_on_batch(test_images)
""")
    same_values(plain, ours, "losses")
    same_values(plain, ours, "tests")
    assert ours["test_preds"].shape == (5, 5)
    same_values(plain, ours, "test_preds")
    same_weights(plain, ours)


# -- Timeseries ------------------------------------------------------------------------------

# examples/timeseries/timeseries_weather_forecasting.py: windows of 7 normalized weather
# features predicting a later temperature, LSTM(32) and Dense(1), Adam(1e-3) on MSE,
# ModelCheckpoint(save_best_only) and EarlyStopping on val_loss, validation windows; then
# predict a few windows. The example's windows come from timeseries_dataset_from_array
# (tf.data); here a keras.utils.PyDataset of windows (203 training windows, batches of 32).
def test_weather_forecasting_lstm_on_a_pydataset_of_windows(ip):
    plain, ours, _ = both(ip, """
import math, os, tempfile
rs = np.random.RandomState(13)
series = rs.normal(size=(400, 7)).astype("float32")
series = (series - series.mean(0)) / series.std(0)
sequence_length, future = 24, 6

class Windows(keras.utils.PyDataset):
    def __init__(self, starts, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.starts, self.batch_size = starts, batch_size
    def __len__(self):
        return math.ceil(len(self.starts) / self.batch_size)
    def __getitem__(self, index):
        starts = self.starts[index * self.batch_size:(index + 1) * self.batch_size]
        x = np.stack([series[s:s + sequence_length] for s in starts])
        y = np.stack([series[s + sequence_length + future, 1:2] for s in starts])
        return x, y

dataset_train = Windows(np.arange(0, 203), 32)
dataset_val = Windows(np.arange(250, 295), 32)
path_checkpoint = os.path.join(tempfile.mkdtemp(), "model_checkpoint.weights.h5")
""", """
inputs = keras.layers.Input(shape=(sequence_length, 7))
lstm_out = keras.layers.LSTM(32)(inputs)
outputs = keras.layers.Dense(1)(lstm_out)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
es_callback = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5)
modelckpt_callback = keras.callbacks.ModelCheckpoint(
    monitor="val_loss", filepath=path_checkpoint, verbose=0, save_weights_only=True,
    save_best_only=True)
history = model.fit(dataset_train, epochs=3, validation_data=dataset_val, shuffle=False,
                    callbacks=[es_callback, modelckpt_callback], verbose=0)
predictions = [model.predict(dataset_val[i][0], verbose=0)[0] for i in range(2)]
""")
    same_history(plain, ours)
    same_values(plain, ours, "predictions")


# examples/timeseries/timeseries_anomaly_detection.py: a Conv1D / Conv1DTranspose
# autoencoder with Dropout, Adam(1e-3) on MSE, fit on the windows as their own targets with
# validation_split=0.1 and EarlyStopping; the largest training reconstruction error is the
# threshold, and test windows above it are anomalies.
def test_anomaly_detection_autoencoder_and_its_threshold(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(14)
TIME_STEPS = 64
values = np.sin(np.arange(330) / 7.0)[:, None] + 0.1 * rs.normal(size=(330, 1))
x_train = np.stack([values[i:i + TIME_STEPS] for i in range(203)]).astype("float32")
x_test = np.stack([values[i:i + TIME_STEPS] + (i % 9 == 0) for i in range(51)]).astype("float32")
""", """
model = keras.Sequential([
    keras.layers.Input(shape=(x_train.shape[1], x_train.shape[2])),
    keras.layers.Conv1D(filters=32, kernel_size=7, padding="same", strides=2, activation="relu"),
    keras.layers.Dropout(rate=0.2),
    keras.layers.Conv1D(filters=16, kernel_size=7, padding="same", strides=2, activation="relu"),
    keras.layers.Conv1DTranspose(filters=16, kernel_size=7, padding="same", strides=2,
                                 activation="relu"),
    keras.layers.Dropout(rate=0.2),
    keras.layers.Conv1DTranspose(filters=32, kernel_size=7, padding="same", strides=2,
                                 activation="relu"),
    keras.layers.Conv1DTranspose(filters=1, kernel_size=7, padding="same"),
])
model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
history = model.fit(x_train, x_train, epochs=3, batch_size=128, validation_split=0.1,
                    shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss", patience=5,
                                                             mode="min")])
x_train_pred = model.predict(x_train, verbose=0)
train_mae_loss = np.mean(np.abs(x_train_pred - x_train), axis=1)
threshold = np.max(train_mae_loss)
x_test_pred = model.predict(x_test, verbose=0)
test_mae_loss = np.mean(np.abs(x_test_pred - x_test), axis=1).reshape((-1))
anomalies = int(np.sum(test_mae_loss > threshold))
""")
    same_history(plain, ours)
    assert ours["x_test_pred"].shape == (51, 64, 1)
    same_values(plain, ours, "threshold")
    assert ours["anomalies"] == plain["anomalies"]


# examples/timeseries/timeseries_classification_transformer.py: transformer encoder blocks
# (LayerNormalization, MultiHeadAttention, Conv1D feed-forward, Dropout),
# GlobalAveragePooling1D, an MLP head; Adam(1e-4), sparse categorical crossentropy,
# EarlyStopping(restore_best_weights=True), validation_split=0.2; then evaluate.
def test_timeseries_transformer_classification(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(15)
x_train = rs.normal(size=(203, 50, 1)).astype("float32")
y_train = rs.randint(0, 2, 203)
x_test, y_test = rs.normal(size=(61, 50, 1)).astype("float32"), rs.randint(0, 2, 61)

def transformer_encoder(inputs, head_size, num_heads, ff_dim, dropout=0):
    x = keras.layers.LayerNormalization(epsilon=1e-6)(inputs)
    x = keras.layers.MultiHeadAttention(key_dim=head_size, num_heads=num_heads,
                                        dropout=dropout)(x, x)
    x = keras.layers.Dropout(dropout)(x)
    res = x + inputs
    x = keras.layers.LayerNormalization(epsilon=1e-6)(res)
    x = keras.layers.Conv1D(filters=ff_dim, kernel_size=1, activation="relu")(x)
    x = keras.layers.Dropout(dropout)(x)
    x = keras.layers.Conv1D(filters=inputs.shape[-1], kernel_size=1)(x)
    return x + res

def build_model(input_shape, head_size, num_heads, ff_dim, num_transformer_blocks, mlp_units,
                dropout=0, mlp_dropout=0):
    inputs = keras.Input(shape=input_shape)
    x = inputs
    for _ in range(num_transformer_blocks):
        x = transformer_encoder(x, head_size, num_heads, ff_dim, dropout)
    x = keras.layers.GlobalAveragePooling1D(data_format="channels_last")(x)
    for dim in mlp_units:
        x = keras.layers.Dense(dim, activation="relu")(x)
        x = keras.layers.Dropout(mlp_dropout)(x)
    outputs = keras.layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs, outputs)
""", """
model = build_model(x_train.shape[1:], head_size=16, num_heads=2, ff_dim=4,
                    num_transformer_blocks=2, mlp_units=[32], mlp_dropout=0.4, dropout=0.25)
model.compile(loss="sparse_categorical_crossentropy",
              optimizer=keras.optimizers.Adam(learning_rate=1e-4),
              metrics=["sparse_categorical_accuracy"])
callbacks = [keras.callbacks.EarlyStopping(patience=10, restore_best_weights=True)]
history = model.fit(x_train, y_train, validation_split=0.2, epochs=3, batch_size=64,
                    callbacks=callbacks, shuffle=False, verbose=0)
evaluation = model.evaluate(x_test, y_test, return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    evaluate_equals_cpu_copy(ip, "model", "x_test", "y_test")


# -- Text generation -------------------------------------------------------------------------

# examples/generative/text_generation_with_miniature_gpt.py: a causal mask built with
# keras.ops inside a TransformerBlock, token + position embeddings over a 20,000-word
# vocabulary, a model with two outputs (logits, and the block's output with loss None),
# and a callback that generates after every epoch by calling model.predict on ONE row at a
# time (greedy here, so both runs pick the same tokens). Data: a grain dataset (the
# example's is tf.data), 203 sequences in batches of 32.
def test_miniature_gpt_with_a_generating_callback(ip):
    plain, ours, _ = both(ip, """
import grain
vocab_size, maxlen, embed_dim, num_heads, feed_forward_dim = 20000, 20, 32, 2, 32
rs = np.random.RandomState(16)
tokens = rs.randint(1, vocab_size, (203, maxlen + 1)).astype("int32")
text_ds = grain.MapDataset.source(np.arange(203)).map(
    lambda i: (tokens[i, :-1], tokens[i, 1:])).batch(32)

def causal_attention_mask(batch_size, n_dest, n_src, dtype):
    i = keras.ops.arange(n_dest)[:, None]
    j = keras.ops.arange(n_src)
    m = i >= j - n_src + n_dest
    mask = keras.ops.cast(m, dtype)
    mask = keras.ops.reshape(mask, [1, n_dest, n_src])
    # the example tiles by a tensor of the batch size, which JAX >= 0.7 cannot trace
    return keras.ops.broadcast_to(mask, (batch_size, n_dest, n_src))

class TransformerBlock(keras.layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads, embed_dim)
        self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"),
                                     keras.layers.Dense(embed_dim)])
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs):
        input_shape = keras.ops.shape(inputs)
        batch_size, seq_len = input_shape[0], input_shape[1]
        causal_mask = causal_attention_mask(batch_size, seq_len, seq_len, "bool")
        attention_output = self.att(inputs, inputs, attention_mask=causal_mask)
        out1 = self.layernorm1(inputs + self.dropout1(attention_output))
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1)))

class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)

class TextGenerator(keras.callbacks.Callback):
    def __init__(self, max_tokens, start_tokens):
        super().__init__()
        self.max_tokens, self.start_tokens = max_tokens, start_tokens
        self.generated, self.scores = [], []

    def on_epoch_end(self, epoch, logs=None):
        start_tokens = [t for t in self.start_tokens]
        for _ in range(self.max_tokens):
            pad_len = maxlen - len(start_tokens)
            sample_index = len(start_tokens) - 1
            x = np.array([start_tokens + [0] * pad_len])
            y, _ = self.model.predict(x, verbose=0)
            self.scores.append(y[0][sample_index])
            start_tokens.append(int(np.argmax(y[0][sample_index])))
        self.generated.append(start_tokens)
""", """
inputs = keras.layers.Input(shape=(maxlen,), dtype="int32")
x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
x = TransformerBlock(embed_dim, num_heads, feed_forward_dim)(x)
outputs = keras.layers.Dense(vocab_size)(x)
model = keras.Model(inputs=inputs, outputs=[outputs, x])
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile("adam", loss=[loss_fn, None])
text_gen_callback = TextGenerator(3, [5, 17, 42])
history = model.fit(text_ds, epochs=2, callbacks=[text_gen_callback], verbose=0)
generated, scores = text_gen_callback.generated, text_gen_callback.scores
""")
    same_history(plain, ours)
    assert ours["generated"] == plain["generated"]
    same_values(plain, ours, "scores")


# examples/generative/lstm_character_level_text_generation.py: one-hot (boolean) character
# windows, LSTM(128) and a softmax over the characters, RMSprop(0.01), fit one epoch at a
# time in a Python loop with batch_size=128, and after each epoch a generation loop that
# calls model.predict on a single window per character (greedy here).
def test_character_lstm_fit_in_a_loop_with_one_row_predicts(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(17)
chars, maxlen = [chr(c) for c in range(97, 123)] + [" ", ".", ",", "\\n"], 20
text = "".join(rs.choice(chars, 260))
char_indices = {c: i for i, c in enumerate(chars)}
sentences = [text[i:i + maxlen] for i in range(0, 203)]
next_chars = [text[i + maxlen] for i in range(0, 203)]
x = np.zeros((len(sentences), maxlen, len(chars)), dtype="bool")
y = np.zeros((len(sentences), len(chars)), dtype="bool")
for i, sentence in enumerate(sentences):
    for t, char in enumerate(sentence):
        x[i, t, char_indices[char]] = 1
    y[i, char_indices[next_chars[i]]] = 1
""", """
model = keras.Sequential([keras.Input((maxlen, len(chars))), keras.layers.LSTM(128),
                          keras.layers.Dense(len(chars), activation="softmax")])
model.compile(loss="categorical_crossentropy",
              optimizer=keras.optimizers.RMSprop(learning_rate=0.01))
losses, generated = [], []
for epoch in range(2):
    losses += model.fit(x, y, batch_size=128, epochs=1, shuffle=False, verbose=0).history["loss"]
    sentence = text[:maxlen]
    for i in range(4):
        x_pred = np.zeros((1, maxlen, len(chars)))
        for t, char in enumerate(sentence):
            x_pred[0, t, char_indices[char]] = 1.0
        preds = model.predict(x_pred, verbose=0)[0]
        next_char = chars[int(np.argmax(preds))]
        sentence = sentence[1:] + next_char
        generated.append(preds)
""")
    same_values(plain, ours, "losses")
    same_values(plain, ours, "generated")
    same_weights(plain, ours)


# -- Custom steps written for JAX ------------------------------------------------------------

# guides/custom_train_step_in_jax.py: a train_step(state, data) of its own, a pure function
# of the state: stateless_call, jax.value_and_grad of compute_loss, the optimizer's
# stateless_apply, each metric's stateless_update_state; and the guide's own test_step.
CUSTOM_JAX_STEP = """
import jax
x = np.random.random((203, 32)).astype("float32")
y = np.random.random((203, 1)).astype("float32")

class CustomModel(keras.Model):
    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                 training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        state = (trainable_variables, non_trainable_variables, optimizer_variables,
                 new_metrics_vars)
        return logs, state

    def test_step(self, state, data):
        x, y = data
        trainable_variables, non_trainable_variables, metrics_variables = state
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=False)
        loss = self.compute_loss(x, y, y_pred)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)
"""


def test_the_jax_custom_train_step_guide(ip):
    plain, ours, _ = both(ip, CUSTOM_JAX_STEP, """
inputs = keras.Input(shape=(32,))
outputs = keras.layers.Dense(1)(inputs)
model = CustomModel(inputs, outputs)
model.compile(optimizer="adam", loss="mse", metrics=["mae"])
history = model.fit(x, y, epochs=3, shuffle=False, verbose=0)
evaluation = model.evaluate(x, y, return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    same_weights(plain, ours)


# examples/keras_recipes/trainer_pattern.py: one Trainer class (a keras.Model with its own
# train_step, here the JAX form of the guide above) shared by two models built in an
# EARLIER cell, a Sequential and a functional one, each with Dropout; SGD for one, Adam
# for the other, validation data.
def test_the_trainer_pattern_over_models_from_an_earlier_cell(ip):
    plain, ours, _ = both(ip, """
import jax
x_train = np.random.random((203, 28, 28)).astype("float32")
y_train = np.random.randint(0, 10, 203)
x_test, y_test = x_train[:45], y_train[:45]

class MyTrainer(keras.Model):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def loss_and_updates(self, trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True)
        return self.compute_loss(x, y, y_pred), (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        (loss, (y_pred, non_trainable_variables)), grads = jax.value_and_grad(
            self.loss_and_updates, has_aux=True)(trainable_variables, non_trainable_variables, x, y)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        logs, new_metrics_vars = {}, []
        for metric in self.metrics:
            start = len(new_metrics_vars)
            this = metrics_variables[start:start + len(metric.variables)]
            this = (metric.stateless_update_state(this, loss) if metric.name == "loss"
                    else metric.stateless_update_state(this, y, y_pred))
            logs[metric.name] = metric.stateless_result(this)
            new_metrics_vars += this
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      new_metrics_vars)

    def call(self, x, training=False):
        return self.model(x, training=training)

model_a = keras.models.Sequential([
    keras.Input(shape=(28, 28)),
    keras.layers.Flatten(),
    keras.layers.Dense(256, activation="relu"),
    keras.layers.Dropout(0.2),
    keras.layers.Dense(10, activation="softmax"),
])
func_input = keras.Input(shape=(28, 28, 1))
h = keras.layers.Flatten()(func_input)
h = keras.layers.Dense(512, activation="relu")(h)
h = keras.layers.Dropout(0.4)(h)
func_output = keras.layers.Dense(10, activation="softmax")(h)
model_b = keras.Model(func_input, func_output)
""", """
trainer_1 = MyTrainer(model_a)
trainer_2 = MyTrainer(model_b)
trainer_1.compile(keras.optimizers.SGD(), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
history_1 = trainer_1.fit(x_train, y_train, epochs=2, batch_size=64, shuffle=False, verbose=0,
                          validation_data=(x_test, y_test))
trainer_2.compile(keras.optimizers.Adam(), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
history_2 = trainer_2.fit(x_train, y_train, epochs=2, batch_size=64, shuffle=False, verbose=0,
                          validation_data=(x_test, y_test))
""")
    same_history(plain, ours, "history_1")
    same_history(plain, ours, "history_2")
    same_weights(plain, ours, "model_a")


# -- Sequence to sequence and KerasHub vision ------------------------------------------------

# examples/nlp/neural_machine_translation_with_transformer.py: a PositionalEmbedding whose
# compute_mask hides padding, a TransformerEncoder and a TransformerDecoder (causal
# self-attention, then attention over the encoder's output, both with the padding masks),
# two named inputs, a 15,000-token vocabulary, rmsprop and a SparseCategoricalCrossentropy
# that ignores the padding class 0; fit with validation data, then predict the next-token
# distribution for 5 sentence pairs.
def test_translation_transformer_with_padding_masks(ip):
    plain, ours, _ = both(ip, """
vocab_size, sequence_length, embed_dim, latent_dim, num_heads = 15000, 12, 32, 64, 2
rs = np.random.RandomState(18)
def sentences(n):
    ids = rs.randint(3, vocab_size, (n, sequence_length + 1))
    lengths = rs.randint(4, sequence_length + 1, n)
    ids[np.arange(sequence_length + 1)[None, :] > lengths[:, None]] = 0
    return ids.astype("int32")
source, target = sentences(203), sentences(203)
train_x = {"encoder_inputs": source[:171, :-1], "decoder_inputs": target[:171, :-1]}
train_y = target[:171, 1:]
val_x = {"encoder_inputs": source[171:, :-1], "decoder_inputs": target[171:, :-1]}
val_y = target[171:, 1:]

class TransformerEncoder(keras.layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([keras.layers.Dense(dense_dim, activation="relu"),
                                            keras.layers.Dense(embed_dim)])
        self.layernorm_1 = keras.layers.LayerNormalization()
        self.layernorm_2 = keras.layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = None if mask is None else keras.ops.cast(mask[:, None, :], "int32")
        attention_output = self.attention(query=inputs, value=inputs, key=inputs,
                                          attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        return self.layernorm_2(proj_input + self.dense_proj(proj_input))

class PositionalEmbedding(keras.layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = keras.layers.Embedding(input_dim=sequence_length,
                                                          output_dim=embed_dim)

    def call(self, inputs):
        positions = keras.ops.arange(0, keras.ops.shape(inputs)[-1], 1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return keras.ops.not_equal(inputs, 0)

class TransformerDecoder(keras.layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention_1 = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([keras.layers.Dense(latent_dim, activation="relu"),
                                            keras.layers.Dense(embed_dim)])
        self.layernorm_1 = keras.layers.LayerNormalization()
        self.layernorm_2 = keras.layers.LayerNormalization()
        self.layernorm_3 = keras.layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        inputs, encoder_outputs = inputs
        causal_mask = self.get_causal_attention_mask(inputs)
        if mask is None:
            inputs_padding_mask, encoder_outputs_padding_mask = None, None
        else:
            inputs_padding_mask, encoder_outputs_padding_mask = mask
        attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs,
                                              attention_mask=causal_mask,
                                              query_mask=inputs_padding_mask)
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(query=out_1, value=encoder_outputs,
                                              key=encoder_outputs,
                                              query_mask=inputs_padding_mask,
                                              key_mask=encoder_outputs_padding_mask)
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        return self.layernorm_3(out_2 + self.dense_proj(out_2))

    def get_causal_attention_mask(self, inputs):
        input_shape = keras.ops.shape(inputs)
        batch_size, sequence_length = input_shape[0], input_shape[1]
        i = keras.ops.arange(sequence_length)[:, None]
        j = keras.ops.arange(sequence_length)
        mask = keras.ops.cast(i >= j, dtype="int32")
        mask = keras.ops.reshape(mask, (1, input_shape[1], input_shape[1]))
        return keras.ops.broadcast_to(mask, (batch_size, sequence_length, sequence_length))
""", """
encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(encoder_inputs)
encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)
decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(decoder_inputs)
x = TransformerDecoder(embed_dim, latent_dim, num_heads)([x, encoder_outputs])
x = keras.layers.Dropout(0.5)(x)
decoder_outputs = keras.layers.Dense(vocab_size, activation="softmax")(x)
transformer = keras.Model({"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs},
                          decoder_outputs, name="transformer")
transformer.compile("rmsprop", loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0),
                    metrics=["accuracy"])
history = transformer.fit(train_x, train_y, validation_data=(val_x, val_y), batch_size=64,
                          epochs=2, shuffle=False, verbose=0)
next_tokens = transformer.predict({k: v[:5] for k, v in val_x.items()}, verbose=0)
""")
    same_history(plain, ours)
    assert ours["next_tokens"].shape == (5, 12, 15000)
    same_values(plain, ours, "next_tokens")


# guides/keras_hub/classification_with_keras_hub.py: fine-tune a KerasHub image classifier
# (a ViT backbone built from a tiny config here, random weights, preprocessor=None) with
# SparseCategoricalCrossentropy(from_logits=True), a small Adam learning rate and
# accuracy, on grain datasets of images (KerasHub tasks take no generator), then predict.
def test_kerashub_vit_image_classifier_on_grain_datasets(ip):
    plain, ours, _ = both(ip, """
import grain, keras_hub
rs = np.random.RandomState(19)
images = rs.random((248, 32, 32, 3)).astype("float32")
labels = rs.randint(0, 5, 248)
def batches(start, stop, batch_size=32):
    return grain.MapDataset.source(np.arange(start, stop)).map(
        lambda i: (images[i], labels[i])).batch(batch_size)
""", """
backbone = keras_hub.models.ViTBackbone(image_shape=(32, 32, 3), patch_size=8, num_layers=2,
                                        num_heads=2, hidden_dim=32, mlp_dim=64)
image_classifier = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=5,
                                                       preprocessor=None)
image_classifier.compile(optimizer=keras.optimizers.Adam(1e-4),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         metrics=["accuracy"])
history = image_classifier.fit(batches(0, 203), validation_data=batches(203, 248), epochs=2,
                               verbose=0)
scores = image_classifier.predict(images[:13], verbose=0)
""")
    same_history(plain, ours)
    assert ours["scores"].shape == (13, 5)
    same_values(plain, ours, "scores")
