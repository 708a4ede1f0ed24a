"""What each step trains on, and the random state a fit leaves, beside plain Keras, in a JAX
process of its own where TensorFlow can be imported (Kaggle's image: JAX with
tensorflow-cpu), for tests/training/inputs/test_reads_as_plain_keras.py.

    python reads_run.py DEVICES

Keras on JAX over DEVICES simulated CPU devices (`%tpu_connect --simulate DEVICES`, 1: one
device). Every fit of the grid (an input kind, `steps_per_epoch`, K, `initial_epoch`,
`validation_steps` and `validation_freq`) runs in plain Keras at one step an execution and
through `%%tpu_train`; a layer records the largest row index of every batch each training
and validation step sees, in order. Then each input kind's fit of `support.random_states`
beside plain Keras. Prints one JSON line: the fits whose steps differ, with both records,
and the input kinds whose random state differs.
"""

import itertools
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

from support.random_states import DATA, INPUTS, TF_INPUTS, fit_cell, states  # noqa: E402
from support.same import imports, plainly  # noqa: E402
from support.shell import testing_shell  # noqa: E402

RECORDER = """
import numpy as np, keras, tensorflow as tf
from keras import ops

class Recorder(keras.layers.Layer):
    # the largest row index of each batch it sees: `trained` in training, `checked` else
    def build(self, shape):
        self.trained = self.add_weight(shape=(400,), initializer="zeros", trainable=False)
        self.checked = self.add_weight(shape=(400,), initializer="zeros", trainable=False)
        self.at = self.add_weight(shape=(2,), initializer="zeros", trainable=False,
                                  dtype="int32")

    def call(self, x, training=False):
        which, record = (0, self.trained) if training else (1, self.checked)
        at = self.at[which]
        record.assign(ops.scatter_update(record, ops.reshape(at, (1, 1)),
                                         ops.reshape(ops.max(x[:, 0]), (1,))))
        self.at.assign(ops.scatter_update(self.at, [[which]], ops.reshape(at + 1, (1,))))
        return x

rows = (np.arange(320, dtype="float32") + 1)[:, None]  # 40 batches of 8, each row its index
targets = np.zeros((320, 1), "float32")

class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return rows[i * 8:(i + 1) * 8], targets[i * 8:(i + 1) * 8]

def endless():
    while True:
        for i in range(40):
            yield rows[i * 8:(i + 1) * 8], targets[i * 8:(i + 1) * 8]

def recorded():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((1,)), Recorder(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-4), "mse")
    return model
"""

# an input kind: (its argument to fit, whether it ends: a pass of 40 batches)
KINDS = {
    "arrays": ("rows, targets, batch_size=8, shuffle=False", True),
    "arrays, a short last batch": ("rows[:316], targets[:316], batch_size=8, shuffle=False", True),
    "arrays shuffled": ("rows, targets, batch_size=8", True),
    "tf.data": ("tf.data.Dataset.from_tensor_slices((rows, targets)).batch(8)", True),
    "tf.data repeated": ("tf.data.Dataset.from_tensor_slices((rows, targets)).batch(8).repeat()",
                         False),
    "PyDataset": ("Batches(), shuffle=False", True),
    "generator": ("endless()", False),
}
STEPS_PER_EPOCH = (None, 7, 29, 40, 50)
EXECUTIONS = ("", "--steps-per-execution 3", "--steps-per-execution 6")
# (initial_epoch, validation_steps, validation_freq), taken in turn
VARIATIONS = ((0, None, 1), (1, 2, 2), (0, 3, 1), (2, None, 2))


def grid() -> list:
    found = []
    for n, (kind, spe, line) in enumerate(itertools.product(KINDS, STEPS_PER_EPOCH, EXECUTIONS)):
        argument, ends = KINDS[kind]
        if spe is None and not ends:
            continue  # an endless input needs its steps
        initial, validation_steps, freq = VARIATIONS[n % len(VARIATIONS)]
        found.append((kind, spe, line, (
            f"model.fit({argument}, epochs=4, initial_epoch={initial}, steps_per_epoch={spe}, "
            "validation_data=(rows[:40], targets[:40]), validation_batch_size=8, "
            f"validation_steps={validation_steps}, validation_freq={freq}, verbose=0)")))
    return found


def records(model) -> tuple:
    import numpy as np

    layer = model.layers[0]
    trained, checked = np.asarray(layer.at).tolist()
    return (np.asarray(layer.trained)[:trained].tolist(),
            np.asarray(layer.checked)[:checked].tolist())


def main() -> None:
    devices = int(sys.argv[1])
    warnings.simplefilter("ignore")
    shell = testing_shell()
    shell.run_line_magic("tpu_connect", f"--backend jax --simulate {devices} --no-panel")
    shell.run_cell(RECORDER).raise_error()
    plain_namespace: dict = {}
    exec(RECORDER, plain_namespace)
    differ = []
    for kind, spe, line, fit in grid():
        exec("model = recorded()\n" + fit, plain_namespace)
        theirs = records(plain_namespace["model"])
        shell.run_cell("model = recorded()").raise_error()
        try:
            shell.run_cell_magic("tpu_train", f"--no-progress {line}", fit)
            mine = records(shell.user_ns["model"])
        except Exception as exc:  # noqa: BLE001 - an error the magic adds is a difference too
            mine = f"{type(exc).__name__}: {exc}"
        if mine != theirs:
            differ.append({"fit": fit, "line": line, "plain": theirs, "magic": mine})
    random_states = {}
    for kind, (setup, arguments) in {**INPUTS, **TF_INPUTS}.items():
        plainly(DATA + setup, fit_cell(arguments))
        theirs = states()
        shell.run_cell(imports() + DATA + setup).raise_error()
        try:
            shell.run_cell_magic("tpu_train", "--no-progress", fit_cell(arguments))
            mine = states()
        except Exception as exc:  # noqa: BLE001 - an error the magic adds is a difference too
            mine = f"{type(exc).__name__}: {exc}"
        if mine != theirs:
            random_states[kind] = {"plain": theirs, "magic": mine}
    print(json.dumps({"fits": len(grid()), "differ": differ, "random_states": random_states}))


if __name__ == "__main__":
    main()
