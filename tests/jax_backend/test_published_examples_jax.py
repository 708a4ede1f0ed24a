"""Published Keras code the other suites do not run, on Keras's JAX backend: keras-io examples
(guides and docstrings: test_published_guides_jax.py), each written in our own words on
small synthetic data of the example's shapes, run plainly on one device and through
`%%tpu_train` on 8 simulated devices from the same seed (`support.same.both`). What they must share is what plain Keras makes
deterministic: the history (`shuffle=False`), the weights, predictions and evaluations.

Each test names its source above it (a path in keras-team/keras-io, a Keras or KerasHub class
whose docstring it follows).
"""

import numpy as np
import pytest

from support.same import both, same_history, same_values, same_weights

# Models with a bias before a BatchNormalization, trained with Adam: that bias's gradient is
# float noise (BatchNorm subtracts it again), which Adam scales up to a full step, differently
# on any two devices; the moving mean carries it into inference. Their weights are not
# compared, and their predictions within this (a replica factor or a padded row is far more).
NOISY_BIAS = dict(rel=2e-3, abs=1e-4)


# examples/nlp/multi_label_classification.py: multi-hot term vectors to multi-hot labels, an
# MLP with sigmoid outputs, binary crossentropy and binary accuracy; then evaluate.
def test_multi_label_classification_of_multi_hot_terms(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(1)
terms = (rs.rand(203, 120) < 0.05).astype("float32")
labels = (terms[:, :10] + (rs.rand(203, 10) < 0.1) > 0).astype("float32")
""", """
model = keras.Sequential([keras.Input((120,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="sigmoid")])
model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["binary_accuracy"])
history = model.fit(terms[:160], labels[:160], batch_size=32, epochs=3, shuffle=False,
                    verbose=0)
_, binary_acc = model.evaluate(terms[160:], labels[160:], verbose=0)
""")
    same_history(plain, ours)
    assert ours["binary_acc"] == pytest.approx(plain["binary_acc"], abs=1e-6)


# examples/nlp/ner_transformers.py: a token classifier (the example's TokenAndPositionEmbedding
# and TransformerBlock in a subclassed NERModel) trained with its CustomNonPaddingTokenLoss,
# which leaves the padding tag 0 out of the mean; 96 sentences, whole batches.
def test_ner_transformer_with_a_loss_that_skips_padding_tokens(ip):
    plain, ours, _ = both(ip, """
ops = keras.ops
VOCAB, LENGTH, TAGS = 300, 10, 5
rs = np.random.RandomState(2)
lengths = rs.randint(4, LENGTH + 1, 96)
present = np.arange(LENGTH)[None, :] < lengths[:, None]
tokens = np.where(present, rs.randint(1, VOCAB, (96, LENGTH)), 0).astype("int32")
tags = np.where(present, rs.randint(1, TAGS, (96, LENGTH)), 0).astype("int32")

class TransformerBlock(keras.layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"),
                                     keras.layers.Dense(embed_dim)])
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)

class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, inputs):
        positions = ops.arange(0, ops.shape(inputs)[-1], 1)
        return self.token_emb(inputs) + self.pos_emb(positions)

class NERModel(keras.Model):
    def __init__(self, num_tags, vocab_size, maxlen=128, embed_dim=32, num_heads=2, ff_dim=32):
        super().__init__()
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        self.transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        self.dropout1 = keras.layers.Dropout(0.1)
        self.ff = keras.layers.Dense(ff_dim, activation="relu")
        self.dropout2 = keras.layers.Dropout(0.1)
        self.ff_final = keras.layers.Dense(num_tags, activation="softmax")

    def call(self, inputs, training=False):
        x = self.embedding_layer(inputs)
        x = self.transformer_block(x, training=training)
        x = self.dropout1(x, training=training)
        x = self.dropout2(self.ff(x), training=training)
        return self.ff_final(x)

class CustomNonPaddingTokenLoss(keras.losses.Loss):
    def __init__(self, name="custom_ner_loss"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False, reduction=None)
        loss = loss_fn(y_true, y_pred)
        mask = ops.cast((y_true > 0), dtype="float32")
        loss = loss * mask
        return ops.sum(loss) / ops.sum(mask)
