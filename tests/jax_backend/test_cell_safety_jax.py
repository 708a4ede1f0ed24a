"""Nothing tpu_magic adds may break a cell (issue 50), on Keras's JAX backend: what plain Keras
runs, `%%tpu_train` runs with the same result; the user's own exception reaches the user
unchanged (its type and message); a failed cell leaves the model usable for the next one;
`%tpu_sync` copies the trained model whatever it is made of.

A test marked `xfail(strict=True)` fails today for the reason it names (one of issue 50's
classes): the marker goes when the fix lands (strict: a test that starts passing fails until
its marker is removed). Several hosts (class 5) are in test_hosts.py.
"""

import numpy as np
import pytest

from support.cells import train
from support.injected import Injected, defining, inject
from support.same import both, imports, plainly, run_cell, same_history, same_values, \
    same_weights

ROWS = """
x = np.random.RandomState(0).rand(203, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 3, 203)
"""
DENSE = """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""
FIT = """
history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
evaluation = model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
rows = model.predict(x[:13], verbose=0)
"""


def same_results(plain, ours):
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    same_values(plain, ours, "rows")
    same_weights(plain, ours)


# -- class 1: the first-step check calls what Keras's own fit never does -------------------------

# examples/vision/masked_image_modeling.py: a WarmUpCosine learning-rate schedule of the
# example's own, with no get_config (Keras's LearningRateSchedule.get_config raises
# NotImplementedError; Keras's fit never asks for it). The check's setup key reads
# `optimizer.get_config()`.
WARMUP_COSINE = """
import math
class WarmUpCosine(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, learning_rate_base, total_steps, warmup_learning_rate, warmup_steps):
        super().__init__()
        self.learning_rate_base = learning_rate_base
        self.total_steps = total_steps
        self.warmup_learning_rate = warmup_learning_rate
        self.warmup_steps = warmup_steps

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        cos_annealed = keras.ops.cos(math.pi * (step - self.warmup_steps)
                                     / float(self.total_steps - self.warmup_steps))
        learning_rate = 0.5 * self.learning_rate_base * (1 + cos_annealed)
        slope = (self.learning_rate_base - self.warmup_learning_rate) / self.warmup_steps
        warmup_rate = slope * step + self.warmup_learning_rate
        learning_rate = keras.ops.where(step < self.warmup_steps, warmup_rate, learning_rate)
        return keras.ops.where(step > self.total_steps, 0.0, learning_rate)
"""


def test_a_learning_rate_schedule_without_a_config_trains_as_plain_keras(ip):
    plain, ours, _ = both(ip, ROWS + WARMUP_COSINE, DENSE.replace(
        "keras.optimizers.Adam(0.01)",
        "keras.optimizers.AdamW(WarmUpCosine(0.01, 14, 0.0, 3), weight_decay=1e-4)") + FIT)
    same_results(plain, ours)


# -- class 2: a fit that fails inside Keras ------------------------------------------------------

FAILS_IN_KERAS = "model.fit(x, np.zeros((len(x), 5, 2)), batch_size=32, epochs=1, verbose=0)\n"


def _raised(code: str, namespace: dict) -> BaseException:
    try:
        exec(code, namespace)
    except Exception as exc:  # noqa: BLE001 - the user's error, kept to compare
        return exc
    raise AssertionError("the plain cell did not fail")


FIRST_FIT = DENSE + "model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)\n"
OTHER = FIT.replace("model", "other")
OTHER_MODEL = DENSE.replace("model", "other")


def _same_error(ip, cell: str, theirs: BaseException):
    """`cell` through %%tpu_train raises the plain run's exception: its type and message."""
    with pytest.raises(Exception) as raised:
        train(ip, cell)
    assert (type(raised.value), str(raised.value)) == (type(theirs), str(theirs))


def test_a_fit_that_fails_inside_keras_shows_its_error_and_later_cells_train(ip):
    # the most common notebook error: targets of the wrong shape, for a model that trained
    # in an earlier cell. Keras's JAX fit has taken the variables' values out for its step
    # when the loss refuses them, and plain Keras 3.15 leaves them out (that model is broken
    # in plain Keras too), but the notebook goes on: the next cell trains another model.
    plain = plainly(ROWS, FIRST_FIT)
    theirs = _raised(FAILS_IN_KERAS, plain)
    exec(OTHER_MODEL + OTHER, plain)
    run_cell(ip, imports() + ROWS)
    train(ip, FIRST_FIT)
    try:
        _same_error(ip, FAILS_IN_KERAS, theirs)
        train(ip, OTHER_MODEL + OTHER)
    finally:  # broken in plain Keras too: the later tests' cells must not meet it
        ip.user_ns.pop("model", None)
    same_history(plain, ip.user_ns)
    same_values(plain, ip.user_ns, "evaluation")
    same_values(plain, ip.user_ns, "rows")
    same_weights(plain, ip.user_ns, "other")


