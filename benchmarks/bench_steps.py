"""What `--steps-per-execution K` buys on JAX: a small, dispatch-bound model at K = 1, 8, 32
through `%%tpu_train`, against a raw `jax.lax.scan` over K steps, interleaved.

    python benchmarks/bench_steps.py [--simulate N] [--ks 1,8,32] [--rounds 3]
        [--steps S] [--batch B] [--quick] [--json PATH]

The model is the classic MNIST MLP of the seeds' era (784 inputs, Dense(512, relu),
Dropout(0.2), Dense(512, relu), Dropout(0.2), Dense(10, softmax); 669,706 parameters),
Adam, sparse categorical cross-entropy with accuracy, on synthetic 28×28 images
flattened, batch 128 (global), S steps a round. `--simulate N`: N simulated CPU devices
under `DataParallel`; without it the process's one CPU device.

- magic K: the model through `%%tpu_train --steps-per-execution K` (progress bar on, the
  whole cell timed), after a warm-up cell that compiles;
- raw scan K: the on-device reference, a loop that dispatches once per K steps: a
  `jax.jit` of `jax.lax.scan` over K train steps (stateless Keras calls, as bench_train's
  raw loop), its state replicated, each group of K batches stacked on the host and put on
  the devices (sharded over the batch) inside the timed loop, as a fit's batches are, and
  its losses read once a group, as a fit's callbacks read its logs once an execution.
  (Unread, hundreds of queued steps deadlocked XLA's CPU collectives on 8 simulated
  devices: an all-reduce's rendezvous waited past 40 s and aborted the process, every run.)

Keras 3.15's JAX trainer runs `steps_per_execution` as a host loop of one-step calls, so
the magic at K pays one dispatch a step where the raw scan pays one a group. The host
loop's cost at the largest K is `1 - magic_K / raw_scan_K`, with the whole cell's rate (a
fit's fixed costs included: the input pipeline, the first execution, the input verdict
after it) and with the report's steady rate (the steps after the first execution);
`k1_vs_kmax` is the magic's K=1 rate over its largest K's. Each way and round is a
process of its own (its import, connect and warm-up compile, then the timed round); the
rounds interleave the ways; each way's median round counts, and its best (the least
disturbed, on a shared machine). A process a signal killed runs again (`--attempts`),
counted in the JSON. Prints a table; writes JSON with every round.
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

from bench_train import stateless_step  # the same raw step (this folder is on the path)

ROOT = Path(__file__).resolve().parent.parent
PIXELS, CLASSES = 784, 10


def build(keras):
    layers = keras.layers
    return keras.Sequential([
        keras.Input((PIXELS,)),
        layers.Dense(512, activation="relu"), layers.Dropout(0.2),
        layers.Dense(512, activation="relu"), layers.Dropout(0.2),
        layers.Dense(CLASSES, activation="softmax"),
    ])


def data(np, samples: int):
    rng = np.random.default_rng(0)
    return (rng.random((samples, PIXELS), dtype=np.float32),
            rng.integers(0, CLASSES, samples).astype("int32"))


def raw_scan(keras, connection, x, y, batch: int, k: int):
    """A `jax.jit` of a `lax.scan` over K stateless Keras train steps; returns the timed run."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(connection.strategy.device_mesh.devices.flatten()), ("batch",))
    replicated = NamedSharding(mesh, PartitionSpec())
    stacked = NamedSharding(mesh, PartitionSpec(None, "batch"))
    with connection.strategy.scope():
        raw = build(keras)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(raw.trainable_variables)
    loss_fn = keras.losses.get("sparse_categorical_crossentropy")
    state = jax.device_put(([v.value for v in raw.trainable_variables],
                            [v.value for v in raw.non_trainable_variables],
                            [v.value for v in optimizer.variables]), replicated)

    one = stateless_step(keras, raw, optimizer, loss_fn)

    def step(state, batch_xy):
        return one(state, *batch_xy)

    run_group = jax.jit(lambda state, xs, ys: jax.lax.scan(step, state, (xs, ys)),
                        donate_argnums=0)
    groups = len(x) // (batch * k)
    xs = x[:groups * k * batch].reshape(groups, k, batch, PIXELS)
    ys = y[:groups * k * batch].reshape(groups, k, batch)
    holder = {"state": state}
    holder["state"], losses = run_group(holder["state"], *jax.device_put((xs[0], ys[0]), stacked))
    losses.block_until_ready()  # warm-up: compile

    def run():
        start = time.perf_counter()
        for group in range(groups):
            holder["state"], losses = run_group(
                holder["state"], *jax.device_put((xs[group], ys[group]), stacked))
            losses.block_until_ready()  # read once a group, as fit's callbacks read the logs
        return groups * k * batch / (time.perf_counter() - start)

    return run


def magic(shell, keras, x, y, batch: int, k: int):
    """The model through `%%tpu_train --steps-per-execution K`; returns (samples/s, report)."""
    shell.user_ns.update(x=x, y=y, keras=keras, build=build, batch=batch)
    warm = batch * 2 * k
    line = f"--steps-per-execution {k}"
    shell.run_cell_magic("tpu_train", f"--no-progress {line}",
                         "model = build(keras)\n"
                         "model.compile(keras.optimizers.Adam(1e-3), "
                         "'sparse_categorical_crossentropy', metrics=['accuracy'])\n"
                         f"model.fit(x[:{warm}], y[:{warm}], batch_size=batch, epochs=1, "
                         "verbose=0)")
    report = shell.run_cell_magic("tpu_train", line,
                                  "model.fit(x, y, batch_size=batch, epochs=1)")
    if report is None:
        raise RuntimeError("%%tpu_train failed")
    return len(x) / report.seconds, report


