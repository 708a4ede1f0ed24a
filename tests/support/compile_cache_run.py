"""One notebook session on the JAX backend in a process of its own, for the compilation cache.

    python compile_cache_run.py OUT.json [--simulate N] [--size SMALL|CNN]

Run with `PYTHONPATH=tests/without_tensorflow` (no TensorFlow, as on Colab's TPU image)
and `TPU_MAGIC_COMPILE_CACHE=DIR`. It connects, trains one `%%tpu_train` cell and writes
the report's timings and JAX's compile counts to OUT.json. Two runs against one DIR:
the second loads the programs the first compiled. test_compile_cache.py and
benchmarks/bench_compile_cache.py run it.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

from support.shell import testing_shell  # noqa: E402

MODELS = {
    # a few layers, quick to compile: the test's
    "small": """
model = keras.Sequential([keras.Input((16, 16, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                          keras.layers.Dense(10, activation="softmax")])
""",
    # the seeds' CIFAR-10 CNN: the benchmark's
    "cnn": """
model = keras.Sequential([
    keras.Input((16, 16, 1)), keras.layers.BatchNormalization(),
    keras.layers.Conv2D(32, 3, padding="same", activation="elu"),
    keras.layers.Conv2D(32, 3, padding="same", activation="elu"),
    keras.layers.MaxPooling2D(), keras.layers.Dropout(0.25),
    keras.layers.Conv2D(64, 3, padding="same", activation="elu"),
    keras.layers.Conv2D(64, 3, padding="same", activation="elu"),
    keras.layers.MaxPooling2D(), keras.layers.Dropout(0.25),
    keras.layers.Flatten(), keras.layers.Dense(512, activation="elu"), keras.layers.Dropout(0.5),
    keras.layers.Dense(10, activation="softmax"),
])
""",
}
DATA = """
import numpy as np, keras
rng = np.random.default_rng(0)
images = rng.random((512, 16, 16, 1), dtype=np.float32)
labels = rng.integers(0, 10, 512).astype("int32")
"""
FIT = """
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(images, labels, batch_size=64, epochs=1)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--simulate", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    args = parser.parse_args()
    start = time.perf_counter()
    shell = testing_shell()
    connected = shell.run_line_magic("tpu_connect", f"--simulate {args.simulate} --no-panel")
    shell.run_cell(DATA)
    report = shell.run_cell_magic("tpu_train", "--no-progress", MODELS[args.model] + FIT)
    xla = report.xla_compile
    Path(args.out).write_text(json.dumps({
        "backend": connected.backend,
        "tensorflow_imported": "tensorflow" in sys.modules,
        "notes": list(connected.notes),
        "first_step_seconds": report.compile_seconds,
        "hits": xla.hits, "misses": xla.misses, "xla_compile_seconds": xla.seconds,
        "summary": report.summary(),
        "process_seconds": time.perf_counter() - start,
    }))


if __name__ == "__main__":
    main()
