"""Published Keras code on JAX, 8 simulated devices beside one: timeseries and text generation.

How they are written and compared: this folder's conftest.py.
"""

from support.same import both, evaluate_equals_cpu_copy, same_history, same_values, same_weights


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
