"""The whole cell a user waits for, beside plain Keras: a notebook's first training cell, the
same cell again, and the first cell after a kernel restart, each way in fresh processes.

    python benchmarks/bench_first_cell.py [--cells mlp,cnn,gemma] [--devices 1,8]
        [--rounds 2] [--json PATH]

Keras on JAX (TensorFlow blocked, as on Colab's TPU image). A cell, timed from its start to
its end, builds its model, compiles it, fits it and predicts, as a notebook's does:

- mlp: the README's cell: 60,000 MNIST-shaped rows (28x28, offline random pixels), Flatten,
  Dense 128 relu, Dense 10 softmax, Adam, batch 128, 2 epochs with 10,000 validation rows,
  then a 6-row predict;
- cnn: the tutorials' CIFAR CNN on 16x16x3 (Conv 32, Conv 32, pool, Conv 64, pool, Dense
  128, Dropout, Dense 10), 8,192 rows, batch 128, 2 epochs, validation, predict;
- gemma: a KerasHub `GemmaCausalLM` from a small config (4 layers, width 256, 8,192-word
  vocabulary), LoRA rank 4 built in the cell, 32 steps of 8 x 128 tokens, one epoch;
- convnet: keras-io's "Simple MNIST convnet" (examples/vision/mnist_convnet.py) as written
  (Conv 32, pool, Conv 64, pool, Flatten, Dropout 0.5, Dense 10; one-hot labels, batch 128,
  `validation_split=0.1`), on 12,000 MNIST-shaped rows (offline random pixels) for 1 epoch;
- bilstm: keras-io's "Bidirectional LSTM on IMDB" (examples/nlp/bidirectional_lstm_imdb.py):
  Embedding 20,000 x 128, two bidirectional LSTMs of 64, batch 32, validation data; 2,048
  reviews of 200 tokens (random ids) for 1 epoch, 512 for validation;
- bert: a KerasHub `BertTextClassifier` from a small config (2 layers, width 128, 4 heads,
  vocabulary 8,192), as its task compiles itself (no `compile` call), 512 sequences of 128
  tokens, batch 16, one epoch, then a predict;
- gemma2b: the same as gemma at Gemma-2B's shapes (18 layers, width 2,048, 8 heads of 256, one
  key-value head, feed-forward 16,384, 256,000-word vocabulary; random weights, float32),
  LoRA rank 4, 8 steps of 4 x 512 tokens: for an accelerator (`--devices 0`).

`--devices 0` runs on the machine's own devices (a GPU or TPU: `%tpu_connect --backend
jax`, plain Keras with no distribution on one, `DataParallel` on several).

Ways: `plain` (plain Keras; on 8 devices under `keras.distribution.DataParallel`, as a
user who learned it would write it) and `magic` (`%%tpu_train`, its defaults; on 8 devices
its first-step check on). Each round, each way runs two processes on one fresh
compilation-cache folder: the first (a new kernel: imports, `%load_ext` + `%tpu_connect` or
`import keras`, then the cell twice: `first` and `again`, a new model each time), the second
(`restart`: the cell once, after the same setup). Plain Keras leaves JAX's persistent cache
off, as it is by default; the magic turns it on. The rounds interleave the ways. Also
recorded: the setup's seconds, each cell's peak bytes of live device arrays on the fullest
device (sampled every two milliseconds, each buffer once), and the magic's report lines (compiles, K). Prints the medians and the
magic/plain ratios; writes JSON with every process's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("plain", "magic")
PHASES = ("first", "again", "restart")

DATA = {
    "mlp": """
rng = np.random.default_rng(0)
x_train = rng.random((60000, 28, 28), dtype=np.float32)
y_train = rng.integers(0, 10, 60000)
x_test, y_test = x_train[:10000], y_train[:10000]
""",
    "cnn": """
rng = np.random.default_rng(0)
x_train = rng.random((8192, 16, 16, 3), dtype=np.float32)
y_train = rng.integers(0, 10, 8192)
x_test, y_test = x_train[:2048], y_train[:2048]
""",
    "gemma": """
import keras_hub
rng = np.random.default_rng(0)
tokens = rng.integers(1, 8192, (256, 129)).astype("int32")
x_train = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((256, 128), bool)}
y_train = tokens[:, 1:]
""",
    "convnet": """
rng = np.random.default_rng(0)
x_train = rng.random((12000, 28, 28, 1), dtype=np.float32)
y_train = keras.utils.to_categorical(rng.integers(0, 10, 12000), 10)
x_test = x_train[:2000]
""",
    "bilstm": """
rng = np.random.default_rng(0)
x_train = rng.integers(0, 20000, (2048, 200))
y_train = rng.integers(0, 2, 2048)
x_val, y_val = rng.integers(0, 20000, (512, 200)), rng.integers(0, 2, 512)
x_test = x_val
""",
    "bert": """
import keras_hub
rng = np.random.default_rng(0)
x_train = {"token_ids": rng.integers(1, 8192, (512, 128)).astype("int32"),
           "segment_ids": np.zeros((512, 128), "int32"),
           "padding_mask": np.ones((512, 128), bool)}
