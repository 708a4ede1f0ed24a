"""Published Keras code on JAX, 8 simulated devices beside one: KerasHub fine-tuning.

How they are written and compared: this folder's conftest.py.
"""

from support.same import both, evaluate_equals_cpu_copy, run_cell, same_history, same_values


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


# The Gemma LoRA guide ("Fine-tune Gemma models in Keras using LoRA", as run on Kaggle's and
# Colab's TPUs), tried as a new user would where its step does not fit a chip (issue 58):
# enable_lora(rank=4), AdamW at 5e-5 with a weight decay of 0.01 that leaves out biases and
# scales, a from-logits loss and a weighted SparseCategoricalAccuracy; here fed token ids
# (no downloads), 37 sequences in batches of 16 (the last of 5), a third of them padded.
# The chip is rehearsed with a device-memory limit under the data-parallel step's plan: the
# magic plans micro-batches and trains; plain Keras runs the full batch with no limit.
LORA_GUIDE = """
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
    hidden_dim=32, intermediate_dim=64, head_dim=16)
gemma_lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
gemma_lm.backbone.enable_lora(rank=4)
optimizer = keras.optimizers.AdamW(learning_rate=5e-5, weight_decay=0.01)
optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
gemma_lm.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 optimizer=optimizer, weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
history = gemma_lm.fit(features, labels, batch_size=16, epochs=2, verbose=0)
"""


def test_the_gemma_lora_guide_where_its_step_does_not_fit_a_chip(ip, monkeypatch):
    from support.cells import train
    from support.same import imports, same_weights

    run_cell(ip, imports() + TOKENS)
    written = train(ip, LORA_GUIDE)
    planned = float(written.memory_plan.split("memory plan: ")[1].split()[0])
    monkeypatch.setenv("TPU_MAGIC_DEVICE_MEMORY_BYTES", str(int(0.8 * planned * 2**30)))
    plain, ours, report = both(ip, TOKENS, LORA_GUIDE)
    assert "micro-batches" in report.memory_plan and "is more than 90 %" in \
        report.memory_plan, report.memory_plan
    same_history(plain, ours)
    same_weights(plain, ours, "gemma_lm", atol=1e-6)
