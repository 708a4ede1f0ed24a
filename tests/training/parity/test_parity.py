"""The first-step parity check on TensorFlow replicas (MirroredStrategy over 8 logical CPUs):
three kinds of silent difference caught and named (a loss over the whole batch then run
with every replica computing the whole batch, where that agrees with one device; the others
left alone), and silence on the paths that are exact. The JAX side is in
jax_backend/test_as_plain_keras.py."""

import numpy as np
import pytest
from support.cells import train

from tpu_magic.training.parity import compare as parity_module
from tpu_magic.training.parity import setup as setups

ROWS = """
import numpy as np, keras, tensorflow as tf
x = np.random.RandomState(0).rand(256, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 4, 256)
"""

# keras-io examples/vision/supervised-contrastive-learning.py, in Keras 3 ops: each row's
# negatives are the rest of the batch, so the loss of 1/8 of a batch is another number.
CONTRASTIVE = """
class SupervisedContrastiveLoss(keras.losses.Loss):
    def __init__(self, temperature=0.5, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        features = keras.ops.normalize(feature_vectors, axis=1)
        logits = keras.ops.matmul(features, keras.ops.transpose(features)) / self.temperature
        labels = keras.ops.reshape(labels, (-1, 1))
        same = keras.ops.cast(keras.ops.equal(labels, keras.ops.transpose(labels)), "float32")
        targets = same / keras.ops.sum(same, axis=1, keepdims=True)
        return keras.ops.mean(keras.losses.categorical_crossentropy(targets, logits,
                                                                   from_logits=True))
"""


def _warned(ip, cell, capsys, what="the first distributed step differs"):
    report = train(ip, cell)
    out = capsys.readouterr().out
    assert report.parity is not None and not report.parity.agrees, report.parity
    assert f"warning: {what}" in out, out
    return report.parity


def test_a_batch_level_loss_with_augmentation_is_caught_in_inference_mode(sim8, capsys):
    # The keras-io example's shape: augmentation (random numbers each replica draws on its
    # own, so the training step cannot be compared), an encoder, a projection head.
    parity = _warned(sim8, ROWS + CONTRASTIVE + """
inputs = keras.Input((8,))
noisy = keras.layers.GaussianNoise(0.1)(inputs)
features = keras.layers.Dense(16, activation="relu")(noisy)
model = keras.Model(inputs, keras.layers.Dense(8)(features))
model.compile(keras.optimizers.Adam(0.001), loss=SupervisedContrastiveLoss())
model.fit(x, y, batch_size=64, epochs=1, verbose=0)
""", capsys, "the first batch's logs in inference mode differ from one device's")
    assert parity.inference and parity.update is None
    assert parity.likely.startswith("a loss"), parity.likely
    loss = dict((key, (ours, theirs)) for key, ours, theirs in parity.logs)["loss"]
    assert loss[0] != pytest.approx(loss[1], rel=1e-3)
    assert parity.line().startswith("first batch, compared in inference mode, DIFFERS from "
                                    "one device (random layers such as Dropout are off")


def test_a_batch_level_loss_is_caught_in_the_training_step_and_run_whole(sim8, capsys):
    # caught, and run again with every replica computing the whole batch, which agrees:
    # the fit goes on so, said in a note (test_losses_over_the_batch.py: against plain Keras)
    report = train(sim8, ROWS + CONTRASTIVE + """
inputs = keras.Input((8,))
model = keras.Model(inputs, keras.layers.Dense(8)(keras.layers.Dense(16, activation="relu")(inputs)))
model.compile(keras.optimizers.SGD(0.1), loss=SupervisedContrastiveLoss())
model.fit(x, y, batch_size=64, epochs=1, verbose=0)
""")
    out, parity = capsys.readouterr().out, report.parity
    assert not parity.agrees and not parity.inference and parity.whole_batch, parity
    assert parity.likely.startswith("a loss"), parity.likely
    assert parity.warning() is None and "warning: the first" not in out, out
    assert f"note: {parity.note()}" in out, out
    assert parity.line().startswith("first step DIFFERS from one device split over the "
                                    "replicas"), parity.line()


def test_per_replica_batchnorm_statistics_are_caught(sim8, capsys):
    parity = _warned(sim8, ROWS + """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                          keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(4)])
model.compile(keras.optimizers.SGD(0.1),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=64, epochs=1, verbose=0)
""", capsys)
    assert parity.likely.startswith("per-replica state: bn"), parity.likely


CUSTOM_STEP = """
class CustomModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="loss")
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self(x, training=True))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]

inputs = keras.Input((8,))
model = CustomModel(inputs, keras.layers.Dense(4)(inputs))
model.compile(keras.optimizers.SGD(0.1))
model.fit(x, y, batch_size=64, epochs=1, verbose=0)
"""


