"""Published Keras code through `%%tpu_train` on 8 simulated replicas, side by side with plain
Keras on one device.

Each test is one keras-io example or Keras guide, named by its path in keras-team/keras-io:
the same layers, arguments, compile and fit calls, written here in our own words (the
workplace keeps other projects' code out of this repository), with small synthetic data of
the same shapes in place of the download, and sample counts that are not multiples of 8.
The same cells run plainly in a namespace of their own (one device, no tpu_magic) and
through the magic. Checked: no error where Keras has none, the same history keys, the same
`predict` row counts, `evaluate` equal to the `%tpu_sync` CPU copy's (1e-5), and, where the
model has no Dropout/BatchNorm (whose training-mode outputs differ from inference), `fit`'s
history at learning rate 0 equal to `evaluate` on the same data.
"""

import numpy as np
import pytest
from IPython.core.error import UsageError

import keras
from support.same import (both, evaluate_equals_cpu_copy, fit_equals_evaluate_at_lr0, imports,
                          same_history_keys)

KERAS_FIT = keras.Model.fit  # what Keras had before any cell


# examples/vision/mnist_convnet.py: Conv2D/MaxPooling/Dropout, one-hot targets, validation_split.
MNIST_SETUP = """
num_classes = 10
input_shape = (28, 28, 1)
x_train = np.random.rand(203, 28, 28, 1).astype("float32")
y_train = keras.utils.to_categorical(np.random.randint(0, 10, 203), num_classes)
x_test, y_test = x_train[:37], y_train[:37]
"""
MNIST_CELL = """
model = keras.Sequential(
    [
        keras.Input(shape=input_shape),
        keras.layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(num_classes, activation="softmax"),
    ]
)
batch_size = 64
epochs = 1
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.1)
score = model.evaluate(x_test, y_test, verbose=0)
"""


def test_mnist_convnet(sim8):
    plain, ours, report = both(sim8, MNIST_SETUP, MNIST_CELL)
    same_history_keys(plain, ours)
    assert len(ours["score"]) == len(plain["score"]) == 2
    evaluate_equals_cpu_copy(sim8, "model", "x_test", "y_test")


# examples/structured_data/imbalanced_classification.py: class_weight, count metrics,
# ModelCheckpoint, validation_data.
FRAUD_SETUP = """
rng = np.random.default_rng(0)
train_features = rng.standard_normal((803, 30)).astype("float32")
train_targets = (rng.random((803, 1)) < 0.1).astype("uint8")
val_features = rng.standard_normal((201, 30)).astype("float32")
val_targets = (rng.random((201, 1)) < 0.1).astype("uint8")
counts = np.bincount(train_targets[:, 0])
weight_for_0 = 1.0 / counts[0]
weight_for_1 = 1.0 / counts[1]
"""
FRAUD_CELL = """
model = keras.Sequential(
    [
        keras.Input(shape=train_features.shape[1:]),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(1, activation="sigmoid"),
    ]
)
metrics = [
    keras.metrics.FalseNegatives(name="fn"),
    keras.metrics.FalsePositives(name="fp"),
    keras.metrics.TrueNegatives(name="tn"),
    keras.metrics.TruePositives(name="tp"),
    keras.metrics.Precision(name="precision"),
    keras.metrics.Recall(name="recall"),
]
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics)
callbacks = [keras.callbacks.ModelCheckpoint(checkpoint_dir + "/fraud_model_at_epoch_{epoch}.keras")]
class_weight = {0: weight_for_0, 1: weight_for_1}
history = model.fit(
    train_features,
    train_targets,
    batch_size=256,
    epochs=2,
    verbose=0,
    callbacks=callbacks,
    validation_data=(val_features, val_targets),
    class_weight=class_weight,
)
"""


def test_imbalanced_classification_with_class_weight_and_counts(sim8, tmp_path):
    setup = FRAUD_SETUP + f"checkpoint_dir = {str(tmp_path)!r}\n"
    plain, ours, report = both(sim8, setup, FRAUD_CELL)
    same_history_keys(plain, ours)
    history = ours["history"].history
    for prefix, samples in (("", 803), ("val_", 201)):
        counts = [history[prefix + k][-1] for k in ("fn", "fp", "tn", "tp")]
        assert all(float(c).is_integer() for c in counts), counts
        assert sum(counts) == samples
    assert (tmp_path / "fraud_model_at_epoch_2.keras").exists()
    evaluate_equals_cpu_copy(sim8, "model", "val_features", "val_targets")


