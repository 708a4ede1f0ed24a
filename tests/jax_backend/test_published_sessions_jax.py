"""Notebook sessions of several cells from published Keras code, on Keras's JAX backend: the
training cells through `%%tpu_train` on 8 simulated devices, the others plain cells (the
models tpu_magic trained keep routing there), beside the same cells run one after another
with plain Keras on one device from the same seed (`support.same`). Between the cells:
freezing and recompiling, a cell that fails, saving and loading, `%tpu_sync`, models that
share layers, a second training cell on a pretrained encoder.

Sources (keras-team/keras-io unless said): guides/sequential_model.py, guides/functional_api.py,
guides/serialization_and_saving.py, guides/training_with_built_in_methods.py,
guides/keras_hub/transformer_pretraining.py; in our own words, on small synthetic data.
"""

import numpy as np
import pytest

from support.cells import train
from support.same import (imports, plainly, run_cell, same_history, same_values,
                          same_weights)

TRAIN, PLAIN = "train", "plain"
ROWS = """
x = np.random.RandomState(0).rand(203, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 3, 203)
"""
FIT = "x, y, batch_size=32, shuffle=False, verbose=0"


def session(ip, setup: str, cells: list[tuple[str, str]]):
    """Runs `setup`, then each (kind, code) cell in order: plainly in one namespace, and in
    the test shell (TRAIN through %%tpu_train, PLAIN as a plain cell). Returns both
    namespaces (plain first)."""
    plain = plainly(setup, "")
    for _, code in cells:
        exec(code, plain)
    run_cell(ip, imports() + setup)
    for kind, code in cells:
        (train if kind == TRAIN else run_cell)(ip, code)
    return plain, ip.user_ns


# guides/sequential_model.py, "Transfer learning with a Sequential model": train, freeze every
# layer but the last and recompile (a plain cell), train the head, then unfreeze and fine-tune
# at a low rate.
def test_sequential_fit_freeze_recompile_fit_unfreeze_fine_tune(ip):
    plain, ours = session(ip, ROWS, [
        (TRAIN, """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3)])
model.compile(keras.optimizers.Adam(0.01),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
history = model.fit(%s, epochs=2)
""" % FIT),
        (PLAIN, """
for layer in model.layers[:-1]:
    layer.trainable = False
model.compile(keras.optimizers.Adam(0.01),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
frozen_before = [w.copy() for w in model.layers[0].get_weights()]
"""),
        (TRAIN, "head = model.fit(%s, epochs=2)\n" % FIT),
        (PLAIN, """
frozen_after = model.layers[0].get_weights()
for layer in model.layers:
    layer.trainable = True
model.compile(keras.optimizers.Adam(1e-4),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
"""),
        (TRAIN, "tuned = model.fit(%s, epochs=2)\n" % FIT),
    ])
    for name in ("history", "head", "tuned"):
        same_history(plain, ours, name)
    for before, after in zip(ours["frozen_before"], ours["frozen_after"]):
        np.testing.assert_array_equal(before, after)  # frozen while the head trained
    same_weights(plain, ours)


# guides/functional_api.py, "Use the same graph of layers to define multiple models": an
# encoder and the autoencoder around it share their layers; the autoencoder trains, and the
# encoder predicts in a later plain cell with the trained layers.
def test_an_encoder_sharing_the_autoencoders_layers_predicts_after_it_trained(ip):
    plain, ours = session(ip, """
images = np.random.RandomState(0).rand(96, 12, 12, 1).astype("float32")
""", [
        (TRAIN, """
encoder_input = keras.Input(shape=(12, 12, 1), name="img")
h = keras.layers.Conv2D(8, 3, activation="relu")(encoder_input)
h = keras.layers.Conv2D(4, 3, activation="relu")(h)
encoder_output = keras.layers.GlobalMaxPooling2D()(h)
encoder = keras.Model(encoder_input, encoder_output, name="encoder")
h = keras.layers.Reshape((2, 2, 1))(encoder_output)
h = keras.layers.Conv2DTranspose(4, 3, activation="relu")(h)
h = keras.layers.Conv2DTranspose(1, 3, activation="relu")(h)
decoder_output = keras.layers.UpSampling2D(2)(h)
autoencoder = keras.Model(encoder_input, decoder_output, name="autoencoder")
autoencoder.compile("adam", "mse")
history = autoencoder.fit(images, images, batch_size=16, epochs=2,
                          shuffle=False, verbose=0)
"""),
        (PLAIN, "codes = encoder.predict(images[:11], verbose=0)\n"),
    ])
    same_history(plain, ours)
    same_values(plain, ours, "codes")
    same_weights(plain, ours, "encoder")


