"""What the first-step parity check costs: a cell's first step with `--verify on`, and the
seconds the check added, on 8 simulated devices.

    python benchmarks/bench_parity.py [--runs 2] [--json bench_parity.json]

Each row is a fresh process (nothing compiled, nothing agreed before) that connects
(`--simulate 8`) and runs one `%%tpu_train` cell: the seeds' CIFAR-10 CNN (BatchNorm, Conv
32-32-64-64, Dropout, Dense 512; 2,048 images, batch 1024) on JAX and on TensorFlow (Dropout:
compared in inference mode there), and a KerasHub GemmaCausalLM from a small config with a
32,000-word vocabulary (the embedding dominates), LoRA rank 4, on JAX (64 sequences of 64
tokens, batch 16). Prints a table, writes JSON. The check's share is its seconds over the
first step's (tracing, compiling and running it), measured in the same process.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CELLS = {
    "cnn": ("""
import numpy as np, keras
x = np.random.RandomState(0).rand(2048, 32, 32, 3).astype("float32")
y = np.random.RandomState(1).randint(0, 10, 2048)
""", """
model = keras.Sequential([
    keras.Input((32, 32, 3)), keras.layers.BatchNormalization(),
    keras.layers.Conv2D(32, 3, padding="same", activation="elu"),
    keras.layers.Conv2D(32, 3, padding="same", activation="elu"), keras.layers.MaxPooling2D(),
    keras.layers.Conv2D(64, 3, padding="same", activation="elu"),
    keras.layers.Conv2D(64, 3, padding="same", activation="elu"), keras.layers.MaxPooling2D(),
    keras.layers.Flatten(), keras.layers.Dropout(0.25),
    keras.layers.Dense(512, activation="elu"), keras.layers.Dropout(0.5),
    keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.001), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
model.fit(x, y, batch_size=1024, epochs=1, verbose=0)
"""),
    "gemma_lora": ("""
import numpy as np, keras, keras_hub
tokens = np.random.RandomState(0).randint(1, 32000, (64, 65))
x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((64, 64), bool)}
y = tokens[:, 1:]
""", """
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=32000, num_layers=2, num_query_heads=4, num_key_value_heads=1,
    hidden_dim=128, intermediate_dim=256, head_dim=32)
model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
model.backbone.enable_lora(rank=4)
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=keras.optimizers.Adam(1e-4),
              weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
"""),
}


def child(backend: str, model: str, out: str) -> None:
    """One row, in this (fresh) process."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "tpu_magic")
    shell.run_line_magic("tpu_connect", f"--simulate 8 --backend {backend} --no-panel")
    setup, cell = CELLS[model]
    shell.run_cell(setup)
    report = shell.run_cell_magic("tpu_train", "--no-progress --verify on", cell)
    parity = report.parity
    Path(out).write_text(json.dumps({
        "backend": backend, "model": model, "first_step_seconds": report.compile_seconds,
        "check_seconds": parity.seconds, "agrees": parity.agrees, "line": parity.line()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", default="bench_parity.json")
    parser.add_argument("--child", nargs=3, metavar=("BACKEND", "MODEL", "OUT"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    rows = []
    for backend, model in (("jax", "cnn"), ("tf", "cnn"), ("jax", "gemma_lora")):
        for run in range(args.runs):
            out = Path(f"/tmp/bench_parity_{backend}_{model}_{run}.json")
            env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
            subprocess.run([sys.executable, __file__, "--child", backend, model, str(out)],
                           env=env, check=True, cwd=ROOT, timeout=900)
            row = json.loads(out.read_text())
            rows.append(row)
            print(f"{backend:<4}{model:<12} first step {row['first_step_seconds']:.2f} s, "
                  f"check {row['check_seconds']:.2f} s — {row['line']}", flush=True)
    print(f"\n{'backend':<9}{'model':<13}{'first step s':>13}{'check s':>9}{'check/first step':>18}")
    summary = []
    for backend, model in (("jax", "cnn"), ("tf", "cnn"), ("jax", "gemma_lora")):
        mine = [r for r in rows if r["backend"] == backend and r["model"] == model]
        first = statistics.median(r["first_step_seconds"] for r in mine)
        check = statistics.median(r["check_seconds"] for r in mine)
        summary.append({"backend": backend, "model": model, "first_step_seconds": first,
                        "check_seconds": check, "share": check / first,
                        "agrees": all(r["agrees"] for r in mine)})
        print(f"{backend:<9}{model:<13}{first:>13.2f}{check:>9.2f}{check / first:>17.0%}")
    Path(args.json).write_text(json.dumps({"runs": rows, "summary": summary}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