def test_a_custom_steps_loss_scaled_by_the_replicas_is_caught_with_the_fix_off(
        sim8, capsys, monkeypatch):
    # Keras on TensorFlow divides a Loss object's result by the replicas inside a replica;
    # tpu_magic's `replica_steps` undoes it. With it switched off, the check sees 1/8.
    import contextlib

    from tpu_magic.backends.tf.backend import TensorFlowBackend

    monkeypatch.setattr(TensorFlowBackend, "replica_steps",
                        lambda self, model, connection: contextlib.nullcontext())
    seeded = ROWS + "keras.utils.set_random_seed(0)\n" + CUSTOM_STEP
    parity = _warned(sim8, seeded, capsys)
    assert parity.likely.startswith("loss scaling: the logged loss is 0.125x"), parity.likely
    # every replica computing the whole batch divides it by 8 too: undone, said, and the
    # fit went on from the split step's state, as without the check
    assert parity.whole is not None and not parity.whole.agrees and not parity.whole_batch
    assert "Every replica computing the whole batch differs too" in parity.warning()
    undone = sim8.user_ns["model"].get_weights()
    train(sim8, seeded, "--no-progress --verify off")
    for checked, unchecked in zip(undone, sim8.user_ns["model"].get_weights()):
        np.testing.assert_allclose(checked, unchecked, atol=1e-6)


def test_silent_on_the_exact_paths(sim8, capsys):
    for cell in [
        CUSTOM_STEP,  # the custom step with tpu_magic's replica fix on
        # a padded first batch (12 rows on 8 replicas, batch 16) with a sample weight
        """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(4, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
              weighted_metrics=["accuracy"])
model.fit(x[:12], y[:12], sample_weight=np.linspace(0.5, 2, 12), batch_size=16, verbose=0)
""",
        # Dropout (random draws: compared in inference mode) and synchronized BatchNorm
        """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                          keras.layers.BatchNormalization(synchronized=True),
                          keras.layers.Dropout(0.3), keras.layers.Dense(4)])
model.compile(keras.optimizers.SGD(0.1),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
""",
    ]:
        report = train(sim8, ROWS + cell)
        out = capsys.readouterr().out
        assert isinstance(report.parity, parity_module.Parity), report.parity
        assert report.parity.agrees, report.parity.warning()
        assert "differ" not in out.replace("different ones each epoch", ""), out


def test_the_inference_comparison_leaves_the_epochs_logs_alone(sim8):
    # Its metrics are put back per replica: the logged epoch is the one --verify off logs.
    cell = ROWS + """
keras.utils.set_random_seed(5)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dropout(0.2), keras.layers.Dense(4)])
model.compile(keras.optimizers.SGD(0.1),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = model.fit(x, y, batch_size=64, epochs=1, verbose=0)
"""
    checked = train(sim8, cell, "--no-progress --verify on")
    assert checked.parity.inference
    with_check = dict(sim8.user_ns["history"].history)
    train(sim8, cell, "--no-progress --verify off")
    without = sim8.user_ns["history"].history
    assert sorted(without) == sorted(with_check)
    for key, values in with_check.items():
        assert without[key] == pytest.approx(values, rel=1e-6), key


def test_a_setup_that_agreed_is_told_before_the_fit_and_its_batches_are_not_read(
        sim8, monkeypatch):
    # The training step's comparison (Dense) and the inference-mode one (Dropout: each
    # replica draws its own numbers): a cell run again with the same model, batch and
    # devices is known agreed from its batches' shapes before its fit, reading nothing.
    from tpu_magic.backends.tf import data

    reads = []
    first = data._first
    monkeypatch.setattr(data, "_first", lambda *a: reads.append(a[2]) or first(*a))
    for middle in ("", "keras.layers.Dropout(0.3), "):
        cell = ROWS + f"""
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          {middle}keras.layers.Dense(4, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
model.fit(x, y, batch_size=64, verbose=0)
"""
        reads.clear()
        checked = train(sim8, cell)
        assert isinstance(checked.parity, parity_module.Parity) and checked.parity.agrees
        assert checked.parity.inference == bool(middle) and reads == [1]
        reads.clear()
        again = train(sim8, cell)
        assert isinstance(again.parity, parity_module.Skipped), again.parity
        assert again.parity.why == parity_module.AGREED and reads == []
        assert again.parity.setup == checked.parity.setup


def test_a_comparisons_setup_is_of_the_batches_it_compares():
    # One helper tells a comparison's setup, before the fit and after its first execution:
    # a training step's covers every batch of the execution, an inference-mode comparison's
    # the first batch alone, and the two ways of comparing the same batch are two setups.
    import keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile("adam", "mse")
    one = (((), (64, 8), "float32"),)
    other = (((), (32, 8), "float32"),)
    key = setups.comparison_setup
    assert key(model, [one, other], "8 replicas", inference=True) == \
        key(model, [one], "8 replicas", inference=True)
    assert key(model, [one, other], "8 replicas", inference=False) != \
        key(model, [one], "8 replicas", inference=False)
    assert key(model, [one], "8 replicas", inference=True) != \
        key(model, [one], "8 replicas", inference=False)
    assert key(model, [one], "8 replicas", inference=False) == \
        setups.setup_key(model, [one], "8 replicas")