""", """
ner_model = NERModel(TAGS, VOCAB, maxlen=LENGTH, embed_dim=16, num_heads=2, ff_dim=16)
ner_model.compile(optimizer="adam", loss=CustomNonPaddingTokenLoss())
history = ner_model.fit(tokens, tags, batch_size=32, epochs=2, shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours, "ner_model")


# examples/nlp/pretrained_word_embeddings.py: an Embedding layer holding a fixed embedding
# matrix (set_weights after build, trainable=False) under a Conv1D classifier with Dropout.
def test_a_frozen_pretrained_embedding_under_a_conv1d_classifier(ip):
    plain, ours, _ = both(ip, """
num_tokens, embedding_dim = 400, 16
rs = np.random.RandomState(3)
embedding_matrix = rs.normal(size=(num_tokens, embedding_dim)).astype("float32")
sequences = rs.randint(0, num_tokens, (203, 40)).astype("int32")
labels = rs.randint(0, 4, 203)
""", """
embedding_layer = keras.layers.Embedding(num_tokens, embedding_dim, trainable=False)
embedding_layer.build((1,))
embedding_layer.set_weights([embedding_matrix])
int_sequences_input = keras.Input(shape=(None,), dtype="int32")
h = embedding_layer(int_sequences_input)
h = keras.layers.Conv1D(16, 5, activation="relu")(h)
h = keras.layers.MaxPooling1D(5)(h)
h = keras.layers.GlobalMaxPooling1D()(h)
h = keras.layers.Dense(16, activation="relu")(h)
h = keras.layers.Dropout(0.5)(h)
model = keras.Model(int_sequences_input, keras.layers.Dense(4, activation="softmax")(h))
model.compile(loss="sparse_categorical_crossentropy", optimizer="rmsprop", metrics=["acc"])
history = model.fit(sequences, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
kept = embedding_layer.get_weights()[0]
""")
    same_history(plain, ours)
    np.testing.assert_array_equal(ours["kept"], plain["embedding_matrix"])
    same_weights(plain, ours)