# examples/nlp/lstm_seq2seq.py: two inputs (encoder, decoder), LSTM states, per-timestep
# one-hot targets, validation_split.
SEQ2SEQ_SETUP = """
num_samples, max_encoder_seq_length, max_decoder_seq_length = 61, 9, 7
num_encoder_tokens, num_decoder_tokens, latent_dim = 12, 11, 16
rng = np.random.default_rng(1)
encoder_input_data = np.eye(num_encoder_tokens, dtype="float32")[
    rng.integers(0, num_encoder_tokens, (num_samples, max_encoder_seq_length))]
decoder_input_data = np.eye(num_decoder_tokens, dtype="float32")[
    rng.integers(0, num_decoder_tokens, (num_samples, max_decoder_seq_length))]
decoder_target_data = np.concatenate(
    [decoder_input_data[:, 1:], np.zeros((num_samples, 1, num_decoder_tokens), "float32")], 1)
"""
SEQ2SEQ_CELL = """
encoder_inputs = keras.Input(shape=(None, num_encoder_tokens))
encoder = keras.layers.LSTM(latent_dim, return_state=True)
encoder_outputs, state_h, state_c = encoder(encoder_inputs)
encoder_states = [state_h, state_c]
decoder_inputs = keras.Input(shape=(None, num_decoder_tokens))
decoder_lstm = keras.layers.LSTM(latent_dim, return_sequences=True, return_state=True)
decoder_outputs, _, _ = decoder_lstm(decoder_inputs, initial_state=encoder_states)
decoder_dense = keras.layers.Dense(num_decoder_tokens, activation="softmax")
decoder_outputs = decoder_dense(decoder_outputs)
model = keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)
model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
history = model.fit(
    [encoder_input_data, decoder_input_data],
    decoder_target_data,
    batch_size=16,
    epochs=1,
    validation_split=0.2,
)
predicted = model.predict([encoder_input_data[:5], decoder_input_data[:5]])
"""


def test_lstm_seq2seq_two_inputs_per_timestep_targets(sim8):
    plain, ours, report = both(sim8, SEQ2SEQ_SETUP, SEQ2SEQ_CELL)
    same_history_keys(plain, ours)
    assert ours["predicted"].shape == plain["predicted"].shape == (5, 7, 11)
    evaluate_equals_cpu_copy(sim8, "model", "[encoder_input_data, decoder_input_data]",
                             "decoder_target_data")
    fit_equals_evaluate_at_lr0(sim8, "model", "[encoder_input_data, decoder_input_data]",
                               "decoder_target_data", 16)


# examples/generative/vae.py: a Sampling layer, a subclassed VAE with its own train_step and
# loss trackers, fit(x) without targets.
VAE_SETUP = """
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


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = keras.ops.mean(keras.ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
            kl_loss = keras.ops.mean(keras.ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


mnist_digits = np.random.rand(203, 28, 28, 1).astype("float32")
latent_dim = 2
"""
VAE_CELL = """
encoder_inputs = keras.Input(shape=(28, 28, 1))
x = keras.layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
x = keras.layers.Flatten()(x)
x = keras.layers.Dense(16, activation="relu")(x)
z_mean = keras.layers.Dense(latent_dim, name="z_mean")(x)
z_log_var = keras.layers.Dense(latent_dim, name="z_log_var")(x)
z = Sampling()([z_mean, z_log_var])
encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
latent_inputs = keras.Input(shape=(latent_dim,))
x = keras.layers.Dense(14 * 14 * 8, activation="relu")(latent_inputs)
x = keras.layers.Reshape((14, 14, 8))(x)
decoder_outputs = keras.layers.Conv2DTranspose(1, 3, activation="sigmoid", strides=2,
                                               padding="same")(x)
decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
vae = VAE(encoder, decoder)
vae.compile(optimizer=keras.optimizers.Adam())
history = vae.fit(mnist_digits, epochs=2, batch_size=64)
"""


