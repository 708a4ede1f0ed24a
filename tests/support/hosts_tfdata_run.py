"""A tf.data cell on several hosts against one process, in a JAX process where TensorFlow can
be imported (Kaggle's TPU image: JAX with tensorflow-cpu), for tests/test_jax.py.

    python hosts_tfdata_run.py

Run without KERAS_BACKEND (tpu_magic chooses; `--backend jax` is named). The cell trains on
one process of 8 simulated devices, then on `--simulate 2x4` (two ipyparallel engines of 4
devices each); prints one JSON line: both runs' histories and evaluations.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

from support.data import DIGITS, IMAGES  # noqa: E402
from support.shell import testing_shell  # noqa: E402

DATA = "import numpy as np, keras\n" + DIGITS + IMAGES

# a shuffled training set (seeded, reshuffled each epoch), 203 = 6 x 32 + 11: a short last
# batch; validation and evaluate from a second dataset; an unseeded cell's model
CELL = """
import tensorflow as tf
keras.utils.set_random_seed(0)
cnn = keras.Sequential([keras.Input((16, 16, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                        keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                        keras.layers.Dense(10, activation="softmax")])
cnn.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
train = (tf.data.Dataset.from_tensor_slices((images[:203], y[:203]))
         .shuffle(203, seed=7).map(lambda a, b: (a * 2.0 - 1.0, b)).batch(32))
held = tf.data.Dataset.from_tensor_slices((images[203:316] * 2.0 - 1.0, y[203:316])).batch(32)
history = cnn.fit(train, epochs=2, validation_data=held, verbose=0)
evaluation = cnn.evaluate(held, return_dict=True, verbose=0)
"""


def main() -> None:
    shell = testing_shell()
    found = {}
    for name, line in (("one", "--backend jax --simulate 8"),
                       ("hosts", "--backend jax --simulate 2x4")):
        shell.run_line_magic("tpu_connect", line + " --no-panel")
        shell.run_cell(DATA)
        report = shell.run_cell_magic("tpu_train", "--no-progress", CELL)
        found[name] = {"history": report.history.history, "evaluation": report.evaluations[0],
                       "replicas": report.replicas, "notes": report.notes}
    shell.run_line_magic("tpu_connect", "--backend jax --simulate 8 --no-panel")  # stops them
    print(json.dumps(found, default=float))


if __name__ == "__main__":
    main()
