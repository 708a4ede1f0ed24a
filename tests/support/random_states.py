"""The notebook's random state, read without drawing from it: what a `%%tpu_train` cell must
leave exactly where plain Keras leaves it (NumPy's and Python's global generators, Keras's
global seed generator, and TensorFlow's global seed and op-seed counter where TensorFlow
is loaded). `INPUTS` are a fit's inputs of each kind, as cells."""

from __future__ import annotations

import hashlib
import random
import sys

import numpy as np


def states() -> dict:
    """Each global generator's state, as comparable values (nothing is drawn)."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    kind, keys, position, *_ = np.random.get_state()
    found = {"numpy": (hashlib.sha1(keys.tobytes()).hexdigest()[:12], int(position)),
             "python": hashlib.sha1(repr(random.getstate()).encode()).hexdigest()[:12]}
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    found["keras"] = None if generator is None else np.asarray(generator.state.value).tolist()
    if "tensorflow" in sys.modules:
        from tensorflow.python.eager import context

        eager = context.context()
        rng = getattr(eager, "_rng", None)
        found["tensorflow"] = (eager._seed, None if rng is None else
                               hashlib.sha1(repr(rng.getstate()).encode()).hexdigest()[:12])
    return found


# The data cell: 203 samples (a short last batch at 32), 16 features, 5 classes
DATA = """
rows = np.random.rand(203, 16).astype("float32")
labels = np.random.randint(0, 5, 203)
"""

# A model made in the cell (so plain Keras's first fit builds its metrics from a peeked
# batch), with Dropout (its own seed generator) and Adam
MODEL = """
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dropout(0.2), keras.layers.Dense(5, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""

_PY_DATASET = """
class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 7
    def __getitem__(self, i):
        return rows[i * 29:(i + 1) * 29], labels[i * 29:(i + 1) * 29]
"""

_GENERATOR = """
def batches():
    while True:
        for i in range(7):
            yield rows[i * 29:(i + 1) * 29], labels[i * 29:(i + 1) * 29]
"""

_TF_DATA = """
import tensorflow as tf
batches = tf.data.Dataset.from_tensor_slices((rows, labels)).shuffle(203).batch(32)
"""

# a fit's inputs by kind: (the cell that makes them, the fit's arguments)
INPUTS = {
    "arrays": ("", "rows, labels, batch_size=32, shuffle=False"),
    "arrays shuffled": ("", "rows, labels, batch_size=32"),
    "arrays shuffled in batches": ("", "rows, labels, batch_size=32, shuffle='batch'"),
    "PyDataset": (_PY_DATASET, "Batches()"),
    "PyDataset in order": (_PY_DATASET, "Batches(), shuffle=False"),
    "generator": (_GENERATOR, "batches(), steps_per_epoch=7"),
}
TF_INPUTS = {"tf.data": (_TF_DATA, "batches")}


def fit_cell(arguments: str, epochs: int = 2) -> str:
    """MODEL trained on `arguments` with validation arrays, then a draw as a later section
    of a notebook makes."""
    return (MODEL + f"history = model.fit({arguments}, epochs={epochs}, "
            "validation_data=(rows[:64], labels[:64]), verbose=0)\n")
