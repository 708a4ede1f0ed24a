"""A chip's small steps rehearsed on one CPU device: a model whose step's compute is
microseconds, so what a fit does on the host around each step decides its rate, as it
does for small and mid-size models on a TPU or GPU.

    python benchmarks/bench_proxy.py [--rounds 3] [--steps 4096] [--batch 32] [--json PATH]

The model: an MLP 64-64-10 (Dense 64 relu, Dense 64 relu, Dense 10 softmax), Adam, sparse
categorical cross-entropy with accuracy, batch 32 on synthetic rows, S steps a round (one
epoch). Four ways, each way and round a process of its own (its import, connect and a
warm-up that compiles, then the timed run), the rounds interleaved and rotated:

- raw_scan: the on-device reference: a `jax.jit` of `jax.lax.scan` over 32 stateless Keras
  train steps a dispatch, each group of 32 batches stacked on the host and put on the device
  inside the timed loop, its losses read once a group (as a fit's callbacks read its logs);
- raw_step: a `jax.jit` of one stateless step a dispatch, read once a step;
- plain_keras: `model.fit(x, y, batch_size=32, verbose=0)`, no distribution;
- magic: the same fit through `%%tpu_train` (`--simulate 1`, its defaults: steps an
  execution chosen from a measured step), the whole cell timed (a fit's fixed costs in);
- magic_1: the same with `--steps-per-execution 1`: the magic's own cost a step, beside
  plain Keras's.

Prints a table of each way's median and best round (samples/s) and the ratios the targets
are set on (magic / raw_scan, magic / plain_keras); writes JSON with every round.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FEATURES, CLASSES, SCAN = 64, 10, 32
WAYS = ("raw_scan", "raw_step", "plain_keras", "magic", "magic_1")


def build(keras):
    layers = keras.layers
    return keras.Sequential([keras.Input((FEATURES,)), layers.Dense(64, activation="relu"),
                             layers.Dense(64, activation="relu"),
                             layers.Dense(CLASSES, activation="softmax")])


def data(np, samples: int):
    rng = np.random.default_rng(0)
    return (rng.random((samples, FEATURES), dtype=np.float32),
            rng.integers(0, CLASSES, samples).astype("int32"))


def raw(keras, x, y, batch: int, k: int):
    """A jitted scan of `k` stateless train steps a dispatch (k=1: one jitted step)."""
    import jax

    model = build(keras)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.get("sparse_categorical_crossentropy")
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])

    def step(state, xy):
        trainable, fixed, slots = state

        def compute(trainable):
            out, fixed_after = model.stateless_call(trainable, fixed, xy[0], training=True)
            return keras.ops.mean(loss_fn(xy[1], out)), fixed_after

        (loss, fixed_after), grads = jax.value_and_grad(compute, has_aux=True)(trainable)
        trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
        return (trainable, fixed_after, slots), loss

    groups = len(x) // (batch * k)
    xs = x[:groups * k * batch].reshape(groups, k, batch, FEATURES)
    ys = y[:groups * k * batch].reshape(groups, k, batch)
    if k == 1:
        one = jax.jit(step, donate_argnums=0)
        run_group = lambda state, gx, gy: one(state, (gx[0], gy[0]))  # noqa: E731
    else:
        run_group = jax.jit(lambda state, gx, gy: jax.lax.scan(step, state, (gx, gy)),
                            donate_argnums=0)
    holder = {"state": state}
    holder["state"], losses = run_group(holder["state"], *jax.device_put((xs[0], ys[0])))
    jax.block_until_ready(losses)  # warm-up: compile

    def run():
        start = time.perf_counter()
        for group in range(groups):
            holder["state"], losses = run_group(holder["state"],
                                                *jax.device_put((xs[group], ys[group])))
            jax.block_until_ready(losses)
        return groups * k * batch / (time.perf_counter() - start), None

    return run


def fit(keras, x, y, batch: int, shell=None, line: str = "--no-progress"):
    """Plain Keras's fit (`shell` None) or the magic's cell (its flags: `line`), after a
    warm-up fit of the same data: what compiles, and for the magic what it measures to
    choose its steps an execution, is done before the timed run (as the raw ways compile
    before theirs); a notebook's first cell pays it once."""
    if shell is None:
        model = build(keras)
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)

        def run():
            start = time.perf_counter()
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
            return len(x) / (time.perf_counter() - start), None

        return run
    shell.user_ns.update(x=x, y=y, keras=keras, build=build, batch=batch)
    shell.run_cell_magic("tpu_train", line,
                         "model = build(keras)\nmodel.compile(keras.optimizers.Adam(1e-3), "
                         "'sparse_categorical_crossentropy', metrics=['accuracy'])\n"
                         "model.fit(x, y, batch_size=batch, verbose=0)")

    def run():
        start = time.perf_counter()
        report = shell.run_cell_magic("tpu_train", line,
                                      "model.fit(x, y, batch_size=batch, verbose=0)")
        rate = len(x) / (time.perf_counter() - start)
        return rate, {"steady": report.samples_per_second,
                      "steps_per_execution": report.execution.line() if report.execution
                      else None}

    return run


