"""Published Keras code on JAX, 8 simulated devices beside one: custom JAX steps, seq2seq.

How they are written and compared: this folder's conftest.py.
"""

from support.same import both, same_history, same_values, same_weights


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
