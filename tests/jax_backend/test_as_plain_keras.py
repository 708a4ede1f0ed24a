"""Keras on JAX as users write it, each class of issue 30 beside plain Keras on one device,
and the first-step parity check that stands behind them all.

Classes: datasets read as plain Keras reads them (every batch once, in the dataset's order,
a first batch smaller or larger than the rest), the user's own `keras.distribution`, a model
whose trainable set or layers change after it trained, `*_on_batch` with any row count,
a layer adapted in an earlier plain cell. The parity check: silent on exact paths, and a
warning naming the cause where a fix is switched off (padding without masks, padding into
BatchNorm's statistics, a loss scaled by the replicas).
"""

import re
import pytest

from support.cells import CNN, train
from support.same import both, run_cell, same_history, same_values, same_weights

DENSE = """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""
ROWS = """
x = np.random.RandomState(0).rand(203, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 3, 203)
"""


# -- class 1: datasets -----------------------------------------------------------------------

STREAM = ROWS + """
class Stream(keras.utils.PyDataset):
    '''Ignores the index Keras asks for and reads on (a stream, as in FACTS.md): Keras's
    shuffle of the indices must not reorder it, nor read it twice.'''
    def __init__(self, sizes, **kwargs):
        super().__init__(**kwargs)
        self.sizes = sizes
        self.reset()
    def reset(self):
        self.start, self.calls = 0, 0
    def __len__(self):
        return len(self.sizes)
    def __getitem__(self, i):
        size = self.sizes[self.calls % len(self.sizes)]
        part = slice(self.start, self.start + size)
        self.start, self.calls = (self.start + size) % 203, self.calls + 1
        return x[part], y[part]
    def on_epoch_end(self):
        self.reset()
"""


@pytest.mark.parametrize("sizes", [[32] * 6 + [11], [5, 32, 32, 32, 32, 32, 32, 6],
                                   [64, 32, 32, 32, 32, 11]],
                         ids=["short-last", "small-first", "large-first"])
def test_a_stream_pydataset_is_read_once_in_order_as_plain_keras_reads_it(ip, sizes):
    plain, ours, report = both(ip, STREAM, DENSE + f"""