def test_vae_with_its_own_train_step_and_no_targets(sim8):
    plain, ours, report = both(sim8, VAE_SETUP, VAE_CELL)
    same_history_keys(plain, ours)
    assert all(np.isfinite(v).all() for v in ours["history"].history.values())
    # Its loss ignores sample weights: whole batches of real samples only, said once.
    assert report.left_out == {"fit": 203 - 3 * 64}
    assert sum("train_step" in note for note in report.notes) == 1


# examples/nlp/text_classification_with_transformer.py: notebook layers whose __init__ takes
# no **kwargs, the model built in an earlier plain cell, validation_data.
TRANSFORMER_SETUP = """
class TransformerBlock(keras.layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = keras.ops.shape(x)[-1]
        positions = keras.ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


vocab_size, maxlen = 200, 20
x_train = np.random.randint(0, vocab_size, (203, maxlen))
y_train = np.random.randint(0, 2, 203)
x_val, y_val = x_train[:45], y_train[:45]
embed_dim, num_heads, ff_dim = 16, 2, 16
inputs = keras.layers.Input(shape=(maxlen,))
embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
x = embedding_layer(inputs)
transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
x = transformer_block(x)
x = keras.layers.GlobalAveragePooling1D()(x)
x = keras.layers.Dropout(0.1)(x)
x = keras.layers.Dense(20, activation="relu")(x)
x = keras.layers.Dropout(0.1)(x)
outputs = keras.layers.Dense(2, activation="softmax")(x)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
"""
TRANSFORMER_CELL = """
history = model.fit(x_train, y_train, batch_size=32, epochs=1, validation_data=(x_val, y_val))
"""


def test_transformer_with_notebook_layers_built_in_an_earlier_cell(sim8):
    plain, ours, report = both(sim8, TRANSFORMER_SETUP, TRANSFORMER_CELL)
    assert report.rewrapped == ("model",)
    same_history_keys(plain, ours)
    evaluate_equals_cpu_copy(sim8, "model", "x_val", "y_val")


# examples/nlp/text_classification_from_scratch.py: TextVectorization mapped over tf.data
# for training; the end-to-end model that takes strings.
TEXT_SETUP = """
words = np.array(["good", "bad", "movie", "plot", "great", "awful", "actor", "scene"])
rng = np.random.default_rng(3)
texts = np.array([" ".join(rng.choice(words, 12)) for _ in range(203)])
labels = rng.integers(0, 2, 203).astype("int32")
raw_train_ds = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(200)
max_features, embedding_dim, sequence_length = 50, 16, 12
vectorize_layer = keras.layers.TextVectorization(
    max_tokens=max_features, output_mode="int", output_sequence_length=sequence_length)
vectorize_layer.adapt(raw_train_ds.map(lambda x, y: x))

def vectorize_text(text, label):
    text = tf.expand_dims(text, -1)
    return vectorize_layer(text), label

train_ds = raw_train_ds.map(vectorize_text)
"""
TEXT_CELL = """
inputs = keras.Input(shape=(None,), dtype="int64")
x = keras.layers.Embedding(max_features, embedding_dim)(inputs)
x = keras.layers.Conv1D(16, 3, padding="valid", activation="relu", strides=1)(x)
x = keras.layers.GlobalMaxPooling1D()(x)
predictions = keras.layers.Dense(1, activation="sigmoid", name="predictions")(x)
model = keras.Model(inputs, predictions)
model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(train_ds, epochs=1)
"""


def test_text_classification_with_vectorization_in_tf_data(sim8, capsys):
    plain, ours, report = both(sim8, TEXT_SETUP, TEXT_CELL)
    same_history_keys(plain, ours)
    # The dataset's batch of 200 is 25 per replica: the same TPU advice as for NumPy inputs.
    assert any("25 samples per replica (the dataset's batch 200 / 8)" in n for n in report.notes)


def test_a_model_that_takes_strings_is_refused_before_training(sim8):
    sim8.run_cell(imports() + TEXT_SETUP + TEXT_CELL.replace("history = model.fit(train_ds, epochs=1)", ""))
    sim8.run_cell("""
text_input = keras.Input(shape=(1,), dtype="string")
end_to_end = keras.Model(text_input, model(vectorize_layer(text_input)))
end_to_end.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
before = [w.copy() for w in model.get_weights()]
""")
    with pytest.raises(UsageError, match=r"(?s)end_to_end.*strings.*dataset\.map"):
        sim8.run_cell_magic("tpu_train", "--no-progress",
                            "end_to_end.fit(texts[:, None], labels, batch_size=64)")
    for got, want in zip(sim8.user_ns["model"].get_weights(), sim8.user_ns["before"]):
        np.testing.assert_array_equal(got, want)