def test_a_first_fit_that_fails_leaves_the_model_usable_for_the_next_cells(ip):
    # the model built and compiled in an earlier plain cell; its first fit fails on the
    # targets (Keras's symbolic build refuses them before any value is taken out), and the
    # next cells train it, then evaluate and predict in a plain cell, as in plain Keras
    plain = plainly(ROWS, DENSE)
    theirs = _raised(FAILS_IN_KERAS, plain)
    exec(FIT, plain)
    run_cell(ip, imports() + ROWS + DENSE)
    _same_error(ip, FAILS_IN_KERAS, theirs)
    train(ip, FIT.split("evaluation")[0])
    run_cell(ip, "evaluation" + FIT.split("evaluation")[1])
    same_results(plain, ip.user_ns)


# -- class 3: %tpu_sync of models that do not rebuild from their config --------------------------

def synced_predicts_as_the_model(ip, model: str, probe: str):
    """`%tpu_sync MODEL` makes a copy that predicts `probe` as the trained model does."""
    report = ip.run_line_magic("tpu_sync", f"{model} --as copied")
    run_cell(ip, f"theirs = {model}.predict({probe}, verbose=0)\n"
                 f"mine = copied.predict({probe}, verbose=0)")
    assert report.max_abs_diff is not None and report.max_abs_diff < 1e-5
    np.testing.assert_allclose(ip.user_ns["mine"], ip.user_ns["theirs"], atol=1e-5)


# examples/nlp/parameter_efficient_finetuning_of_gpt2_with_lora.py: the example's LoraLayer
# set on every block's attention by attribute (`_query_dense`, `_value_dense`); the config
# describes the model without them.
GPT2_LORA = """
import math, keras_hub
VOCAB, LENGTH = 64, 8
rs = np.random.RandomState(0)
token_ids = rs.randint(1, VOCAB, (21, LENGTH)).astype("int32")
features = {"token_ids": token_ids, "padding_mask": np.ones_like(token_ids, bool)}
labels = np.roll(token_ids, -1, axis=1)

class LoraLayer(keras.layers.Layer):
    def __init__(self, original_layer, rank=8, alpha=32, trainable=False, **kwargs):
        config = original_layer.get_config()
        kwargs.pop("name", None)
        super().__init__(name=config["name"], trainable=trainable, **kwargs)
        self.rank, self._scale = rank, alpha / rank
        self.original_layer = original_layer
        self.original_layer.trainable = False
        self.A = keras.layers.Dense(units=rank, use_bias=False, trainable=trainable,
                                    kernel_initializer=keras.initializers.VarianceScaling(
                                        scale=math.sqrt(5), mode="fan_in",
                                        distribution="uniform"))
        self.B = keras.layers.EinsumDense(equation=config["equation"],
                                          output_shape=config["output_shape"],
                                          kernel_initializer="zeros", trainable=trainable)

    def call(self, inputs):
        original_output = self.original_layer(inputs)
        if self.trainable:
            return original_output + self.B(self.A(inputs)) * self._scale
        return original_output
"""


def test_sync_copies_gpt2_with_lora_layers_set_by_attribute(ip):
    run_cell(ip, imports() + GPT2_LORA)
    train(ip, """
backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                         hidden_dim=16, intermediate_dim=32,
                                         max_sequence_length=LENGTH, dropout=0.0)
lora_model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
attention = backbone.get_layer("transformer_layer_0")._self_attention_layer
attention._tracker.unlock()
attention._query_dense = LoraLayer(attention._query_dense, rank=2, trainable=True)
attention._value_dense = LoraLayer(attention._value_dense, rank=2, trainable=True)
attention._tracker.lock()
lora_model({k: v[:1] for k, v in features.items()})
lora_model.compile(optimizer=keras.optimizers.Adam(1e-2),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
lora_model.fit(features, labels, batch_size=8, epochs=1, verbose=0)
""")
    synced_predicts_as_the_model(ip, "lora_model", "{k: v[:5] for k, v in features.items()}")


