"""Three fits of one model on a mesh of one JAX device, in a process of its own.

    python one_device_run.py OUT.json --way magic|plain

Run with `PYTHONPATH=tests/without_tensorflow` (no TensorFlow, as on Colab's TPU image) and
`TPU_MAGIC_COMPILE_CACHE` set to an empty directory (every program compiles). `magic`: a
`%%tpu_train` cell builds and fits the model (`%tpu_connect --simulate 1`), two more cells
fit it again. `plain`: the same fits in plain Keras on the one CPU device, no distribution.
Writes each fit's losses and how many XLA programs each fit compiled to OUT.json.
test_step_types.py runs it both ways.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

DATA = """
import numpy as np, keras
rng = np.random.default_rng(3)
x = rng.random((512, 20), dtype=np.float32)
y = rng.integers(0, 4, 512).astype("int32")
"""
BUILD = """
keras.utils.set_random_seed(7)
model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(4, activation="softmax")])
model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""
FIT = "history = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--way", choices=("magic", "plain"), required=True)
    args = parser.parse_args()
    if args.way == "plain":
        os.environ["KERAS_BACKEND"] = "jax"
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
    else:
        from support.shell import testing_shell

        shell = testing_shell()
        shell.run_line_magic("tpu_connect", "--simulate 1 --backend jax --no-panel")
    import jax

    compiled = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kwargs: compiled.__setitem__(0, compiled[0] + 1)
        if event.endswith("backend_compile_duration") else None)
    shell.run_cell(DATA).raise_error()
    losses, compiles = [], []
    for cell in (BUILD + FIT, FIT, FIT):
        before = compiled[0]
        if args.way == "magic":
            shell.run_cell_magic("tpu_train", "--no-progress", cell)
        else:
            shell.run_cell(cell).raise_error()
        compiles.append(compiled[0] - before)
        losses.append([float(v) for v in shell.user_ns["history"].history["loss"]])
    Path(args.out).write_text(json.dumps({
        "losses": losses, "compiles": compiles, "devices": len(jax.devices()),
        "tensorflow_imported": "tensorflow" in sys.modules}))


if __name__ == "__main__":
    main()
