"""A step too big for the chip, on the chip: a Gemma-2B-shaped causal LM fine-tuned in full at
a sequence length whose plain Keras step runs out of the device's memory, in plain Keras
(expected: XLA's RESOURCE_EXHAUSTED) and through `%%tpu_train` (the memory plan's form).

    python benchmarks/bench_big_step.py [--length 4096] [--batch 4] [--steps 3]
        [--layers 18] [--seconds 900] [--json PATH]

For an accelerator (a GPU or TPU; one device). The model: KerasHub `GemmaCausalLM` at
Gemma-2B's shapes (18 layers, width 2,048, 8 query heads of 256, one key-value head,
feed-forward 16,384, 256,000-word vocabulary; `--layers` fewer for a shorter compile: the
logits over the vocabulary are most of such a step's memory), random weights, float32,
every weight trained (no LoRA), Adam, synthetic tokens. Each way a process of its own: plain Keras's
`fit` of `--steps` steps, and the magic's (`%tpu_connect --backend jax`): its memory plan's
line, its steady tokens/s and utilization (TFLOP/s, MFU where the chip's peak is known).
Prints each way's outcome and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BUILD = """
import numpy as np, keras, keras_hub
rng = np.random.default_rng(0)
tokens = rng.integers(1, 256000, (BATCH * STEPS, LENGTH + 1)).astype("int32")
x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((BATCH * STEPS, LENGTH), bool)}
y = tokens[:, 1:]
"""
CELL = """
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=256000, num_layers=LAYERS, num_query_heads=8, num_key_value_heads=1,
    hidden_dim=2048, intermediate_dim=32768, head_dim=256)
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
lm.compile(optimizer=keras.optimizers.Adam(1e-5),
           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = lm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
"""


def child(args) -> None:
    sizes = {"BATCH": args.batch, "STEPS": args.steps, "LENGTH": args.length,
             "LAYERS": args.layers}
    code = {name: text for name, text in (("build", BUILD), ("cell", CELL))}
    for name, value in sizes.items():
        code = {k: v.replace(name, str(value)) for k, v in code.items()}
    found: dict = {"way": args.way}
    start = time.perf_counter()
    try:
        if args.way == "plain":
            namespace: dict = {}
            exec(code["build"], namespace)
            start = time.perf_counter()
            exec(code["cell"], namespace)
            found["loss"] = namespace["history"].history["loss"]
        else:
            from IPython.core.interactiveshell import InteractiveShell

            shell = InteractiveShell.instance()
            shell.run_line_magic("load_ext", "tpu_magic")
            shell.run_line_magic("tpu_connect", "--backend jax --no-panel")
            shell.run_cell(code["build"]).raise_error()
            start = time.perf_counter()
            report = shell.run_cell_magic("tpu_train", "--no-progress", code["cell"])
            found.update(plan=report.memory_plan, loss=shell.user_ns["history"].history["loss"],
                         summary=report.summary().splitlines())
        found["seconds"] = time.perf_counter() - start
        found["outcome"] = "trained"
    except BaseException as exc:  # noqa: BLE001 - an out-of-memory error is this run's finding
        found["outcome"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        found["seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(found, default=str))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--seconds", type=float, default=900, help="each way's limit")
    parser.add_argument("--ways", default="plain,magic")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.way:
        child(args)
        return 0
    results = []
    for way in args.ways.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            try:
                subprocess.run([sys.executable, __file__, "--way", way, "--out", out.name,
                                "--length", str(args.length), "--batch", str(args.batch),
                                "--steps", str(args.steps), "--layers", str(args.layers)],
                               cwd=ROOT, env=dict(os.environ), timeout=args.seconds)
                found = json.loads(Path(out.name).read_text() or '{"outcome": "died"}')
            except subprocess.TimeoutExpired:
                found = {"outcome": f"ran past {args.seconds:.0f} s"}
        found.update(way=way, length=args.length, batch=args.batch, layers=args.layers)
        results.append(found)
        if args.json:  # each way's as it ends: a later one cut short keeps the first
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        print(f"== {way}: {found.get('outcome')} in {found.get('seconds', 0):.1f} s")
        for line in found.get("summary", []):
            print("   ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
