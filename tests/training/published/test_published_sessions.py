"""Notebook sessions of several cells from published Keras code, on TensorFlow's 8 mirrored
replicas: the training cells through `%%tpu_train`, the others plain cells (the models
tpu_magic trained keep routing there), beside the same cells run one after another with plain
Keras on one device from the same seed (`support.same`): freezing and recompiling, saving and
loading with custom objects, `%tpu_sync` between training cells, a cell that fails and the
good one after it. The JAX side is tests/jax_backend/test_published_sessions_jax.py.

Sources (keras-team/keras-io): guides/transfer_learning.py, guides/serialization_and_saving.py,
guides/functional_api.py; in our own words, on small synthetic data.
"""

import numpy as np
import pytest

from support.cells import train
from support.same import (imports, plainly, run_cell, same_history, same_values,
                          same_weights)

TRAIN, PLAIN = "train", "plain"
ROWS = """
x = np.random.RandomState(0).rand(192, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 3, 192)
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


BASE = """
base_model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                               keras.layers.Dense(16, activation="relu")], name="base")
"""


# guides/transfer_learning.py, "The typical transfer-learning workflow": a base model frozen
# under a new head (`base_model.trainable = False`, called with training=False), the head
# trained; then the base unfrozen and the whole model recompiled at a low rate (a plain cell)
# and fine-tuned in the next training cell. The guide makes the base model in a cell of its
# own; here also in the training cell.
@pytest.mark.parametrize("base_made", [
    "in an earlier cell",
    "in the training cell"])
def test_transfer_learning_freeze_train_unfreeze_recompile_fine_tune(sim8, base_made):
    earlier = base_made == "in an earlier cell"
    plain, ours = session(sim8, ROWS + (BASE if earlier else ""), [
        (TRAIN, ("" if earlier else BASE) + """
base_model.trainable = False
inputs = keras.Input(shape=(8,))
h = base_model(inputs, training=False)
outputs = keras.layers.Dense(3, activation="softmax")(h)
model = keras.Model(inputs, outputs)
model.compile(optimizer=keras.optimizers.Adam(0.01),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
frozen_before = [w.copy() for w in base_model.get_weights()]
history = model.fit(%s, epochs=2)
frozen_after = base_model.get_weights()
""" % FIT),
        (PLAIN, """
base_model.trainable = True
model.compile(optimizer=keras.optimizers.Adam(1e-4),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
"""),
        (TRAIN, "tuned = model.fit(%s, epochs=2)\n" % FIT),
    ])
    for before, after in zip(ours["frozen_before"], ours["frozen_after"]):
        np.testing.assert_array_equal(before, after)
    same_history(plain, ours)
    same_history(plain, ours, "tuned")
    same_weights(plain, ours)


# guides/serialization_and_saving.py, "Custom objects": a registered custom layer and
# activation; the trained model saved as .keras in a plain cell, loaded with custom_objects,
# trained on in the next training cell.
def test_a_model_with_custom_objects_saved_loaded_and_trained_on(sim8, tmp_path):
    path = str(tmp_path / "custom_model.keras")
    plain, ours = session(sim8, ROWS + """
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
reconstructed = keras.models.load_model(
    {path!r}, custom_objects={{"CustomLayer": CustomLayer, "custom_fn": custom_fn}})
same_rows = [m.predict(x[:7], verbose=0) for m in (model, reconstructed)]
"""),
        (TRAIN, "again = reconstructed.fit(%s, epochs=2)\n" % FIT),
    ])
    np.testing.assert_allclose(ours["same_rows"][1], ours["same_rows"][0], atol=1e-6)
    same_values(plain, ours, "same_rows")
    same_history(plain, ours)
    same_history(plain, ours, "again")
    same_weights(plain, ours, "reconstructed")


# %tpu_sync between training cells: the CPU copy after each evaluates as plain Keras's model
# after the same fits.
def test_sync_after_each_training_cell_copies_the_newest_weights(sim8):
    model = """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""
    evaluate = "{name} = {model}.evaluate(x, y, batch_size=192, return_dict=True, verbose=0)\n"
    plain = plainly(ROWS, model + f"model.fit({FIT}, epochs=1)\n")
    exec(evaluate.format(name="first", model="model"), plain)
    exec(f"model.fit({FIT}, epochs=2)\n" + evaluate.format(name="second", model="model"),
         plain)
    run_cell(sim8, imports() + ROWS)
    train(sim8, model + f"model.fit({FIT}, epochs=1)\n")
    sim8.run_line_magic("tpu_sync", "model")
    run_cell(sim8, evaluate.format(name="first", model="model_cpu"))
    train(sim8, f"model.fit({FIT}, epochs=2)\n")
    sim8.run_line_magic("tpu_sync", "model")
    run_cell(sim8, evaluate.format(name="second", model="model_cpu"))
    same_values(plain, sim8.user_ns, "first")
    same_values(plain, sim8.user_ns, "second")
    assert sim8.user_ns["second"]["loss"] < sim8.user_ns["first"]["loss"]


# A cell that fails on the user's own line after its fit (a typo): the user's NameError,
# unchanged; the fit before it happened, as in plain Keras; the next cell evaluates, predicts
# and trains on.
def test_a_cell_failing_after_its_fit_then_a_good_cell(sim8):
    build = """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""
    failing = f"history = model.fit({FIT}, epochs=1)\nprint(hsitory.history)\n"
    good = ("evaluation = model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)\n"
            "rows = model.predict(x[:13], verbose=0)\n"
            f"again = model.fit({FIT}, epochs=1)\n")
    plain = plainly(ROWS, build)
    with pytest.raises(NameError) as theirs:
        exec(failing, plain)
    exec(good, plain)
    run_cell(sim8, imports() + ROWS + build)
    with pytest.raises(NameError) as mine:
        train(sim8, failing)
    assert str(mine.value) == str(theirs.value) == "name 'hsitory' is not defined"
    train(sim8, good)
    same_history(plain, sim8.user_ns)
    same_values(plain, sim8.user_ns, "evaluation")
    same_values(plain, sim8.user_ns, "rows")
    same_history(plain, sim8.user_ns, "again")
    same_weights(plain, sim8.user_ns)


# guides/functional_api.py, "All models are callable, just like layers": an ensemble of two
# models trained in separate cells, averaged by a third model built in a plain cell, which
# then trains end to end in the next training cell.
def test_an_ensemble_of_models_trained_in_earlier_cells(sim8):
    def member(name):
        return f"""
inputs = keras.Input(shape=(8,))
{name} = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(
    keras.layers.Dense(7, activation="relu")(inputs)), name={name!r})
{name}.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
{name}_history = {name}.fit({FIT}, epochs=1)
"""
    plain, ours = session(sim8, ROWS, [
        (TRAIN, member("model1")),
        (TRAIN, member("model2")),
        (PLAIN, """
inputs = keras.Input(shape=(8,))
outputs = keras.layers.average([model1(inputs), model2(inputs)])
ensemble_model = keras.Model(inputs=inputs, outputs=outputs)
ensemble_model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
averaged = ensemble_model.predict(x[:9], verbose=0)
"""),
        (TRAIN, "history = ensemble_model.fit(%s, epochs=2)\n" % FIT),
    ])
    same_history(plain, ours, "model1_history")
    same_history(plain, ours, "model2_history")
    same_values(plain, ours, "averaged")
    same_history(plain, ours)
    same_weights(plain, ours, "ensemble_model")