def measure(args) -> None:
    """One way and round, in this (fresh) process: JSON to --json."""
    import numpy as np

    shell = None
    if args.way.startswith("magic"):
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "tpu_magic")
        shell.run_line_magic("tpu_connect", "--simulate 1 --backend jax --no-panel")
    import jax
    import keras

    x, y = data(np, args.steps * args.batch)
    if args.way.startswith("raw"):
        run = raw(keras, x, y, args.batch, SCAN if args.way == "raw_scan" else 1)
    else:
        line = "--no-progress" + (" --steps-per-execution 1" if args.way == "magic_1" else "")
        run = fit(keras, x, y, args.batch, shell, line)
    rate, more = run()
    Path(args.json).write_text(json.dumps({
        "way": args.way, "samples_per_second": rate, "more": more,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {"jax": jax.__version__, "keras": keras.__version__}}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4096, help="steps a round (one epoch)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--way", help=argparse.SUPPRESS)  # a child's one way
    args = parser.parse_args(argv)
    if args.way:
        measure(args)
        return 0
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env.update(KERAS_BACKEND="jax", PYTHONPATH=str(ROOT / "tests" / "without_tensorflow"))
    ways = args.ways.split(",")
    runs: dict[str, list] = {way: [] for way in ways}
    for round_number in range(args.rounds):
        order = ways[round_number % len(ways):] + ways[:round_number % len(ways)]
        for way in order:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                child = subprocess.run(
                    [sys.executable, __file__, "--steps", str(args.steps), "--batch",
                     str(args.batch), "--way", way, "--json", out.name],
                    env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, timeout=900)
                if child.returncode != 0:
                    print(child.stdout[-3000:])
                    return 1
                runs[way].append(json.loads(Path(out.name).read_text()))
            print(f"round {round_number + 1}: {way} "
                  f"{runs[way][-1]['samples_per_second']:,.0f} samples/s", flush=True)
    rates = {way: [r["samples_per_second"] for r in rounds] for way, rounds in runs.items()}
    median = {way: statistics.median(values) for way, values in rates.items()}
    best = {way: max(values) for way, values in rates.items()}
    ratios = {}
    if "magic" in median:
        for other in ("raw_scan", "plain_keras", "raw_step"):
            if other in median:
                ratios[f"magic / {other}"] = median["magic"] / median[other]
    if "magic_1" in median and "plain_keras" in median:
        ratios["magic_1 / plain_keras"] = median["magic_1"] / median["plain_keras"]
    first = next(iter(runs.values()))[0]
    print(f"\nbench_proxy: MLP 64-64-10 on one CPU device (JAX), batch {args.batch}, "
          f"{args.steps} steps, {args.rounds} rounds, each way and round a process; samples/s")
    print(f"{'way':<14}{'median':>14}{'best':>14}")
    for way in ways:
        print(f"{way:<14}{median[way]:>14,.0f}{best[way]:>14,.0f}")
    for name, value in ratios.items():
        print(f"{name:<26}{value:>8.3f}")
    magic_more = [r["more"] for r in runs.get("magic", [])]
    if magic_more:
        print(f"magic: {magic_more[-1]['steps_per_execution']}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": "MLP 64-64-10", "batch": args.batch, "steps": args.steps,
            "rounds": args.rounds, "machine": first["machine"], "versions": first["versions"],
            "median": median, "best": best, "ratios": ratios, "all_rounds": rates,
            "magic": magic_more}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