# examples/timeseries/timeseries_classification_from_scratch.py: Conv1D + BatchNorm and the
# three callbacks ModelCheckpoint, ReduceLROnPlateau, EarlyStopping; validation_split.
TIMESERIES_SETUP = """
x_train = np.random.standard_normal((203, 50, 1)).astype("float32")
y_train = np.random.randint(0, 2, 203)
num_classes = 2
"""
TIMESERIES_CELL = """
input_layer = keras.layers.Input(x_train.shape[1:])
conv1 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(input_layer)
conv1 = keras.layers.BatchNormalization()(conv1)
conv1 = keras.layers.ReLU()(conv1)
gap = keras.layers.GlobalAveragePooling1D()(conv1)
output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)
model = keras.models.Model(inputs=input_layer, outputs=output_layer)
epochs = 3
batch_size = 32
callbacks = [
    keras.callbacks.ModelCheckpoint(checkpoint_path, save_best_only=True, monitor="val_loss"),
    keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_lr=0.0001),
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, verbose=1),
]
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
              metrics=["sparse_categorical_accuracy"])
history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
                    validation_split=0.2, verbose=1)
"""


def test_timeseries_classification_with_three_callbacks(sim8, tmp_path):
    setup = TIMESERIES_SETUP + f"checkpoint_path = {str(tmp_path / 'best_model.keras')!r}\n"
    plain, ours, report = both(sim8, setup, TIMESERIES_CELL)
    same_history_keys(plain, ours)
    assert (tmp_path / "best_model.keras").exists()
    evaluate_equals_cpu_copy(sim8, "model", "x_train[:45]", "y_train[:45]", atol=1e-4)


# guides/functional_api.py, "Models with multiple inputs and outputs": dict inputs, dict
# targets, per-output losses and loss weights.
TICKETS_SETUP = """
num_tags, num_words, num_departments = 12, 100, 4
title_data = np.random.randint(num_words, size=(203, 10))
body_data = np.random.randint(num_words, size=(203, 30))
tags_data = np.random.randint(2, size=(203, num_tags)).astype("float32")
priority_targets = np.random.random(size=(203, 1))
dept_targets = np.random.randint(2, size=(203, num_departments))
"""
TICKETS_CELL = """
title_input = keras.Input(shape=(None,), name="title")
body_input = keras.Input(shape=(None,), name="body")
tags_input = keras.Input(shape=(num_tags,), name="tags")
title_features = keras.layers.Embedding(num_words, 16)(title_input)
body_features = keras.layers.Embedding(num_words, 16)(body_input)
title_features = keras.layers.LSTM(8)(title_features)
body_features = keras.layers.LSTM(8)(body_features)
x = keras.layers.concatenate([title_features, body_features, tags_input])
priority_pred = keras.layers.Dense(1, name="priority")(x)
department_pred = keras.layers.Dense(num_departments, name="department")(x)
model = keras.Model(inputs=[title_input, body_input, tags_input],
                    outputs={"priority": priority_pred, "department": department_pred})
model.compile(
    optimizer=keras.optimizers.RMSprop(1e-3),
    loss={
        "priority": keras.losses.BinaryCrossentropy(from_logits=True),
        "department": keras.losses.CategoricalCrossentropy(from_logits=True),
    },
    loss_weights={"priority": 1.0, "department": 0.2},
)
history = model.fit(
    {"title": title_data, "body": body_data, "tags": tags_data},
    {"priority": priority_targets, "department": dept_targets},
    epochs=1,
    batch_size=32,
)
"""


def test_functional_api_multiple_inputs_and_outputs(sim8):
    plain, ours, report = both(sim8, TICKETS_SETUP, TICKETS_CELL)
    same_history_keys(plain, ours)
    inputs = '{"title": title_data, "body": body_data, "tags": tags_data}'
    targets = '{"priority": priority_targets, "department": dept_targets}'
    evaluate_equals_cpu_copy(sim8, "model", inputs, targets)
    fit_equals_evaluate_at_lr0(sim8, "model", inputs, targets, 32)


