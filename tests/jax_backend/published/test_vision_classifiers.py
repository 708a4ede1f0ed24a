"""Published Keras code on JAX, 8 simulated devices beside one: vision classifiers.

How they are written and compared: this folder's conftest.py.
"""

import pytest

from support.cells import CIFAR_SHAPED
from support.same import both, evaluate_equals_cpu_copy, same_history, same_values


# -- Vision ----------------------------------------------------------------------------------


# examples/vision/image_classification_efficientnet_fine_tuning.py: an image-augmentation
# Sequential in front of a pretrained base set `trainable = False`, a new top
# (GlobalAveragePooling2D, BatchNormalization, Dropout, softmax), Adam(1e-2); then the last
# layers of the base unfrozen except BatchNormalization, recompiled with Adam(1e-5), fit
# again, and predict. A small conv base stands in for EfficientNetB0 (no weights download).
def test_efficientnet_style_fine_tuning_freezes_then_unfreezes(ip):
    plain, ours, _ = both(ip, CIFAR_SHAPED + """
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
VIT = CIFAR_SHAPED + """
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
    plain, ours, _ = both(ip, CIFAR_SHAPED + """
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