y_train = rng.integers(0, 2, 512)
x_test = {key: value[:64] for key, value in x_train.items()}
""",
    "gemma2b": """
import keras_hub
rng = np.random.default_rng(0)
tokens = rng.integers(1, 256000, (32, 513)).astype("int32")
x_train = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((32, 512), bool)}
y_train = tokens[:, 1:]
""",
}

CELL = {
    "mlp": """
model = keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten(),
                          keras.layers.Dense(128, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=128, epochs=2, validation_data=(x_test, y_test),
          verbose=0)
model.predict(x_test[:6], verbose=0)
""",
    "cnn": """
layers = keras.layers
model = keras.Sequential([keras.Input((16, 16, 3)),
                          layers.Conv2D(32, 3, padding="same", activation="relu"),
                          layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(),
                          layers.Conv2D(64, 3, padding="same", activation="relu"),
                          layers.MaxPooling2D(), layers.Flatten(),
                          layers.Dense(128, activation="relu"), layers.Dropout(0.5),
                          layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=128, epochs=2, validation_data=(x_test, y_test),
          verbose=0)
model.predict(x_test[:6], verbose=0)
""",
    "gemma": """
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=8192, num_layers=4, num_query_heads=4, num_key_value_heads=1,
    hidden_dim=256, intermediate_dim=512, head_dim=64)
model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
model.backbone.enable_lora(rank=4)
model.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
model.fit(x_train, y_train, batch_size=8, epochs=1, verbose=0)
""",
    "convnet": """
layers = keras.layers
model = keras.Sequential([keras.Input(shape=(28, 28, 1)),
                          layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
                          layers.MaxPooling2D(pool_size=(2, 2)),
                          layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
                          layers.MaxPooling2D(pool_size=(2, 2)), layers.Flatten(),
                          layers.Dropout(0.5), layers.Dense(10, activation="softmax")])
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=128, epochs=1, validation_split=0.1, verbose=0)
model.predict(x_test[:6], verbose=0)
""",
    "bilstm": """
layers = keras.layers
inputs = keras.Input(shape=(None,), dtype="int32")
x = layers.Embedding(20000, 128)(inputs)
x = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(x)
x = layers.Bidirectional(layers.LSTM(64))(x)
outputs = layers.Dense(1, activation="sigmoid")(x)
model = keras.Model(inputs, outputs)
model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=32, epochs=1, validation_data=(x_val, y_val),
          verbose=0)
model.predict(x_test[:6], verbose=0)
""",
    "bert": """
backbone = keras_hub.models.BertBackbone(
    vocabulary_size=8192, num_layers=2, num_heads=4, hidden_dim=128, intermediate_dim=256,
    max_sequence_length=128)
model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                            preprocessor=None)
model.fit(x_train, y_train, batch_size=16, epochs=1, verbose=0)
model.predict({key: value[:6] for key, value in x_test.items()}, verbose=0)
""",
    "gemma2b": """
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=256000, num_layers=18, num_query_heads=8, num_key_value_heads=1,
    hidden_dim=2048, intermediate_dim=32768, head_dim=256)