# examples/vision/image_classification_with_vision_transformer.py: PatchEncoder's __init__
# takes no **kwargs and its get_config leaves out projection_dim; Patches has none at all.
VIT = """
images = np.random.RandomState(0).rand(45, 8, 8, 3).astype("float32")
classes = np.random.RandomState(1).randint(0, 4, 45)

class Patches(keras.layers.Layer):
    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def call(self, images):
        shape = keras.ops.shape(images)
        patches = keras.ops.image.extract_patches(images, size=self.patch_size)
        rows, columns = shape[1] // self.patch_size, shape[2] // self.patch_size
        return keras.ops.reshape(patches, (shape[0], rows * columns,
                                           self.patch_size * self.patch_size * shape[-1]))

class PatchEncoder(keras.layers.Layer):
    def __init__(self, num_patches, projection_dim):
        super().__init__()
        self.num_patches = num_patches
        self.projection = keras.layers.Dense(units=projection_dim)
        self.position_embedding = keras.layers.Embedding(input_dim=num_patches,
                                                         output_dim=projection_dim)

    def call(self, patch):
        positions = keras.ops.expand_dims(keras.ops.arange(0, self.num_patches, 1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)

    def get_config(self):
        config = super().get_config()
        config.update({"num_patches": self.num_patches})
        return config
"""
VIT_CELL = """
inputs = keras.Input(shape=(8, 8, 3))
encoded = PatchEncoder(4, 8)(Patches(4)(inputs))
x1 = keras.layers.LayerNormalization(epsilon=1e-6)(encoded)
attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x1, x1)
x2 = keras.layers.Add()([attention, encoded])
representation = keras.layers.Flatten()(keras.layers.LayerNormalization(epsilon=1e-6)(x2))
vit = keras.Model(inputs, keras.layers.Dense(4)(representation))
vit.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
history = vit.fit(images, classes, batch_size=16, epochs=1, shuffle=False, verbose=0)
"""


def test_sync_copies_a_vision_transformer_whose_layers_take_no_config(ip):
    run_cell(ip, imports() + VIT)
    train(ip, VIT_CELL)
    synced_predicts_as_the_model(ip, "vit", "images[:7]")


# examples/structured_data/collaborative_filtering_movielens.py: RecommenderNet, a subclassed
# model with no get_config; here its __init__ also takes the regularizer object the example
# builds inline (an argument Keras cannot serialize).
RECOMMENDER = """
pairs = np.stack([np.random.RandomState(0).randint(0, 30, 203),
                  np.random.RandomState(1).randint(0, 50, 203)], 1)
ratings = np.random.RandomState(2).uniform(0, 1, 203).astype("float32")

class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, regularizer, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = keras.layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=regularizer)
        self.user_bias = keras.layers.Embedding(num_users, 1)
        self.movie_embedding = keras.layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=regularizer)
        self.movie_bias = keras.layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        dot = keras.ops.sum(user_vector * movie_vector, axis=1, keepdims=True)
        x = dot + self.user_bias(inputs[:, 0]) + self.movie_bias(inputs[:, 1])
        return keras.ops.sigmoid(x)
"""


def test_sync_copies_a_subclassed_recommender_with_unserializable_arguments(ip):
    run_cell(ip, imports() + RECOMMENDER)
    train(ip, """
model = RecommenderNet(30, 50, 8, keras.regularizers.l2(1e-6))
model.compile(loss=keras.losses.BinaryCrossentropy(),
              optimizer=keras.optimizers.Adam(learning_rate=0.01))
history = model.fit(pairs, ratings, batch_size=32, epochs=1, shuffle=False, verbose=0)
""")
    synced_predicts_as_the_model(ip, "model", "pairs[:9]")


# -- class 4 on JAX: values made on the mesh read in a later plain cell ------------------------

def test_hyperparameters_read_in_a_later_plain_cell_are_plain_numbers(ip):
    # guides/training_with_built_in_methods.py reads the schedule's rate after training;
    # on JAX the optimizer's variables live on the 8 devices
    cell = DENSE.replace("keras.optimizers.Adam(0.01)", "keras.optimizers.Adam(\n"
                         "    keras.optimizers.schedules.ExponentialDecay(0.01, 4, 0.9))") + \
        "model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)\n"
    read = ("rate = float(model.optimizer.learning_rate)\n"
            "steps = int(model.optimizer.iterations)\n"
            "kernel = float(model.layers[0].kernel[0, 0])\n")
    plain = plainly(ROWS, cell)
    exec(read, plain)
    run_cell(ip, imports() + ROWS)
    train(ip, cell)
    run_cell(ip, read)
    for name in ("rate", "steps", "kernel"):
        assert type(ip.user_ns[name]) is type(plain[name])
        assert ip.user_ns[name] == pytest.approx(plain[name], rel=1e-5), name


# -- class 7: a reloaded model predicts what the trained one does --------------------------------

# guides/serialization_and_saving.py: fit (in a training cell), then save as .keras, load, and
# the guide's own check `np.testing.assert_allclose(model.predict(test_input),
# reconstructed_model.predict(test_input))` (rtol 1e-7), in the next cell, as a notebook has it.
SAVED = """
def get_model():
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(), loss="mean_squared_error")
    return model

test_input = np.random.RandomState(0).random((128, 32))
test_target = np.random.RandomState(1).random((128, 1))
"""
RELOADED = """
model.save({path!r})
reconstructed_model = keras.models.load_model({path!r})
predicted = model.predict(test_input, verbose=0)
reloaded = reconstructed_model.predict(test_input, verbose=0)
np.testing.assert_allclose(predicted, reloaded)
"""