# examples/vision/autoencoder.py: a convolutional denoising autoencoder, fit(x, x) with
# image targets.
AUTOENCODER_SETUP = """
train_data = np.random.rand(101, 28, 28, 1).astype("float32")
noisy_train_data = np.clip(train_data + 0.4 * np.random.normal(size=train_data.shape), 0, 1)
"""
AUTOENCODER_CELL = """
input = keras.layers.Input(shape=(28, 28, 1))
x = keras.layers.Conv2D(8, (3, 3), activation="relu", padding="same")(input)
x = keras.layers.MaxPooling2D((2, 2), padding="same")(x)
x = keras.layers.Conv2DTranspose(8, (3, 3), strides=2, activation="relu", padding="same")(x)
x = keras.layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
autoencoder = keras.Model(input, x)
autoencoder.compile(optimizer="adam", loss="binary_crossentropy")
history = autoencoder.fit(
    x=noisy_train_data,
    y=train_data,
    epochs=1,
    batch_size=32,
    shuffle=True,
    validation_data=(noisy_train_data[:21], train_data[:21]),
)
predictions = autoencoder.predict(noisy_train_data[:3])
"""


def test_denoising_autoencoder_with_image_targets(sim8):
    plain, ours, report = both(sim8, AUTOENCODER_SETUP, AUTOENCODER_CELL)
    same_history_keys(plain, ours)
    assert ours["predictions"].shape == plain["predictions"].shape == (3, 28, 28, 1)
    evaluate_equals_cpu_copy(sim8, "autoencoder", "noisy_train_data", "train_data")
    fit_equals_evaluate_at_lr0(sim8, "autoencoder", "noisy_train_data", "train_data", 32)


# examples/nlp/bidirectional_lstm_imdb.py: Embedding + two Bidirectional LSTMs.
IMDB_SETUP = """
max_features, maxlen = 200, 40
x_train = np.random.randint(1, max_features, (203, maxlen))
y_train = np.random.randint(0, 2, 203)
x_val, y_val = x_train[:37], y_train[:37]
"""
IMDB_CELL = """
inputs = keras.Input(shape=(None,), dtype="int32")
x = keras.layers.Embedding(max_features, 16)(inputs)
x = keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True))(x)
x = keras.layers.Bidirectional(keras.layers.LSTM(8))(x)
outputs = keras.layers.Dense(1, activation="sigmoid")(x)
model = keras.Model(inputs, outputs)
model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
history = model.fit(x_train, y_train, batch_size=32, epochs=1, validation_data=(x_val, y_val))
"""


def test_bidirectional_lstm_imdb(sim8):
    plain, ours, report = both(sim8, IMDB_SETUP, IMDB_CELL)
    same_history_keys(plain, ours)
    evaluate_equals_cpu_copy(sim8, "model", "x_val", "y_val")
    fit_equals_evaluate_at_lr0(sim8, "model", "x_train", "y_train", 32)


def test_a_trained_model_predicts_any_count_in_a_later_plain_cell(sim8):
    """The seeds' workflow: train in a %%tpu_train cell, then predict in the next plain cell."""
    plain, ours, report = both(sim8, MNIST_SETUP, MNIST_CELL)
    sim8.run_cell("seven = model.predict(x_test[:7], verbose=0)\n"
                  "thirteen = model.evaluate(x_test[:13], y_test[:13], verbose=0)")
    assert sim8.user_ns["seven"].shape == (7, 10)
    # A model tpu_magic never touched keeps plain Keras (no routing, no padding).
    sim8.run_cell("untouched = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
                  "untouched_rows = untouched.predict(np.zeros((5, 3)), verbose=0)")
    assert "fit" not in sim8.user_ns["untouched"].__dict__
    assert "fit" in sim8.user_ns["model"].__dict__
    assert keras.Model.fit is KERAS_FIT and "fit" not in keras.Model.__dict__