# guides/serialization_and_saving.py, "Custom objects": a registered custom layer with its
# get_config and a registered activation; the trained model saved as .keras, loaded in the
# next cell, trained on there through the magic; its weights also loaded into a clone.
def test_a_model_with_custom_objects_saved_loaded_and_trained_on(ip, tmp_path):
    path = str(tmp_path / "custom_model.keras")
    weights = str(tmp_path / "custom.weights.h5")
    plain, ours = session(ip, ROWS + """
@keras.saving.register_keras_serializable(package="my_package", name="custom_fn")
def custom_fn(x):
    return x**2

@keras.saving.register_keras_serializable(package="MyLayers")
class CustomLayer(keras.layers.Layer):
    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {"factor": self.factor}
""", [
        (TRAIN, """
inputs = keras.Input(shape=(8,))
mid = CustomLayer(0.5)(inputs)
mid = keras.layers.Dense(16, activation=custom_fn)(mid)
model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(mid))
model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
history = model.fit(%s, epochs=2)
""" % FIT),
        (PLAIN, f"""
model.save({path!r})
model.save_weights({weights!r})
reconstructed = keras.models.load_model({path!r})
clone = keras.models.clone_model(model)
clone.load_weights({weights!r})
same_rows = [m.predict(x[:7], verbose=0) for m in (model, reconstructed, clone)]
"""),
        (TRAIN, "again = reconstructed.fit(%s, epochs=2)\n" % FIT),
    ])
    np.testing.assert_allclose(ours["same_rows"][1], ours["same_rows"][0], atol=1e-6)
    np.testing.assert_allclose(ours["same_rows"][2], ours["same_rows"][0], atol=1e-6)
    same_values(plain, ours, "same_rows")
    same_history(plain, ours)
    same_history(plain, ours, "again")
    same_weights(plain, ours, "reconstructed")


# %tpu_sync between training cells: the CPU copy after the first cell evaluates as plain
# Keras's model after the same fit; the model trains on in the next cell and a second sync
# replaces the copy with the newer weights.
def test_sync_after_each_training_cell_copies_the_newest_weights(ip):
    model = """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""
    evaluate = "{name} = {model}.evaluate(x, y, batch_size=203, return_dict=True, verbose=0)\n"
    plain = plainly(ROWS, model + f"model.fit({FIT}, epochs=1)\n")
    exec(evaluate.format(name="first", model="model"), plain)
    exec(f"model.fit({FIT}, epochs=2)\n" + evaluate.format(name="second", model="model"),
         plain)
    run_cell(ip, imports() + ROWS)
    train(ip, model + f"model.fit({FIT}, epochs=1)\n")
    ip.run_line_magic("tpu_sync", "model")
    run_cell(ip, evaluate.format(name="first", model="model_cpu"))
    train(ip, f"model.fit({FIT}, epochs=2)\n")
    ip.run_line_magic("tpu_sync", "model")
    run_cell(ip, evaluate.format(name="second", model="model_cpu"))
    same_values(plain, ip.user_ns, "first")
    same_values(plain, ip.user_ns, "second")
    assert ip.user_ns["second"]["loss"] < ip.user_ns["first"]["loss"]


# A cell that fails on the user's own line after its fit (a typo): the user's NameError,
# unchanged; the fit before it happened, as in plain Keras; the next cell evaluates and trains.
def test_a_cell_failing_after_its_fit_then_a_good_cell(ip):
    build = """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""
    failing = f"history = model.fit({FIT}, epochs=1)\nprint(hsitory.history)\n"
    good = (f"evaluation = model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)\n"
            f"again = model.fit({FIT}, epochs=1)\n")
    plain = plainly(ROWS, build)
    with pytest.raises(NameError) as theirs:
        exec(failing, plain)
    exec(good, plain)
    run_cell(ip, imports() + ROWS + build)
    with pytest.raises(NameError) as mine:
        train(ip, failing)
    assert str(mine.value) == str(theirs.value) == "name 'hsitory' is not defined"
    train(ip, good)
    same_history(plain, ip.user_ns)
    same_values(plain, ip.user_ns, "evaluation")
    same_history(plain, ip.user_ns, "again")
    same_weights(plain, ip.user_ns)


# guides/training_with_built_in_methods.py / the Keras FAQ ("resume training"): a second fit
# in a later plain cell continuing the epoch count (`initial_epoch`), with validation.
def test_a_later_plain_cell_continues_the_epochs(ip):
    plain, ours = session(ip, ROWS, [
        (TRAIN, """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.RMSprop(0.01), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
history = model.fit(%s, epochs=2, validation_split=0.2)
""" % FIT),
        (PLAIN, "more = model.fit(%s, initial_epoch=2, epochs=4, validation_split=0.2)\n"
         % FIT),
    ])
    assert ours["more"].epoch == plain["more"].epoch == [2, 3]
    same_history(plain, ours)
    same_history(plain, ours, "more")
    same_weights(plain, ours)


# guides/functional_api.py, "Extract and reuse nodes in the graph of layers": a feature
# extractor over every layer's output of the trained model, made in a later plain cell.
def test_a_feature_extractor_over_the_trained_models_layers(ip):
    plain, ours = session(ip, """
images = np.random.RandomState(0).rand(64, 10, 10, 3).astype("float32")
labels = np.random.RandomState(1).randint(0, 4, 64)
""", [
        (TRAIN, """
model = keras.Sequential([keras.Input((10, 10, 3)),
                          keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.MaxPooling2D(),
                          keras.layers.Flatten(),
                          keras.layers.Dense(4)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(images, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
"""),
        (PLAIN, """
features_list = [layer.output for layer in model.layers]
feat_extraction_model = keras.Model(inputs=model.inputs, outputs=features_list)
extracted = feat_extraction_model(images[:5])
"""),
    ])
    same_history(plain, ours)
    same_values(plain, ours, "extracted")


