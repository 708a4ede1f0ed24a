"""The cells of the step-form tests (issue 58): models whose step runs as micro-batches or
with its blocks rematerialized, each beside plain Keras at the full batch. Used on 8
devices (tests/jax_backend/test_step_forms_jax.py) and on one
(tests/support/step_forms_run.py)."""

# a CNN with sample weights and a weight regularizer; 203 = 3 x 64 + 11: the short last
# batch, which 4 micro-batches of 16 rows do not divide, runs whole
CNN_DATA = """
rs = np.random.RandomState(0)
images = rs.rand(203, 12, 12, 1).astype("float32")
labels = rs.randint(0, 4, 203)
weights = rs.rand(203).astype("float32")
"""
CNN = """
keras.utils.set_random_seed(2)
model = keras.Sequential([
    keras.Input((12, 12, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
    keras.layers.MaxPooling2D(), keras.layers.Flatten(),
    keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
    keras.layers.Dense(4, activation="softmax")])
model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy",
              metrics=["accuracy"], weighted_metrics=["accuracy"])
history = model.fit(images, labels, sample_weight=weights, batch_size=64, epochs=2,
                    shuffle=False, verbose=0)
iterations = int(model.optimizer.iterations)
"""

# a masked sequence model: padding tokens (0) masked by the embedding, a per-token loss that
# Keras divides by the batch's true tokens
SEQUENCE_DATA = """
rs = np.random.RandomState(1)
lengths = rs.randint(3, 13, 96)
tokens = np.where(np.arange(12)[None, :] < lengths[:, None], rs.randint(1, 50, (96, 12)), 0)
targets = np.roll(tokens, -1, axis=1) % 7
"""
SEQUENCE = """
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((12,), dtype="int32"),
                          keras.layers.Embedding(50, 16, mask_zero=True),
                          keras.layers.GRU(16, return_sequences=True),
                          keras.layers.Dense(7)])
model.compile(keras.optimizers.Adam(1e-2),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(tokens, targets, batch_size=32, epochs=2, shuffle=False, verbose=0)
"""

# a KerasHub causal LM with LoRA, from a small config (no download)
GEMMA_DATA = """
import keras_hub
rs = np.random.RandomState(4)
ids = rs.randint(1, 512, (32, 17))
x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((32, 16), bool)}
y = ids[:, 1:]
"""
GEMMA = """
keras.utils.set_random_seed(5)
backbone = keras_hub.models.GemmaBackbone(vocabulary_size=512, num_layers=2,
    num_query_heads=4, num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=8)
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
backbone.enable_lora(rank=4)
lm.compile(optimizer=keras.optimizers.Adam(1e-2),
           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
           weighted_metrics=["accuracy"])
history = lm.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
"""

# (data, cell, the flag that sets the form, the model's name) of each one-device comparison
ONE_DEVICE = {
    "cnn with sample weights, 4 micro-batches": (CNN_DATA, CNN, "--microbatches 4", "model"),
    "masked sequence, 4 micro-batches": (SEQUENCE_DATA, SEQUENCE, "--microbatches 4", "model"),
    "causal LM with LoRA, 2 micro-batches": (GEMMA_DATA, GEMMA, "--microbatches 2", "lm"),
    "causal LM with LoRA, blocks rematerialized": (GEMMA_DATA, GEMMA, "--remat on", "lm"),
}