def test_a_notebook_layer_that_cannot_be_rebuilt_is_a_usage_error_naming_it(sim8):
    sim8.run_cell(imports() + """
class Scaled(keras.layers.Layer):
    def __init__(self, units, scale_fn):
        super().__init__()
        self.dense = keras.layers.Dense(units)
        self.scale_fn = scale_fn

    def call(self, x):
        return self.scale_fn(self.dense(x))


inputs = keras.Input((4,))
my_model = keras.Model(inputs, Scaled(3, scale_fn=lambda t: t * 2.0)(inputs))
my_model.compile("adam", "mse")
before = [w.copy() for w in my_model.get_weights()]
""")
    with pytest.raises(UsageError) as error:
        sim8.run_cell_magic("tpu_train", "--no-progress",
                            "my_model.fit(np.zeros((16, 4)), np.zeros((16, 3)), verbose=0)")
    message = str(error.value)
    assert "'my_model'" in message and "Scaled" in message and "get_config()" in message
    assert "functional" not in message
    for got, want in zip(sim8.user_ns["my_model"].get_weights(), sim8.user_ns["before"]):
        np.testing.assert_array_equal(got, want)


# The TensorFlow TPU guide's Keras example (tensorflow.org/guide/tpu, "Train a model using
# Keras high-level APIs"): a Conv2D model with L2 regularizers, tf.data datasets batched by
# 200, sparse categorical cross-entropy from logits. Here the dataset is finite, not
# repeated, and 203 samples leave a last batch of 3.
TPU_GUIDE_SETUP = """
images = np.random.rand(203, 28, 28, 1).astype("float32")
labels = np.random.randint(0, 10, 203)

def create_model():
    regularizer = keras.regularizers.L2(1e-5)
    return keras.Sequential(
        [keras.layers.Conv2D(8, 3, input_shape=(28, 28, 1), activation="relu",
                             kernel_regularizer=regularizer),
         keras.layers.Flatten(),
         keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer),
         keras.layers.Dense(10, kernel_regularizer=regularizer)])

def get_dataset(batch_size, is_training=True):
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))
    if is_training:
        dataset = dataset.shuffle(203, seed=1)
    return dataset.batch(batch_size)
"""
TPU_GUIDE_CELL = """
model = create_model()
model.compile(optimizer="adam",
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["sparse_categorical_accuracy"])
batch_size = 200
train_dataset = get_dataset(batch_size, is_training=True)
test_dataset = get_dataset(batch_size, is_training=False)
history = model.fit(train_dataset, epochs=2, validation_data=test_dataset)
"""


def test_tpu_guide_keras_example_with_a_partial_last_dataset_batch(sim8):
    plain, ours, report = both(sim8, TPU_GUIDE_SETUP, TPU_GUIDE_CELL)
    same_history_keys(plain, ours)
    assert report.steps == 4  # 2 epochs of 2 batches (200 + the 3 left, padded)
    # The dataset's last batch of 3 counts by its 3 samples: fit at lr 0 equals evaluate.
    sim8.run_cell("model.optimizer.learning_rate = 0.0\n"
                  "h0 = model.fit(test_dataset, epochs=1, verbose=0)\n"
                  "e0 = model.evaluate(test_dataset, return_dict=True, verbose=0)")
    for key, value in sim8.user_ns["e0"].items():
        assert sim8.user_ns["h0"].history[key][0] == pytest.approx(value, abs=1e-5), key
    evaluate_equals_cpu_copy(sim8, "model", "images", "labels")


def test_an_unseeded_dataset_shuffle_feeds_every_replica_a_part_of_one_batch(sim8):
    """An unseeded shuffle runs once, in the one host pipeline whose batches are cut into
    the replicas' parts, so every replica's rows come from the same global batch: a fit at
    learning rate 0 sees each sample once, and its loss is evaluate's. (Had each replica
    shuffled its own way, samples would be seen twice or never.)"""
    sim8.run_cell(imports() + TPU_GUIDE_SETUP + """
tf.random.set_seed(None)
unseeded = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(203).batch(200)
model = create_model()
model.compile(optimizer=keras.optimizers.Adam(0.0),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["sparse_categorical_accuracy"])
""")
    report = sim8.run_cell_magic(
        "tpu_train", "--no-progress",
        "h0 = model.fit(unseeded, epochs=1, verbose=0)\n"
        "e0 = model.evaluate(unseeded, return_dict=True, verbose=0)")
    assert not any("seed" in note for note in report.notes)
    assert report.steps == 2  # 200 and the 3 left, padded
    for key, value in sim8.user_ns["e0"].items():
        assert sim8.user_ns["h0"].history[key][0] == pytest.approx(value, abs=1e-5), key
