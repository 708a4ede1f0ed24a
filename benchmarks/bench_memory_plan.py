"""The memory plan's choice against the best choice by hand: a step that does not fit a
device (its memory rehearsed with `TPU_MAGIC_DEVICE_MEMORY_BYTES`), trained in the form the
plan chooses and in every form that fits, swept by hand.

    python benchmarks/bench_memory_plan.py [--limits 0.55,0.3] [--rounds 1] [--json PATH]

Keras on JAX, one CPU device (`--simulate 1`), TensorFlow blocked. The model: a KerasHub
`GemmaCausalLM` from a small config (4 layers, width 128, 4 heads of 32, one key-value
head, feed-forward 512, a 512-word vocabulary), LoRA rank 4, 64 sequences of 256 tokens,
batch 32, Adam. First the plan of its step as written (peak P, from the report). Then for
each limit L × P: the magic's own choice (`%%tpu_train`, its defaults), and by hand each
form (`--microbatches M` for M in 1, 2, 4, 8, with and without `--remat on`) whose plan
fits L; each a process of its own: a cell that fits one epoch to compile, then a timed
epoch of the same (steady samples/s, the report's). Also the plan's own seconds (its
candidates' compiles) and the first step's, from the auto run's report. Prints a table and
writes JSON; the target: auto / best by hand >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMS = [(m, remat) for m in (1, 2, 4, 8) for remat in (False, True) if m > 1 or remat]

DATA = """
import numpy as np, keras, keras_hub
rs = np.random.RandomState(4)
ids = rs.randint(1, 512, (64, 257))
x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((64, 256), bool)}
y = ids[:, 1:]
"""
CELL = """
keras.utils.set_random_seed(5)
backbone = keras_hub.models.GemmaBackbone(vocabulary_size=512, num_layers=4,
    num_query_heads=4, num_key_value_heads=1, hidden_dim=128, intermediate_dim=512, head_dim=32)
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
backbone.enable_lora(rank=4)
lm.compile(optimizer=keras.optimizers.Adam(1e-3),
           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
lm.fit(x, y, batch_size=32, epochs=1, verbose=0)
"""
AGAIN = "lm.fit(x, y, batch_size=32, epochs=1, verbose=0)"


def child(line: str, out: str) -> None:
    """One way: the cell (compiles), then the same fit again, timed."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "tpu_magic")
    shell.run_line_magic("tpu_connect", "--simulate 1 --backend jax --no-panel "
                                        "--compile-cache off")
    shell.run_cell(DATA).raise_error()
    start = time.perf_counter()
    first = shell.run_cell_magic("tpu_train", "--no-progress " + line, CELL)
    cell_seconds = time.perf_counter() - start
    again = shell.run_cell_magic("tpu_train", "--no-progress " + line, AGAIN)
    plan = first.memory_plan or ""
    found = re.search(r"planned in ([0-9.e+-]+) s", plan)
    Path(out).write_text(json.dumps({
        "line": line, "plan": plan, "plan_seconds": float(found.group(1)) if found else 0.0,
        "first_step": first.compile_seconds, "cell_seconds": cell_seconds,
        "steady": again.samples_per_second, "peak": _peak(plan)}))


def _peak(plan: str) -> float | None:
    found = re.search(r"memory plan: ([0-9.e+-]+)", plan)
    return float(found.group(1)) if found else None


def run(line: str, limit: float | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env.update(KERAS_BACKEND="jax", PYTHONPATH=str(ROOT / "tests" / "without_tensorflow"),
               TF_CPP_MIN_LOG_LEVEL="2")
    if limit is not None:
        env["TPU_MAGIC_DEVICE_MEMORY_BYTES"] = str(int(limit))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run([sys.executable, __file__, "--child", line, "--out", out.name],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=1200)
        if done.returncode != 0:
            return {"line": line, "failed": done.stdout[-800:]}
        return json.loads(Path(out.name).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", default="0.55,0.3")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.out)
        return 0
    written = run("", None)
    peak = written["peak"] * 2 ** 30
    results = {"written": written, "limits": {}}
    print(f"as written: {written['peak']:.3g} GiB, {written['steady']:.1f} samples/s")
    for share in (float(s) for s in args.limits.split(",")):
        limit = share * peak
        auto = run("", limit)
        by_hand = {}
        for micro, remat in FORMS:
            line = f"--microbatches {micro} --remat {'on' if remat else 'off'}"
            found = run(line, limit)
            if "failed" not in found:
                by_hand[line] = found
        best = max(by_hand.values(), key=lambda r: r["steady"], default=None)
        ratio = auto.get("steady", 0) / best["steady"] if best else float("nan")
        results["limits"][share] = {"auto": auto, "by_hand": by_hand, "ratio": ratio}
        print(f"\nlimit {share} x the step's plan: auto chose: {auto.get('plan', '')[:160]}")
        print(f"  auto {auto.get('steady', 0):.1f} samples/s; plan {auto.get('plan_seconds')} s,"
              f" first step {auto.get('first_step')} s")
        for line, found in by_hand.items():
            print(f"  {line:<34}{found['steady']:>10.1f} samples/s  {found['peak']:.3g} GiB")
        print(f"  auto / best by hand: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