def test_a_reloaded_model_predicts_what_the_trained_one_does_to_rtol_1e_7(ip, tmp_path):
    fit = "model = get_model()\nmodel.fit(test_input, test_target, shuffle=False, verbose=0)\n"
    plain, ours, _ = both(ip, SAVED, fit)
    reloaded = RELOADED.format(path=str(tmp_path / "my_model.keras"))
    exec(reloaded, plain)
    run_cell(ip, reloaded)  # the guide's own assert_allclose, in a plain cell
    np.testing.assert_allclose(ours["predicted"], plain["predicted"], rtol=1e-6)


# -- what the magic adds leaves the notebook's random state as plain Keras leaves it -------------

# A seeded notebook builds the same weights every run: neither the first-step check (its
# one-device copy) nor placing a model made in an earlier cell may draw from Keras's global
# random state (on TensorFlow both did: tests/training/test_cell_safety.py).
def test_layers_built_after_the_check_and_a_placed_model_start_as_in_plain_keras(ip):
    setup = ROWS + DENSE.replace("model =", "base =").replace("model.", "base.")
    first = ("base.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)\n"
             "inputs = keras.Input(shape=(8,))\nhead = keras.layers.Dense(3)\n"
             "joined = keras.Model(inputs, head(base(inputs)))\n"
             "initial = head.get_weights()[0]\n")
    later = ("later = keras.layers.Dense(3)\nlater.build((None, 8))\n"
             "after = later.get_weights()[0]\n")
    plain = plainly(setup, first)
    exec(later, plain)
    run_cell(ip, imports() + setup)
    train(ip, first)  # base placed on the devices, then checked at its first step
    train(ip, later)
    np.testing.assert_array_equal(ip.user_ns["initial"], plain["initial"])
    np.testing.assert_array_equal(ip.user_ns["after"], plain["after"])


# -- the rule: a failure in any step tpu_magic adds is a note, never an error ---------------------

def _backend_method(name):
    def patch(monkeypatch, ip, calls):
        import tpu_magic

        backend = type(tpu_magic.session().backend)
        return inject(monkeypatch, backend, name, calls, name)
    return patch


def _training(owner, attribute=None):
    """A function (`owner`) or a class's method (`owner.attribute`) of tpu_magic.training,
    wherever it is defined now."""
    def patch(monkeypatch, ip, calls):
        module = defining(owner)
        target = module if attribute is None else getattr(module, owner)
        return inject(monkeypatch, target, attribute or owner, calls,
                      f"{owner}.{attribute}" if attribute else owner)
    return patch


# (the step, how its failure is injected, the %%tpu_train line, whether the model is built
# in an earlier plain cell)
STEPS = {
    "first-step check: the state before the step": (_backend_method("step_state"), "", False),
    "first-step check: the setup's key": (_training("setup_key"), "", False),
    "memory plan": (_backend_method("step_memory"), " --plan-for v5e-8", False),
    "FLOPs counting": (_training("FlopCounts", "_planned"), "", False),
    # --shard auto's plan counts no FLOPs: the model's gradient is lowered to count them
    "FLOPs counting by lowering the gradient": (_backend_method("training_flops"),
                                                " --shard auto", False),
    "end-of-cell namespace pass": (_backend_method("built_for"), "", False),
    "rewrap of a model built outside the cell": (_backend_method("place"), "", True),
    "the report": (_training("CellRecord", "report"), "", False),
    "the fit's outcome in the report": (_training("FitOutcome", "of"), "", False),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_failure_in_a_step_tpu_magic_adds_leaves_the_cells_result_plain_keras(
        ip, monkeypatch, step):
    patch, line, outside = STEPS[step]
    # a width of its own: a setup the notebook compared before is not compared again
    model = DENSE.replace("Dense(16", f"Dense({21 + list(STEPS).index(step)}")
    setup, cell = (ROWS + model, FIT) if outside else (ROWS, model + FIT)
    plain = plainly(setup, cell)
    run_cell(ip, imports() + setup)
    calls: list = []
    patched = patch(monkeypatch, ip, calls)
    try:
        train(ip, cell, "--no-progress" + line)
    except Injected as exc:
        raise AssertionError(f"{patched} failing broke the cell: {exc}") from None
    assert calls, f"{patched} was never called: the injection no longer reaches {step}"
    monkeypatch.undo()
    same_results(plain, ip.user_ns)