model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
model.backbone.enable_lora(rank=4)
model.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
model.fit(x_train, y_train, batch_size=4, epochs=1, verbose=0)
""",
}


class PeakArrays:
    """The peak bytes of live JAX arrays on the fullest device while inside, sampled every
    two milliseconds: each device's buffers counted once (a replicated array holds one
    buffer a device; a shard read out of it as an array of its own is the same buffer, not
    more memory: the logical `nbytes` of every live array counted such views in full)."""

    def __enter__(self) -> "PeakArrays":
        import jax

        self.peak, self._stop = 0, threading.Event()

        def on_the_fullest_device() -> int:
            buffers: dict = {}
            for array in jax.live_arrays():
                for shard in array.addressable_shards:
                    data = shard.data
                    buffers[(shard.device.id, data.unsafe_buffer_pointer())] = data.nbytes
            by_device: dict = {}
            for (device, _), size in buffers.items():
                by_device[device] = by_device.get(device, 0) + size
            return max(by_device.values(), default=0)

        def sample() -> None:
            while not self._stop.is_set():
                try:
                    live = on_the_fullest_device()
                except Exception:  # noqa: BLE001 - an array freed as it is read
                    live = 0
                self.peak = max(self.peak, live)
                time.sleep(0.002)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def child(args) -> None:
    """One process of one way: setup, then the cell once or twice; JSON to --json."""
    if args.way == "magic":  # a kernel's shell exists before its first cell
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
    start = time.perf_counter()
    if args.way == "magic":
        shell.run_line_magic("load_ext", "tpu_magic")
        where = f"--simulate {args.devices} " if args.devices else ""
        shell.run_line_magic("tpu_connect", f"{where}--backend jax --no-panel "
                                            f"--compile-cache {args.cache}")
        namespace = shell.user_ns
        shell.run_cell("import numpy as np, keras").raise_error()
    else:
        import keras
        import numpy as np

        namespace = {"np": np, "keras": keras}
        import jax

        if args.devices > 1 or (args.devices == 0 and len(jax.devices()) > 1):
            keras.distribution.set_distribution(keras.distribution.DataParallel())
    setup = time.perf_counter() - start
    import jax
    import keras

    exec(DATA[args.cell], namespace)
    keras.utils.set_random_seed(0)
    cell = CELL[args.cell]
    if args.devices > 1:  # plain Keras splits a batch over the devices only where they divide it
        cell = cell.replace("[:6]", f"[:{args.devices}]")
    cells = []
    for _ in range(1 if args.phase == "restart" else 2):
        with PeakArrays() as peak:
            start = time.perf_counter()
            report = None
            if args.way == "magic":
                report = shell.run_cell_magic("tpu_train", "--no-progress", cell)
            else:
                exec(cell, namespace)
            seconds = time.perf_counter() - start
        cells.append({"seconds": seconds, "peak_array_bytes": peak.peak,
                      "report": report.summary().splitlines() if report is not None else None})
    Path(args.json).write_text(json.dumps({
        "setup_seconds": setup, "cells": cells, "devices": len(jax.devices()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {"jax": jax.__version__, "keras": keras.__version__}}))


def run_child(way: str, cell: str, devices: int, phase: str, cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env.update(KERAS_BACKEND="jax", PYTHONPATH=str(ROOT / "tests" / "without_tensorflow"),
               TF_CPP_MIN_LOG_LEVEL="2")
    if devices == 0:  # the machine's own devices
        env.pop("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT))
                                            if p)
    elif way == "plain" and devices > 1:  # what --simulate sets, for the same devices
        from tpu_magic.backends.jax.connect import host_device_flags  # noqa: PLC0415

        env["XLA_FLAGS"] = host_device_flags("", devices)
        env["PJRT_NPROC"] = str(4 * devices)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run(
            [sys.executable, __file__, "--way", way, "--cell", cell, "--devices", str(devices),
             "--phase", phase, "--cache", cache, "--json", out.name],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{way} {cell} {devices} {phase}:\n{done.stdout[-4000:]}")
        return json.loads(Path(out.name).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="mlp,cnn,gemma")
    parser.add_argument("--devices", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    for hidden in ("--way", "--cell", "--phase", "--cache"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.way:
        args.devices = int(args.devices)
        child(args)
        return 0
    results: dict = {}
    for round_number in range(args.rounds):
        for cell in args.cells.split(","):
            for devices in (int(d) for d in args.devices.split(",")):
                ways = WAYS if round_number % 2 == 0 else WAYS[::-1]
                for way in ways:
                    with tempfile.TemporaryDirectory() as cache:
                        kernel = run_child(way, cell, devices, "first", cache)
                        restart = run_child(way, cell, devices, "restart", cache)
                    found = results.setdefault(f"{cell} {devices}", {}).setdefault(way, [])
                    found.append({"setup": kernel["setup_seconds"],
                                  "first": kernel["cells"][0], "again": kernel["cells"][1],
                                  "restart": restart["cells"][0],
                                  "machine": kernel["machine"], "versions": kernel["versions"]})
                    print(f"round {round_number + 1}: {cell} on {devices}: {way} "
                          + ", ".join(f"{p} {found[-1][p]['seconds']:.2f} s" for p in PHASES),
                          flush=True)
    table = {}
    print(f"\nbench_first_cell: whole cells, Keras on JAX, CPU devices, {args.rounds} rounds "
          "(medians); magic / plain")
    print(f"{'cell':<10}{'devices':>8}{'phase':>9}{'plain s':>10}{'magic s':>10}{'ratio':>8}"
          f"{'peak ratio':>12}")
    for key, ways in results.items():
        cell, devices = key.split()
        for phase in PHASES:
            seconds = {w: statistics.median(r[phase]["seconds"] for r in ways[w]) for w in ways}
            peaks = {w: statistics.median(r[phase]["peak_array_bytes"] for r in ways[w])
                     for w in ways}
            ratio = seconds["magic"] / seconds["plain"]
            peak = peaks["magic"] / peaks["plain"] if peaks["plain"] else float("nan")
            table[f"{key} {phase}"] = {"plain": seconds["plain"], "magic": seconds["magic"],
                                       "ratio": ratio, "peak_ratio": peak}
            print(f"{cell:<10}{devices:>8}{phase:>9}{seconds['plain']:>10.2f}"
                  f"{seconds['magic']:>10.2f}{ratio:>8.2f}{peak:>12.2f}")
        setup = {w: statistics.median(r["setup"] for r in ways[w]) for w in ways}
        table[f"{key} setup"] = setup
        print(f"{cell:<10}{devices:>8}{'setup':>9}{setup['plain']:>10.2f}"
              f"{setup['magic']:>10.2f}{setup['magic'] - setup['plain']:>+8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "rounds": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
