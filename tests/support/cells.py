"""The models and notebook cells the tests run, each defined once, and `train`.

Cells are source text: they run in the test shell's namespace (after a data cell of
`support.data`), as a notebook's would. `dense_model` builds DENSE's model in the test's own
process, outside every strategy, as a reference.
"""

# the digits' small classifier (64 pixels in, 10 classes out): the TF suite's model
DENSE_MODEL = """keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])"""

DENSE = f"""
keras.utils.set_random_seed(1)
model = {DENSE_MODEL}
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
"""

# DENSE's fit on 256 rows, one epoch
FIT_256 = "history = model.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0)"

# DENSE's model under Adam, as the checkpoint tests train it
ADAM = f"""
keras.utils.set_random_seed(3)
model = {DENSE_MODEL}
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
"""

# six epochs of DENSE's model under Adam: support/checkpoint_run.py trains it in a process that is
# killed and resumed, test_faults.py in its own process straight through
SIX_EPOCHS = f"""
keras.utils.set_random_seed(3)
model = {DENSE_MODEL}
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
model.fit(x[:600], y[:600], batch_size=64, epochs=6, verbose=0)
"""

# the JAX suite's seed CNN on `support.data.IMAGES`: BatchNormalization and Dropout
CNN = """
keras.utils.set_random_seed(0)
cnn = keras.Sequential([
    keras.Input((16, 16, 1)),
    keras.layers.BatchNormalization(),
    keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Flatten(),
    keras.layers.Dropout(0.25),
    keras.layers.Dense(10, activation="softmax"),
])
cnn.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""

# a model worth laying out over a mesh (--shard model): its embedding and kernels are split
SHARDED = """
keras.utils.set_random_seed(5)
tokens = np.random.RandomState(0).randint(0, 1024, (203, 16))
targets = np.random.RandomState(1).randint(0, 1024, (203, 16))
inputs = keras.Input((16,), dtype="int32")
hidden = keras.layers.Embedding(1024, 512)(inputs)
hidden = keras.layers.MultiHeadAttention(num_heads=8, key_dim=64)(hidden, hidden)
hidden = keras.layers.Dense(1024, activation="relu")(hidden)
sharded = keras.Model(inputs, keras.layers.Dense(1024)(hidden))
sharded.compile(keras.optimizers.SGD(0.05),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = sharded.fit(tokens, targets, batch_size=32, epochs=2, shuffle=False, verbose=0)
"""


def dense_model():
    """DENSE's model, uncompiled and fresh, built in this process outside every strategy."""
    import keras  # here: the JAX suite imports this module before Keras's backend is chosen

    return eval(DENSE_MODEL, {"keras": keras})


def train(ip, cell, line="--no-progress"):
    """Runs `cell` through `%%tpu_train LINE` in the test shell. Returns the report."""
    return ip.run_cell_magic("tpu_train", line, cell)


def let_go_is_collected(ip) -> bool:
    """DENSE trained in a cell (its report kept, as IPython's `Out` keeps a cell's value),
    then the notebook lets the model go (`del`, or a cell run again assigning `model`):
    whether the model was collected, as plain Keras's is. (The workspace and the report's
    `History` held it: a cell run again kept the old model's device memory beside the new.)"""
    import gc

    kept = train(ip, DENSE + FIT_256)
    ip.run_cell("import weakref as _weakref\n_gone = _weakref.ref(model)\ndel model, history")
    gc.collect()
    collected = ip.user_ns.pop("_gone")() is None
    del kept
    return collected


def a_fit_near_the_map_limit(ip, monkeypatch):
    """A model trained in a plain cell, then let go (`del`) with Python's cycle collector
    paused (a long session's oldest generation seldom runs): its compiled programs stay
    mapped. Then a `%%tpu_train` fit with the process's memory maps read as past the share
    where a fit collects first and where it warns (`core.host_maps`). Returns whether the
    model let go was freed before that fit, whether it was still there after the `del`
    (the precondition: only the collector frees it), and whether the fit warned of the
    maps with what to do."""
    import gc

    from tpu_magic.core import host_maps

    ip.run_cell(DENSE + FIT_256)
    gc.collect()
    gc.disable()
    try:
        ip.run_cell("import weakref as _weakref\n_gone = _weakref.ref(model)\ndel model, history")
        held = ip.user_ns["_gone"]() is not None
        monkeypatch.setattr(host_maps, "COLLECT_AT", 0.0)
        monkeypatch.setattr(host_maps, "WARN_AT", 0.0)
        report = train(ip, "_alive = _gone() is not None\n" + DENSE + FIT_256 +
                       "\n_after = _gone() is not None")
    finally:
        gc.enable()
    # `_alive`: before the fit's relief; `_after`: after it
    freed = ip.user_ns.pop("_alive") and not ip.user_ns.pop("_after")
    ip.user_ns.pop("_gone")
    warned = any("memory maps" in note and "del model" in note for note in report.notes)
    return freed, held, warned


def traced_steps_kept(ip):
    """DENSE fit in one cell, again in a second, then with its first layer frozen (and the
    model compiled again, as Keras asks) in a third. Returns whether the second cell ran the
    step function the first traced (the metrics and optimizer slots the first fit built
    change nothing), and whether the third trained on a new one that left the frozen layer
    as it was."""
    fit = "model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)"
    train(ip, DENSE + fit)
    model = ip.user_ns["model"]
    first = _traced(model)
    train(ip, fit)
    kept = _traced(model) is first
    frozen = [w.copy() for w in model.layers[0].get_weights()]
    train(ip, "model.layers[0].trainable = False\n"
              "model.compile(keras.optimizers.SGD(0.1), 'sparse_categorical_crossentropy')\n" + fit)
    still = all((a == b).all() for a, b in zip(frozen, model.layers[0].get_weights()))
    return kept, _traced(model) is not first and still


def _traced(model):
    """What runs the model's train steps: Keras's traced `train_function` (TensorFlow), or
    the compiled programs tpu_magic keeps for it (JAX, `backends/jax/loop/programs.py`)."""
    import keras

    from tpu_magic.core import record

    if keras.backend.backend() == "jax":
        return record.of(model).programs
    return model.train_function


# a model class with its own `fit` that prepares its inputs, then calls Keras's, as a
# KerasHub task's does (strings to token batches): it counts its calls
PREPARING = """
class Preparing(keras.Sequential):
    prepared = 0

    def fit(self, x=None, y=None, **kwargs):
        type(self).prepared += 1
        return super().fit(x / 16.0, y, **kwargs)

keras.utils.set_random_seed(1)
model = Preparing([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
"""


def overrides_kept(ip):
    """PREPARING's model fit in a cell, then in a plain cell, then in another cell. Returns
    how many times its own `fit` ran, and how many fits the last cell's report counted (its
    `super().fit` reached the magic)."""
    fit = "model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)\n"
    train(ip, PREPARING + fit)
    ip.run_cell(fit)
    report = train(ip, fit)
    return ip.user_ns["Preparing"].prepared, report.fits


# Grouped steps (K an execution) must keep what one step at a time computes: Dropout (the
# random streams), BatchNormalization (statistics that move), Adam; run on both backends
GROUPED_MODEL = """
keras.utils.set_random_seed(11)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dropout(0.3), keras.layers.BatchNormalization(),
                          keras.layers.Dense(5, activation="softmax")])
model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""


def grouped_data(rows: int) -> str:
    """GROUPED_MODEL's data cell: `rows` samples, labels and sample weights."""
    return f"""
import numpy as np, keras
rows = np.random.RandomState(0)
x = rows.rand({rows}, 16).astype("float32")
y = rows.randint(0, 5, {rows})
w = rows.rand({rows}).astype("float32")
"""


def grouped_fit(epochs: int) -> str:
    """A fit of GROUPED_MODEL with sample weights and validation (its own short batch: 100
    rows), then a prediction and an evaluation, each with a short last batch."""
    return (f"history = model.fit(x, y, sample_weight=w, batch_size=32, epochs={epochs}, "
            "shuffle=False, validation_data=(x[:100], y[:100]), verbose=0)\n"
            "rows_out = model.predict(x[:77], verbose=0)\n"
            "evaluation = model.evaluate(x[:300], y[:300], verbose=0, return_dict=True)\n")


# keras.metrics.F1Score's docstring default (average=None): one score per class, an array in
# plain Keras's evaluate results; run on both backends
PER_CLASS_DATA = """
rs = np.random.RandomState(20)
x = rs.rand(203, 10).astype("float32")
y = keras.utils.to_categorical(rs.randint(0, 3, 203), 3)
"""
PER_CLASS_EVALUATE = """
model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(3, activation="softmax")])
model.compile("adam", "categorical_crossentropy", metrics=[keras.metrics.F1Score()])
evaluation = model.evaluate(x, y, return_dict=True, verbose=0)
"""


# CIFAR-10-shaped images and labels (203 to train, 45 to test; int labels of shape (n, 1)),
# for the keras-io vision examples in tests/jax_backend/published/.
CIFAR_SHAPED = """
rs = np.random.RandomState(6)
x_train = rs.randint(0, 256, (203, 32, 32, 3)).astype("float32")
y_train = rs.randint(0, 10, (203, 1))
x_test = rs.randint(0, 256, (45, 32, 32, 3)).astype("float32")
y_test = rs.randint(0, 10, (45, 1))
"""