# examples/vision/conv_lstm.py: next-frame prediction with a ConvLSTM2D layer, BatchNorm and a
# Conv3D head, frames in, the frames one step later out, binary crossentropy.
def test_conv_lstm_next_frame_prediction(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(4)
movies = (rs.rand(24, 4, 6, 6, 1) > 0.7).astype("float32")
x_frames, y_frames = movies[:, :-1], movies[:, 1:]
""", """
inp = keras.layers.Input(shape=(None, 6, 6, 1))
h = keras.layers.ConvLSTM2D(filters=8, kernel_size=(3, 3), padding="same",
                            return_sequences=True, activation="relu")(inp)
h = keras.layers.BatchNormalization()(h)
h = keras.layers.Conv3D(filters=1, kernel_size=(3, 3, 3), activation="sigmoid",
                        padding="same")(h)
model = keras.models.Model(inp, h)
model.compile(loss=keras.losses.binary_crossentropy, optimizer=keras.optimizers.Adam())
history = model.fit(x_frames[:16], y_frames[:16], batch_size=8, epochs=2, shuffle=False,
                    verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# examples/vision/oxford_pets_image_segmentation.py: the example's U-Net-like model (a strided
# stem, a SeparableConv2D block with a residual projection down, Conv2DTranspose blocks with
# UpSampling2D up; one convolution a block here), a per-pixel softmax over 3 classes, sparse
# categorical crossentropy.
def test_unet_like_segmentation_with_residual_blocks(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(5)
images = rs.rand(45, 8, 8, 3).astype("float32")
masks = (images.mean(-1, keepdims=True) * 3).astype("int32").clip(0, 2)
""", """
inputs = keras.Input(shape=(8, 8, 3))
h = keras.layers.Conv2D(8, 3, strides=2, padding="same")(inputs)
h = keras.layers.BatchNormalization()(h)
h = keras.layers.Activation("relu")(h)
previous_block_activation = h
for filters in [16]:
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.SeparableConv2D(filters, 3, padding="same")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.MaxPooling2D(3, strides=2, padding="same")(h)
    residual = keras.layers.Conv2D(filters, 1, strides=2, padding="same")(
        previous_block_activation)
    h = keras.layers.add([h, residual])
    previous_block_activation = h
for filters in [16, 8]:
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Conv2DTranspose(filters, 3, padding="same")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.UpSampling2D(2)(h)
    residual = keras.layers.UpSampling2D(2)(previous_block_activation)
    residual = keras.layers.Conv2D(filters, 1, padding="same")(residual)
    h = keras.layers.add([h, residual])
    previous_block_activation = h
outputs = keras.layers.Conv2D(3, 3, activation="softmax", padding="same")(h)
model = keras.Model(inputs, outputs)
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
history = model.fit(images[:32], masks[:32], batch_size=8, epochs=2, shuffle=False, verbose=0)
segmented = model.predict(images[32:], verbose=0)
""")
    same_history(plain, ours)
    assert ours["segmented"].shape == (13, 8, 8, 3)
    same_values(plain, ours, "segmented", NOISY_BIAS)


# examples/vision/pointnet.py: point clouds through the example's T-Net (an orthogonality
# activity regularizer of its own, a Dot with the learned transform), Conv1D and Dense
# blocks with BatchNormalization(momentum=0.0).
def test_pointnet_with_its_orthogonal_regularizer(ip):
    plain, ours, _ = both(ip, """
ops = keras.ops
rs = np.random.RandomState(6)
points = rs.normal(size=(64, 32, 3)).astype("float32")
labels = rs.randint(0, 4, 64)

def conv_bn(x, filters):
    x = keras.layers.Conv1D(filters, kernel_size=1, padding="valid")(x)
    x = keras.layers.BatchNormalization(momentum=0.0)(x)
    return keras.layers.Activation("relu")(x)

def dense_bn(x, filters):
    x = keras.layers.Dense(filters)(x)
    x = keras.layers.BatchNormalization(momentum=0.0)(x)
    return keras.layers.Activation("relu")(x)

class OrthogonalRegularizer(keras.regularizers.Regularizer):
    def __init__(self, num_features, l2reg=0.001):
        self.num_features = num_features
        self.l2reg = l2reg
        self.eye = ops.eye(num_features)

    def __call__(self, x):
        x = ops.reshape(x, (-1, self.num_features, self.num_features))
        xxt = ops.tensordot(x, x, axes=(2, 2))
        xxt = ops.reshape(xxt, (-1, self.num_features, self.num_features))
        return ops.sum(self.l2reg * ops.square(xxt - self.eye))

def tnet(inputs, num_features):
    bias = keras.initializers.Constant(np.eye(num_features).flatten())
    reg = OrthogonalRegularizer(num_features)
    x = conv_bn(inputs, 8)
    x = conv_bn(x, 16)
    x = keras.layers.GlobalMaxPooling1D()(x)
    x = dense_bn(x, 8)
    x = keras.layers.Dense(num_features * num_features, kernel_initializer="zeros",
                           bias_initializer=bias, activity_regularizer=reg)(x)
    feat_T = keras.layers.Reshape((num_features, num_features))(x)
    return keras.layers.Dot(axes=(2, 1))([inputs, feat_T])
""", """
inputs = keras.Input(shape=(32, 3))
h = tnet(inputs, 3)
h = conv_bn(h, 8)
h = conv_bn(h, 16)
h = keras.layers.GlobalMaxPooling1D()(h)
h = dense_bn(h, 16)
h = keras.layers.Dropout(0.3)(h)
model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(h), name="pointnet")
model.compile(loss="sparse_categorical_crossentropy", optimizer=keras.optimizers.Adam(0.001),
              metrics=["sparse_categorical_accuracy"])
history = model.fit(points, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
probabilities = model.predict(points[:9], verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "probabilities", NOISY_BIAS)


# examples/generative/pixelcnn.py: the example's PixelConvLayer (a Conv2D whose kernel is
# masked in call, types A and B) and ResidualBlock, on binary images that are their own
# targets.
def test_pixelcnn_with_masked_convolutions(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(8)
data = (rs.rand(64, 8, 8, 1) > 0.6).astype("float32")

class PixelConvLayer(keras.layers.Layer):
    def __init__(self, mask_type, **kwargs):
        super().__init__()
        self.mask_type = mask_type
        self.conv = keras.layers.Conv2D(**kwargs)

    def build(self, input_shape):
        self.conv.build(input_shape)
        kernel_shape = keras.ops.shape(self.conv.kernel)
        self.mask = np.zeros(shape=kernel_shape)
        self.mask[: kernel_shape[0] // 2, ...] = 1.0
        self.mask[kernel_shape[0] // 2, : kernel_shape[1] // 2, ...] = 1.0
        if self.mask_type == "B":
            self.mask[kernel_shape[0] // 2, kernel_shape[1] // 2, ...] = 1.0

    def call(self, inputs):
        self.conv.kernel.assign(self.conv.kernel * self.mask)
        return self.conv(inputs)

class ResidualBlock(keras.layers.Layer):
    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = keras.layers.Conv2D(filters=filters, kernel_size=1, activation="relu")
        self.pixel_conv = PixelConvLayer(mask_type="B", filters=filters // 2, kernel_size=3,
                                         activation="relu", padding="same")
        self.conv2 = keras.layers.Conv2D(filters=filters, kernel_size=1, activation="relu")

    def call(self, inputs):
        x = self.conv2(self.pixel_conv(self.conv1(inputs)))
        return keras.layers.add([inputs, x])
""", """
inputs = keras.Input(shape=(8, 8, 1))
h = PixelConvLayer(mask_type="A", filters=16, kernel_size=5, activation="relu",
                   padding="same")(inputs)
h = ResidualBlock(filters=16)(h)
h = PixelConvLayer(mask_type="B", filters=16, kernel_size=1, strides=1, activation="relu",
                   padding="valid")(h)
out = keras.layers.Conv2D(filters=1, kernel_size=1, strides=1, activation="sigmoid",
                          padding="valid")(h)
pixel_cnn = keras.Model(inputs, out)
pixel_cnn.compile(optimizer=keras.optimizers.Adam(0.0005), loss="binary_crossentropy")
history = pixel_cnn.fit(x=data, y=data, batch_size=16, epochs=2, shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours, "pixel_cnn")


# examples/vision/super_resolution_sub_pixel.py: ESPCN, convolutions with an orthogonal
# initializer and the example's DepthToSpace layer (reshape and transpose), inputs of any
# height and width; a callback predicting one image at each epoch's end for its PSNR.
def test_super_resolution_with_a_depth_to_space_layer_and_a_psnr_callback(ip):
    plain, ours, _ = both(ip, """
ops = keras.ops
rs = np.random.RandomState(9)
high = rs.rand(40, 12, 12, 1).astype("float32")
low = high.reshape(40, 4, 3, 4, 3, 1).mean(axis=(2, 4))

class DepthToSpace(keras.layers.Layer):
    def __init__(self, block_size):
        super().__init__()
        self.block_size = block_size

    def call(self, input):
        batch, height, width, depth = ops.shape(input)
        depth = depth // (self.block_size**2)
        x = ops.reshape(input, [-1, height, width, self.block_size, self.block_size, depth])
        x = ops.transpose(x, [0, 1, 3, 2, 4, 5])
        return ops.reshape(x, [-1, height * self.block_size, width * self.block_size, depth])

class ESPCNCallback(keras.callbacks.Callback):
    def __init__(self, image):
        super().__init__()
        self.image, self.psnr = image, []

    def on_epoch_end(self, epoch, logs=None):
        prediction = self.model.predict(self.image[None], verbose=0)
        mse = np.mean((prediction[0] - high[0]) ** 2)
        self.psnr.append(10 * np.log10(1 / mse))

def get_model(upscale_factor=3, channels=1):
    conv_args = {"activation": "relu", "kernel_initializer": "orthogonal", "padding": "same"}
    inputs = keras.Input(shape=(None, None, channels))
    x = keras.layers.Conv2D(16, 5, **conv_args)(inputs)
    x = keras.layers.Conv2D(16, 3, **conv_args)(x)
    x = keras.layers.Conv2D(channels * (upscale_factor**2), 3, **conv_args)(x)
    return keras.Model(inputs, DepthToSpace(upscale_factor)(x))
""", """
model = get_model()
callback = ESPCNCallback(low[0])
model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001),
              loss=keras.losses.MeanSquaredError())
history = model.fit(low[:32], high[:32], batch_size=8, epochs=2, shuffle=False, verbose=0,
                    callbacks=[callback])
psnr = callback.psnr
bigger = model.predict(rs.rand(2, 5, 7, 1).astype("float32"), verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "psnr")
    assert ours["bigger"].shape == (2, 15, 21, 1)
    same_values(plain, ours, "bigger")