def measure(args) -> None:
    """One way and round, in this (fresh) process: JSON to --json."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "tpu_magic")
    simulate = f"--simulate {args.simulate} " if args.simulate else ""
    shell.run_line_magic("tpu_connect", f"{simulate}--backend jax --no-panel")

    import jax
    import keras
    import numpy as np

    import tpu_magic

    connection = tpu_magic.session()
    kind, k = args.way.rsplit("_", 1)
    k = int(k)
    x, y = data(np, args.steps * args.batch)
    steady = None
    if kind == "magic":
        rate, report = magic(shell, keras, x, y, args.batch, k)
        steady = report.samples_per_second
    else:
        rate = raw_scan(keras, connection, x, y, args.batch, k)()
    Path(args.json).write_text(json.dumps({
        "way": args.way, "samples_per_second": rate, "steady_samples_per_second": steady,
        "devices": connection.replicas, "machine": f"{platform.machine()}, "
                                                   f"{os.cpu_count()} cores",
        "versions": {"jax": jax.__version__, "keras": keras.__version__}}))


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, metavar="N", help="N simulated CPU devices")
    parser.add_argument("--ks", default="1,8,32", help="steps per execution, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps a round (default 480; a multiple of every K)")
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--quick", action="store_true", help="few steps, 2 rounds (a smoke run)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--child-timeout", type=int, default=600)
    parser.add_argument("--attempts", type=int, default=3,
                        help="runs again of a way a signal killed, over all rounds")
    parser.add_argument("--way", help=argparse.SUPPRESS)  # a child's one way
    return parser.parse_args(argv)


def ways(ks: list[int]) -> list[str]:
    """The magic at every K; the raw scan at 1 and at the largest K."""
    return [f"magic_{k}" for k in ks] + [f"raw_{k}" for k in sorted({1, max(ks)})]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.quick:
        args.rounds = min(args.rounds, 2)
    ks = [int(k) for k in args.ks.split(",")]
    args.steps = args.steps or (2 * max(ks) if args.quick else 480)
    if args.way:
        measure(args)
        return 0
    child_args = ["--steps", str(args.steps), "--batch", str(args.batch)] + \
        (["--simulate", str(args.simulate)] if args.simulate else [])
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env["KERAS_BACKEND"] = "jax"
    runs = {way: [] for way in ways(ks)}
    killed = {way: 0 for way in runs}
    for round_number in range(args.rounds):
        for way in runs:
            row = run_child(args, child_args, env, way)
            while row is None and killed[way] < args.attempts:
                killed[way] += 1
                row = run_child(args, child_args, env, way)
            if row is None:
                return 1
            runs[way].append(row)
            print(f"round {round_number + 1}: {way} "
                  f"{runs[way][-1]['samples_per_second']:,.0f} samples/s", flush=True)
    result = summarize(args, ks, runs)
    result["killed"] = killed
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def run_child(args, child_args: list[str], env: dict, way: str) -> dict | None:
    """One way and round in a process of its own; None where a signal killed it (XLA's CPU
    collectives abort a process whose rendezvous waits past 40 s, seen under load)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        child = subprocess.run(
            [sys.executable, __file__, *child_args, "--way", way, "--json", out.name],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=args.child_timeout)
        if child.returncode == 0:
            return json.loads(Path(out.name).read_text())
    reason = [line for line in child.stdout.splitlines() if line.startswith("F")][:1]
    print(f"bench_steps: {way} ended with {child.returncode}: "
          f"{reason[0][:300] if reason else child.stdout[-2000:]}", flush=True)
    if child.returncode >= 0:
        raise SystemExit(1)
    return None


def summarize(args, ks: list[int], runs: dict) -> dict:
    """The table: each way's median and best round, the whole cell's rate and the steady."""
    first = next(iter(runs.values()))[-1]
    top = max(ks)
    rates = {way: [r["samples_per_second"] for r in rounds] for way, rounds in runs.items()}
    # the raw scan has no fit around it: its steady rate is its rate
    steady = {way: [r["steady_samples_per_second"] or r["samples_per_second"] for r in rounds]
              for way, rounds in runs.items()}
    table = {f"{of}_{pick.__name__}": {way: pick(values[way]) for way in runs}
             for of, values in (("cell", rates), ("steady", steady))
             for pick in (statistics.median, max)}
    result = {"model": "MNIST MLP", "devices": first["devices"], "global_batch": args.batch,
              "steps_per_round": args.steps, "rounds": args.rounds, "quick": args.quick,
              "machine": first["machine"], "versions": first["versions"],
              "samples_per_second": table["cell_median"], "table": table,
              "all_rounds": rates, "all_rounds_steady": steady,
              "k1_vs_kmax": {name: column["magic_1"] / column[f"magic_{top}"]
                             for name, column in table.items()} if 1 in ks else None,
              "host_loop_cost": {name: 1 - column[f"magic_{top}"] / column[f"raw_{top}"]
                                 for name, column in table.items()}}
    print(f"\nbench_steps: MNIST MLP on JAX, {result['devices']} device(s), batch {args.batch}, "
          f"{args.steps} steps, {args.rounds} rounds, each way and round a process; samples/s")
    print(f"{'way':<12}" + "".join(f"{name:>16}" for name in table))
    for way in runs:
        print(f"{way:<12}" + "".join(f"{column[way]:>16,.0f}" for column in table.values()))
    for label in ("k1_vs_kmax", "host_loop_cost"):
        if result[label]:
            print(f"{label:<12}" + "".join(f"{v:>16.3f}" for v in result[label].values()))
    print(f"(k1_vs_kmax: magic K=1 / K={top}; host_loop_cost: 1 - magic K={top} / raw scan "
          f"K={top})")
    return result


if __name__ == "__main__":
    sys.exit(main())