# guides/keras_hub/transformer_pretraining.py: an encoder of KerasHub's layers
# (TokenAndPositionEmbedding, TransformerEncoder) pretrained with a MaskedLMHead on masked
# tokens, then a classifier on the pretrained encoder fine-tuned in the next training cell.
def test_kerashub_encoder_pretrained_with_a_masked_lm_head_then_fine_tuned(ip):
    plain, ours = session(ip, """
import keras_hub
VOCAB, LENGTH = 200, 12
rs = np.random.RandomState(0)
tokens = rs.randint(4, VOCAB, (96, LENGTH)).astype("int32")
mask_positions = np.stack([rs.choice(LENGTH, 3, replace=False) for _ in range(96)])
masked_tokens = tokens.copy()
np.put_along_axis(masked_tokens, mask_positions, 3, axis=1)  # 3: the [MASK] id
mask_ids = np.take_along_axis(tokens, mask_positions, axis=1)
labels = rs.randint(0, 2, 96)
""", [
        (TRAIN, """
inputs = keras.Input(shape=(LENGTH,), dtype="int32")
embedding_layer = keras_hub.layers.TokenAndPositionEmbedding(
    vocabulary_size=VOCAB, sequence_length=LENGTH, embedding_dim=16)
outputs = keras.layers.LayerNormalization(epsilon=1e-5)(embedding_layer(inputs))
outputs = keras_hub.layers.TransformerEncoder(intermediate_dim=32, num_heads=2,
                                              dropout=0.0)(outputs)
encoder_model = keras.Model(inputs, outputs)
token_input = keras.Input(shape=(LENGTH,), dtype="int32")
position_input = keras.Input(shape=(3,), dtype="int32")
encoded = encoder_model(token_input)
predictions = keras_hub.layers.MaskedLMHead(
    token_embedding=embedding_layer.token_embedding, activation="softmax")(
        encoded, mask_positions=position_input)
pretraining_model = keras.Model([token_input, position_input], predictions)
pretraining_model.compile(loss="sparse_categorical_crossentropy",
                          optimizer=keras.optimizers.AdamW(1e-3), weighted_metrics=["accuracy"])
pretrained = pretraining_model.fit([masked_tokens, mask_positions], mask_ids, batch_size=16,
                                   epochs=2, shuffle=False, verbose=0)
"""),
        (TRAIN, """
inputs = keras.Input(shape=(LENGTH,), dtype="int32")
pooled = keras.layers.GlobalAveragePooling1D()(encoder_model(inputs))
finetuning_model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(pooled))
finetuning_model.compile(loss="sparse_categorical_crossentropy",
                         optimizer=keras.optimizers.AdamW(5e-4), metrics=["accuracy"])
history = finetuning_model.fit(tokens, labels, batch_size=16, epochs=2, shuffle=False,
                               verbose=0)
"""),
    ])
    same_history(plain, ours, "pretrained")
    same_history(plain, ours)
    same_weights(plain, ours, "finetuning_model")


# guides/transfer_learning.py, "Fine-tuning": the base model frozen and trained under it,
# then unfrozen, compiled again in a plain cell with a metric object (`BinaryAccuracy()`, its
# variables made there, outside the devices' distribution: Keras builds them into the
# model's state only in the next fit) and fine-tuned in that cell; the second fit's six
# steps are too few to group, so Keras's own step runs.
def test_fine_tuning_recompiled_in_a_plain_cell_with_a_metric_object(ip):
    compiled = """
model.compile(optimizer=keras.optimizers.Adam(%s),
              loss=keras.losses.BinaryCrossentropy(from_logits=True),
              metrics=[keras.metrics.BinaryAccuracy()])
"""
    plain, ours = session(ip, ROWS + "labels = (y == 1).astype('float32')\n", [
        (TRAIN, """
base_model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, use_bias=False),
                               keras.layers.BatchNormalization(),
                               keras.layers.Activation("relu")], name="base")
base_model.trainable = False
inputs = keras.Input((8,))
h = base_model(inputs, training=False)
h = keras.layers.Dropout(0.2)(h)
model = keras.Model(inputs, keras.layers.Dense(1)(h))
""" + compiled % "1e-2" + "history = model.fit(x, labels, batch_size=32, epochs=2, verbose=0)\n"),
        (PLAIN, "base_model.trainable = True\n" + compiled % "1e-3" +
         "tuned = model.fit(x[:192], labels[:192], batch_size=32, epochs=2, verbose=0)\n"),
    ])
    for name in ("history", "tuned"):
        same_history(plain, ours, name)
    same_weights(plain, ours)