history = model.fit(Stream({sizes}), epochs=2, verbose=0)  # shuffle=True, Keras's default
evaluation = model.evaluate(Stream({sizes}), return_dict=True, verbose=0)
scores = model.predict(Stream({sizes}), verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    same_values(plain, ours, "scores")
    same_weights(plain, ours)
    assert ours["scores"].shape == (203, 3)


def test_a_grain_dataset_with_validation_and_a_lora_language_model_at_rate_0(ip):
    """KerasHub's task turns arrays into a grain dataset itself; at learning rate 0 its
    epoch loss is evaluate's of the same data, and plain Keras's (issue 30: 2.50022 was
    logged where evaluate and plain Keras gave 2.54977)."""
    plain, ours, _ = both(ip, """
import grain, keras_hub
rs = np.random.RandomState(0)
ids = rs.randint(1, 2048, (37, 17))
mask = np.ones((37, 16), bool)
mask[::3, 12:] = False
x = {"token_ids": ids[:, :-1] * mask, "padding_mask": mask}
y = ids[:, 1:] * mask
backbone = keras_hub.models.GemmaBackbone(vocabulary_size=2048, num_layers=2,
    num_query_heads=4, num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=8)
""", """
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
backbone.enable_lora(rank=4)
lm.compile(optimizer=keras.optimizers.Adam(0.0),
           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
           weighted_metrics=["accuracy"])
history = lm.fit(x, y, batch_size=8, epochs=1, verbose=0)
evaluation = lm.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)
validation = grain.MapDataset.source(list(range(37))).map(
    lambda i: ({"token_ids": x["token_ids"][i], "padding_mask": x["padding_mask"][i]}, y[i])
).batch(8)
history2 = lm.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=validation)
""")
    same_history(plain, ours)
    same_history(plain, ours, "history2")
    same_values(plain, ours, "evaluation")
    history = ours["history"].history
    assert history["loss"][0] == pytest.approx(ours["evaluation"]["loss"], rel=1e-5)


def test_a_one_shot_generator_is_read_once(ip):
    plain, ours, _ = both(ip, ROWS + """
def batches():
    for start in range(0, 203, 32):
        yield x[start:start + 32], y[start:start + 32]
""", DENSE + """
history = model.fit(batches(), epochs=2, verbose=0)  # the second epoch finds it used up
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# -- class 2: the user's own keras.distribution ----------------------------------------------

def test_a_distribution_the_user_sets_before_the_cell_wins_and_stays(ip, capsys):
    ip.run_cell("import jax\n"
                "mine = keras.distribution.DataParallel(devices=jax.devices()[:4])\n"
                "keras.distribution.set_distribution(mine)")
    try:
        report = train(ip, ROWS + DENSE + "history = model.fit(x, y, batch_size=32, verbose=0)")
        assert report.replicas == 4
        assert "the cell's own keras.distribution is in force" in capsys.readouterr().out
        run_cell(ip, "kept = keras.distribution.distribution() is mine\n"
                     "spread = len(model.weights[0].value.sharding.device_set)")
        assert ip.user_ns["kept"] and ip.user_ns["spread"] == 4
    finally:
        run_cell(ip, "keras.distribution.set_distribution(None)")


def test_a_distribution_scope_inside_the_cell_is_honoured(ip):
    plain, ours, _ = both(ip, ROWS, """
import jax
mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], jax.devices())
layouts = keras.distribution.LayoutMap(mesh)
layouts[".*hidden/kernel"] = (None, "model")  # 16 columns split 4 ways
with keras.distribution.ModelParallel(layout_map=layouts).scope():
""" + "\n".join("    " + line for line in (DENSE.replace("Dense(16,", "Dense(16, name='hidden',") + """
history = model.fit(x[:200], y[:200], batch_size=40, epochs=2, shuffle=False, verbose=0)
spec = tuple(model.layers[0].kernel.value.sharding.spec)
""").splitlines()))
    same_history(plain, ours)
    assert ours["spec"] == plain["spec"] == (None, "model")
    run_cell(ip, "after = keras.distribution.distribution()")
    assert ip.user_ns["after"] is None  # a scope ends with its block, as in plain Keras


# -- class 3: a model whose trainable set or layers change after it trained -------------------

def test_freezing_unfreezing_merging_and_swapping_after_training(ip):
    cell = ROWS + """
base = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu")])
model = keras.Sequential([base, keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
first = model.predict(x[:10], verbose=0)
"""
    after = """
base.trainable = False
frozen = model.predict(x[:10], verbose=0)
frozen_eval = model.evaluate(x, y, return_dict=True, verbose=0)
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
frozen_fit = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
base.trainable = True
model.layers[-1] = model.layers[-1]  # a layer set again by attribute
model.compile(keras.optimizers.Adam(0.001), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
unfrozen_fit = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
swapped = model.predict(x[:10], verbose=0)
"""
    plain, ours, _ = both(ip, "", cell)
    exec(after, plain)
    run_cell(ip, after)  # a plain cell: the adopted model keeps routing
    for name in ("first", "frozen", "frozen_eval", "swapped"):
        same_values(plain, ours, name)
    same_history(plain, ours, "frozen_fit")
    same_history(plain, ours, "unfrozen_fit")
    same_weights(plain, ours)


def test_a_second_fit_keeps_the_step_the_first_traced_and_its_losses(ip):
    """The optimizer's and the metrics' variables Keras builds in a model's first fit are
    the state its step was traced with: the next cell's fit runs that step, as plain Keras
    does (it had retraced and recompiled, 1.2 s of a Gemma LoRA cell), and its losses are
    bit for bit those of the same fit retraced."""
    setup = ROWS + DENSE.replace("model =", "kept =").replace("model.", "kept.") + \
        DENSE.replace("model =", "retraced =").replace("model.", "retraced.") + \
        "retraced.set_weights(kept.get_weights())\n"
    run_cell(ip, setup)
    train(ip, "kept.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)\n"
              "retraced.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)")
    run_cell(ip, "step = kept.train_function")
    report = train(ip, "again = kept.fit(x, y, batch_size=32, epochs=2, shuffle=False, "
                       "verbose=0)")
    assert ip.user_ns["kept"].train_function is ip.user_ns["step"]
    assert report.xla_compile is None or report.xla_compile.describe() is None
    run_cell(ip, "retraced.train_function = None")  # what the second fit did before
    train(ip, "twin = retraced.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)")
    assert ip.user_ns["again"].history == ip.user_ns["twin"].history


# -- class 4: *_on_batch with any row count ----------------------------------------------------

def test_the_on_batch_methods_take_any_row_count(ip):
    plain, ours, _ = both(ip, ROWS, DENSE + """
trained = [model.train_on_batch(x[:12], y[:12], return_dict=True) for _ in range(3)]
tested = model.test_on_batch(x[12:25], y[12:25], return_dict=True)
rows = model.predict_on_batch(x[25:30])
""")
    same_values(plain, ours, "trained")
    same_values(plain, ours, "tested")
    same_values(plain, ours, "rows")
    same_weights(plain, ours)


# -- class 5: a layer adapted in an earlier plain cell --------------------------------------------

def test_a_normalization_adapted_in_an_earlier_cell_is_placed_not_refused(ip, capsys):
    plain, ours, _ = both(ip, ROWS + """
x = x * 10 + 3
norm = keras.layers.Normalization()
norm.adapt(x)
augment = keras.Sequential([keras.layers.GaussianNoise(0.0)])
def head(inputs):
    return keras.layers.Dense(3, activation="softmax")(norm(augment(inputs)))
""", """
inputs = keras.Input((8,))
model = keras.Model(inputs, head(inputs))
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)
    out = capsys.readouterr().out
    assert "`norm` (Normalization)" in out and "now live on its 8 devices" in out


# -- the first-step parity check ------------------------------------------------------------

def test_the_check_is_silent_where_the_step_is_exact_and_says_so_in_the_report(ip, capsys):
    # the seeds' CNN: BatchNormalization, Dropout, a short last batch (203 = 6 x 32 + 11)
    report = train(ip, CNN + "cnn.fit(images[:203], y[:203], batch_size=32, verbose=0)",
                   "--no-progress --verify on")
    assert report.parity.agrees and report.parity.seconds > 0
    # the first execution: one step, or the first K where steps run K a dispatch
    assert re.search(r"first (step|\d+ steps) the same as on one device", report.summary())
    assert "differs from the same step on one device" not in capsys.readouterr().out
    off = train(ip, ROWS + DENSE + "model.fit(x, y, batch_size=32, epochs=1, verbose=0)",
                "--no-progress --verify off")
    assert off.parity is None


def _warned(ip, cell, capsys):
    report = train(ip, cell)
    out = capsys.readouterr().out
    assert report.parity is not None and not report.parity.agrees, report.parity
    assert "warning: the first distributed step differs from the same step on one device" in out
    return report.parity


def test_padding_without_its_masks_is_caught(ip, capsys, monkeypatch):
    from tpu_magic.training.inputs import exactness
    from tpu_magic.training.inputs import planning

    from tpu_magic.core.packed import WEIGHT, is_packed

    def masks_forgotten(model, replica_sum=None):
        """The fault: the padded rows' packed weight read as the user's weight alone, so
        the zeros appended to the batch count as samples."""
        if "_forgotten" in model.__dict__:
            return False
        plain_loss = type(model).compute_loss.__get__(model)

        def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
            if is_packed(sample_weight):
                sample_weight = sample_weight[WEIGHT]
            return plain_loss(x, y, y_pred, sample_weight, training=training)

        object.__setattr__(model, "compute_loss", compute_loss)
        object.__setattr__(model, "_forgotten", True)
        return True

    monkeypatch.setattr(planning, "pads", lambda model, connection: True)
    monkeypatch.setattr(exactness, "enable", masks_forgotten)
    parity = _warned(ip, ROWS + DENSE + "model.fit(x[:12], y[:12], batch_size=16, verbose=0)",
                     capsys)
    assert parity.likely.startswith("padding")


def test_padding_into_batchnorm_statistics_is_caught(ip, capsys, monkeypatch):
    from tpu_magic.training.inputs import planning

    monkeypatch.setattr(planning, "pads", lambda model, connection: True)
    parity = _warned(ip, ROWS + """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                          keras.layers.BatchNormalization(), keras.layers.Dense(3)])
model.compile(keras.optimizers.SGD(0.1),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x[:12], y[:12], batch_size=16, verbose=0)
""", capsys)
    assert parity.likely.startswith("padding")


def test_a_loss_scaled_by_the_replicas_is_caught(ip, capsys):
    # A custom step that scales its gradient when a distribution is in force (the pmap
    # habit of dividing by the device count, once too often): the loss agrees, the update
    # is 8 times one device's.
    parity = _warned(ip, ROWS + """
import jax

class Scaled(keras.Model):
    def train_step(self, state, data):
        trainable, fixed, optimizer_state, metrics_state = state
        x, y = data[0], data[1]
        def loss_of(trainable):
            out, fixed2 = self.stateless_call(trainable, fixed, x, training=True)
            loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, out))
            return loss, fixed2
        (loss, fixed), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        if keras.distribution.distribution() is not None:
            grads = [g * 8 for g in grads]
        trainable, optimizer_state = self.optimizer.stateless_apply(optimizer_state, grads,
                                                                    trainable)
        return {"loss": loss}, (trainable, fixed, optimizer_state, metrics_state)

inputs = keras.Input((8,))
model = Scaled(inputs, keras.layers.Dense(3, activation="softmax")(inputs))
model.compile(keras.optimizers.SGD(0.1))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
""", capsys)
    assert parity.likely.startswith("loss scaling")
    assert parity.update[0] == pytest.approx(8 * parity.update[1], rel=1e-3)


def test_the_same_setup_is_compared_once_a_notebook(ip):
    cell = ROWS + DENSE + "model.fit(x, y, batch_size=32, epochs=1, verbose=0)"
    train(ip, cell + "\nseen = 1")
    again = train(ip, cell)
    assert "agreed with one device earlier in this notebook" in again.parity.line()


def test_a_notebook_loss_edited_and_run_again_is_compared_again(ip, capsys):
    # A loss function was keyed by its name: this one, edited to scale itself once a
    # distribution is in force (the pmap habit, once too often) and run again, kept the
    # key of the version that agreed, and its loss and update were 8 times plain Keras's,
    # silently.
    def cell(scale):
        return ROWS + f"""
def my_loss(y_true, y_pred):
    scale = {scale}
    return scale * keras.losses.sparse_categorical_crossentropy(y_true, y_pred)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), my_loss)
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
"""
    train(ip, cell("1.0"))
    assert "agreed with one device earlier" in train(ip, cell("1.0")).parity.line()
    capsys.readouterr()
    parity = _warned(ip, cell("8.0 if keras.distribution.distribution() is not None else 1.0"),
                     capsys)
    loss = dict((key, (ours, theirs)) for key, ours, theirs in parity.logs)["loss"]
    assert loss[0] == pytest.approx(8 * loss[1], rel=1e-3)


def test_the_check_compares_a_lora_models_update(ip):
    # KerasHub's enable_lora freezes the backbone's blocks and keeps their LoRA layers
    # trainable: the adapters' update is compared, not read as frozen (it was: size 0 vs 0).
    report = train(ip, """
import keras_hub
rs = np.random.RandomState(0)
ids = rs.randint(1, 2048, (32, 17))
x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((32, 16), bool)}
y = ids[:, 1:]
backbone = keras_hub.models.GemmaBackbone(vocabulary_size=2048, num_layers=2,
    num_query_heads=4, num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=8)
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
backbone.enable_lora(rank=4)
lm.compile(optimizer=keras.optimizers.Adam(1e-3),
           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
lm.fit(x, y, batch_size=8, epochs=1, verbose=0)
""", "--no-progress --verify on")
    parity = report.parity
    assert parity.agrees, parity.warning()
    assert parity.update[0] > 0 and parity.update[0] == pytest.approx(parity.update[1], rel=1e-4)