def test_a_notebook_layer_edited_and_defined_again_is_another_setup(ip):
    # Python before 3.13 reads no source of a class a cell defined, and the setup's key
    # once fell back to the class's id(), which the next class object can reuse once the
    # first is collected: a layer edited and run again took the key of the one before, and
    # its first step went unchecked ("agreed earlier"), flakily. Now the key is the class's
    # own code: the same for the cell run again, another once edited.
    import gc

    import keras

    layer = """
class Summed(keras.layers.Layer):
    def call(self, inputs):
        return keras.ops.sum(inputs, axis=-1, keepdims=True)
"""

    def key_of_cell(source):
        ip.run_cell("import keras\n" + source)
        model = keras.Sequential([keras.Input((8,)), ip.user_ns["Summed"]()])
        model.compile("adam", "mse")
        found = setups.setup_key(model, [(((), (64, 8), "float32"),)], "8 replicas")
        del model
        ip.user_ns.pop("Summed")
        gc.collect()
        return found

    first = key_of_cell(layer)
    assert key_of_cell(layer) == first
    assert key_of_cell(layer.replace("ops.sum", "ops.mean")) != first


def test_a_notebook_loss_edited_and_run_again_is_compared_again(sim8, capsys):
    # A notebook's own loss function was keyed by its name: edited to add a statistic of
    # the batch (each replica then takes its own 1/8's) and run again, it kept the key of
    # the version that agreed, its first step went unchecked, and its loss was another
    # number than plain Keras's, silently. The same for a helper it calls.
    def cell(body, helper="keras.ops.mean((y_true - y_pred) ** 2)"):
        return ROWS + f"""
y = np.random.RandomState(1).rand(256, 1).astype("float32")
def squared(y_true, y_pred):
    return {helper}
def my_loss(y_true, y_pred):
    return {body}
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(keras.optimizers.Adam(0.01), loss=my_loss)
model.fit(x, y, batch_size=64, verbose=0)
"""
    plain = cell("squared(y_true, y_pred)")
    first = train(sim8, plain)
    assert isinstance(first.parity, parity_module.Parity) and first.parity.agrees
    assert train(sim8, plain).parity.why == parity_module.AGREED
    capsys.readouterr()
    for edited in (cell("squared(y_true, y_pred) + keras.ops.var(y_pred)"),
                   cell("squared(y_true, y_pred)", helper="keras.ops.mean((y_true - y_pred) "
                        "** 2) + keras.ops.var(y_pred)")):
        parity = train(sim8, edited).parity
        assert isinstance(parity, parity_module.Parity) and not parity.agrees, parity
        assert parity.likely.startswith("a loss over the whole batch"), parity.likely
        assert parity.whole is not None and parity.whole.agrees, parity.whole
        assert "every replica computes the whole batch instead" in capsys.readouterr().out


def test_a_setups_key_follows_what_the_layers_and_loss_compute(ip):
    # The key of a model rebuilt by the same cell stays the same (Keras numbers its layers'
    # names afresh, nested ones too); a Lambda's function, a layer's setting or a notebook
    # function it holds, edited, is another computation.
    def key_of(cell):
        ip.run_cell("import keras, functools\n" + cell)
        model = ip.user_ns["model"]
        return setups.setup_key(model, [(((), (64, 8), "float32"),)], "8 replicas")

    def model(layer, loss='"mse"'):
        return f"""
model = keras.Sequential([keras.Input((8,)), {layer}, keras.layers.Dense(1)])
model.compile("adam", {loss})
"""
    lambda_ = model("keras.layers.Lambda(lambda x: x * 2.0)")
    assert key_of(lambda_) == key_of(lambda_)
    assert key_of(lambda_) != key_of(model(
        "keras.layers.Lambda(lambda x: x - keras.ops.mean(x, axis=0))"))
    assert key_of(model("keras.layers.Softmax(axis=-1)")) != \
        key_of(model("keras.layers.Softmax(axis=0)"))
    activation = "def act(x):\n    return keras.ops.relu(x)\n" + model(
        "keras.layers.Dense(8, activation=act)")
    assert key_of(activation) == key_of(activation)
    assert key_of(activation) != key_of(activation.replace("ops.relu(x)",
                                                           "ops.relu(x - keras.ops.mean(x, 0))"))
    recurrent = ("keras.layers.Reshape((2, 4)), "
                 "keras.layers.Bidirectional(keras.layers.LSTM(4))")
    assert key_of(model(recurrent)) == key_of(model(recurrent))
    closing = "def scaled(axis):\n    return lambda t, p: keras.ops.mean((t - p) ** 2, axis=axis)\n"
    assert key_of(closing + model("keras.layers.Dense(4)", "scaled(-1)")) != \
        key_of(closing + model("keras.layers.Dense(4)", "scaled(0)"))
    partial = "def loss(t, p, axis):\n    return keras.ops.mean((t - p) ** 2, axis=axis)\n"
    assert key_of(partial + model("keras.layers.Dense(4)", "functools.partial(loss, axis=-1)")) \
        != key_of(partial + model("keras.layers.Dense(4)", "functools.partial(loss, axis=0)"))
