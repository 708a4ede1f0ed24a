"""A KerasHub LoRA step on 8 simulated devices: tokens/s through `%%tpu_train` with NumPy
inputs, a tf.data dataset and a grain dataset, against plain Keras on the same mesh.

    python benchmarks/bench_lora.py [--steps N] [--batch B] [--length L] [--rounds R]
        [--repeats K] [--simulate N] [--ways W,W] [--quick] [--json PATH]

`--simulate 0` runs on the machine's own devices (a GPU or TPU; every way on all of them),
and `--ways` picks some of the four (a machine without TensorFlow has no tf.data way).

The model: a KerasHub `GemmaCausalLM` (no preprocessor) on a `GemmaBackbone` from a small
config (32,000-word vocabulary, 2 layers, 4 query heads, 1 key-value head, hidden 128,
feed-forward 256, head 32: the embedding and the logits dominate), `enable_lora(rank=4)`,
SparseCategoricalCrossentropy from logits, Adam. The data: synthetic tokens (no downloads),
B sequences a batch of L tokens each, `padding_mask` all ones, the targets the inputs
shifted by one. Four ways, on JAX with 8 CPU devices (`--simulate 8`):

- plain_keras: `keras.distribution.set_distribution(DataParallel(...))` over the 8 devices,
  the model built under it, `fit` on NumPy dicts, `verbose=0` (KerasHub's `fit` batches
  arrays into a grain dataset itself);
- magic_numpy: the same `fit` in a `%%tpu_train` cell (`%tpu_connect --simulate 8 --backend
  jax --no-panel`), progress bar on, as a user runs it;
- magic_tfdata: the cell fed `tf.data.Dataset.from_tensor_slices((x, y)).batch(B)`;
- magic_grain: the cell fed `grain.MapDataset.source(range(n)).map(one sequence).batch(B)`.

Each way and round is a process of its own: the model built (for the magic, in a cell of its
own), a warm-up `fit` of one epoch that compiles, then a timed `fit` of one epoch of N steps
over the same tokens, the warm-up's input the timed one's, K times (`--repeats`, 2), the
fastest kept: the machine's other work only ever slows a fit down. Plain Keras's `fit` is
timed alone; the magic's timed figure is the report's seconds, the whole cell's wall time
(the cell's own work around `fit` included). Tokens/s = sequences × L / seconds. The rounds
interleave the ways and each way's median counts, so the machine's noise hits them alike.
Prints a table and writes JSON: every round, the medians, the ratios dataset/NumPy
(`tfdata_vs_numpy`, `grain_vs_numpy`) and magic/plain Keras, and each way's peak host
memory (the child's `ru_maxrss`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VOCAB = 32000
WAYS = ("plain_keras", "magic_numpy", "magic_tfdata", "magic_grain")

BUILD = """
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=1,
    hidden_dim=128, intermediate_dim=256, head_dim=32)
model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
model.backbone.enable_lora(rank=4)
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=keras.optimizers.Adam(1e-4))
"""

# What each way's `fit` is given (names bound by `tokens`).
FIT = {
    "plain_keras": "model.fit(x, y, batch_size=batch, epochs=1, verbose=0)",
    "magic_numpy": "model.fit(x, y, batch_size=batch, epochs=1{verbose})",
    "magic_tfdata": "model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), "
                    "epochs=1{verbose})",
    "magic_grain": "model.fit(grain.MapDataset.source(range(len(y))).map(one).batch(batch), "
                   "epochs=1{verbose})",
}


def tokens(np, sequences: int, length: int) -> dict:
    """Synthetic sequences: inputs, targets shifted by one, and one sequence as grain maps it."""
    ids = np.random.default_rng(0).integers(1, VOCAB, (sequences, length + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((sequences, length), bool)}
    y = ids[:, 1:]

    def one(i):
        return {"token_ids": x["token_ids"][i], "padding_mask": x["padding_mask"][i]}, y[i]

    return {"x": x, "y": y, "one": one}


def peak_memory_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(args) -> int:
    """One way: warm up (compile), then time one epoch of N steps; JSON to --json."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    if args.way == "plain_keras":  # no tpu_magic in this process: the CPU devices by hand
        os.environ["KERAS_BACKEND"] = "jax"
        if args.simulate:
            from tpu_magic.backends.jax.connect import host_pool_size, schedulable_cpus

            os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.simulate}"
            # XLA:CPU's pools as `--simulate` sizes them: the other ways' threads, and no
            # collective left waiting for one (docs/limits.md)
            pool = host_pool_size(os.environ, args.simulate, schedulable_cpus())
            if pool is not None:
                os.environ["PJRT_NPROC"] = str(pool)
    else:
        shell.run_line_magic("load_ext", "tpu_magic")
        simulate = f"--simulate {args.simulate} " if args.simulate else ""
        shell.run_line_magic("tpu_connect", f"{simulate}--backend jax --no-panel")

    import jax
    import keras
    import keras_hub
    import numpy as np

    versions = {"jax": jax.__version__, "keras": keras.__version__,
                "keras_hub": keras_hub.__version__}
    sequences = args.steps * args.batch
    shell.user_ns.update(tokens(np, sequences, args.length), keras=keras, keras_hub=keras_hub,
                         VOCAB=VOCAB, batch=args.batch)
    if args.way == "magic_tfdata":
        import tensorflow as tf

        shell.user_ns["tf"], versions["tensorflow"] = tf, tf.__version__
    if args.way == "magic_grain":
        import grain

        shell.user_ns["grain"], versions["grain"] = grain, _version("grain")
    fit, timed, used = FIT[args.way], [], None
    if args.way == "plain_keras":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices()))
        shell.run_cell(BUILD, store_history=False).raise_error()
        shell.run_cell(fit, store_history=False).raise_error()  # warm-up: compile
        for _ in range(args.repeats):
            start = time.perf_counter()
            shell.run_cell(fit, store_history=False).raise_error()
            timed.append(time.perf_counter() - start)
    else:
        # The model built in a cell of its own, then the timed cell's `fit` once to compile
        # (and to run the first-step check) with the timed cell's own input, so the timed
        # cells compile nothing. (When this was written, later cells skipped the task's own
        # `fit`, feeding another input than the building cell; they no longer do.)
        shell.run_cell_magic("tpu_train", "--no-progress", BUILD)
        shell.run_cell_magic("tpu_train", "--no-progress", fit.format(verbose=", verbose=0"))
        for _ in range(args.repeats):
            report = shell.run_cell_magic("tpu_train", "", fit.format(verbose=""))
            if report is None:
                raise RuntimeError("%%tpu_train failed")
            timed.append(report.seconds)
            used = report.utilization  # the steady steps' TFLOP/s and the chip's nominal peak
    seconds = min(timed)
    result = {
        "way": args.way, "replicas": len(jax.devices()), "batch": args.batch,
        "length": args.length, "steps": args.steps, "seconds": seconds, "every_fit": timed,
        "tokens_per_second": sequences * args.length / seconds,
        "peak_memory_mib": peak_memory_mib(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "device": str(jax.devices()[0].device_kind), "versions": versions,
        "achieved_tflops": used.achieved_tflops if used is not None else None,
        "nominal_tflops": used.nominal_tflops if used is not None else None,
        "flops_per_sample": used.flops_per_sample if used is not None else None,
    }
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 12)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--length", type=int, default=64, help="tokens a sequence (default 64)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed fits a process, the fastest kept (default 2)")
    parser.add_argument("--quick", action="store_true", help="few steps, one round (a smoke run)")
    parser.add_argument("--simulate", type=int, default=8, metavar="N",
                        help="N simulated CPU devices (default 8; 0: the machine's own)")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help="the ways to run, comma-separated (default all four)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--child-timeout", type=int, default=600,
                        help="seconds one way's process may take")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a child's one way
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Every way and round in a child process of its own, the rounds interleaving the ways."""
    args = parse(sys.argv[1:] if argv is None else argv)
    args.steps = args.steps or (4 if args.quick else 12)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.way:
        return measure(args)
    if args.simulate and args.batch % args.simulate:
        print(f"bench_lora: batch {args.batch} is not divisible by {args.simulate} devices")
        return 2
    chosen = [way.strip() for way in args.ways.split(",") if way.strip()]
    unknown = [way for way in chosen if way not in WAYS]
    if unknown or "magic_numpy" not in chosen or "plain_keras" not in chosen:
        print(f"bench_lora: --ways {args.ways}: choose among {', '.join(WAYS)}, "
              "plain_keras and magic_numpy among them (the ratios' references)")
        return 2
    rounds = args.rounds or (1 if args.quick else 3)
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    runs = {way: [] for way in chosen}
    for round_number in range(rounds):
        for way in chosen:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                child = subprocess.run(
                    [sys.executable, "-X", "faulthandler", __file__, "--way", way,
                     "--steps", str(args.steps), "--batch", str(args.batch),
                     "--length", str(args.length), "--repeats", str(args.repeats),
                     "--simulate", str(args.simulate), "--json", out.name],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    timeout=args.child_timeout)
                if child.returncode != 0:
                    print(child.stdout[-3000:])
                    print(f"bench_lora: {way}, round {round_number + 1}: the process ended "
                          f"with {child.returncode}")
                    return 1
                runs[way].append(json.load(open(out.name)))
            print(f"round {round_number + 1}: {way:<13} "
                  f"{runs[way][-1]['tokens_per_second']:>9,.0f} tokens/s", flush=True)
    result = summarize(args, runs, rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def summarize(args, runs: dict, rounds: int) -> dict:
    chosen = list(runs)
    median = {way: statistics.median(r["tokens_per_second"] for r in runs[way]) for way in chosen}
    first = runs["magic_numpy"][-1]
    result = {key: first.get(key) for key in ("replicas", "batch", "length", "steps", "machine",
                                              "device", "versions", "nominal_tflops",
                                              "flops_per_sample")}
    achieved = {way: statistics.median(r["achieved_tflops"] for r in runs[way])
                for way in chosen if all(r.get("achieved_tflops") for r in runs[way])}
    result.update(
        rounds=rounds, repeats=args.repeats, quick=args.quick, tokens_per_second=median,
        all_rounds={way: [r["tokens_per_second"] for r in runs[way]] for way in chosen},
        peak_memory_mib={way: max(r["peak_memory_mib"] for r in runs[way]) for way in chosen},
        tfdata_vs_numpy=median["magic_tfdata"] / median["magic_numpy"]
        if "magic_tfdata" in median else None,
        grain_vs_numpy=median["magic_grain"] / median["magic_numpy"]
        if "magic_grain" in median else None,
        magic_vs_plain_keras=median["magic_numpy"] / median["plain_keras"],
        achieved_tflops=achieved,
        mfu={way: value / result["nominal_tflops"] for way, value in achieved.items()}
        if result["nominal_tflops"] else {})
    devices = (f"{result['replicas']} simulated devices" if args.simulate
               else f"{result['replicas']} × {result['device']}")
    print(f"\nbench_lora: KerasHub Gemma LoRA rank 4 on JAX, {devices}, batch {result['batch']} of {result['length']} tokens, {result['steps']} "
          f"steps, median of {rounds} rounds of the fastest of {args.repeats} fits, each way and "
          "round a process of its own")
    print(f"{'way':<14}{'tokens/s':>10}{'vs magic_numpy':>16}{'vs plain_keras':>16}"
          f"{'peak MiB':>10}")
    for way in chosen:
        print(f"{way:<14}{median[way]:>10,.0f}{median[way] / median['magic_numpy']:>16.3f}"
              f"{median[way] / median['plain_keras']:>16.3f}"
              f"{result['peak_memory_mib'][way]:>10,.0f}")
    ratios = [f"{name} {result[name]:.3f}" for name in
              ("tfdata_vs_numpy", "grain_vs_numpy", "magic_vs_plain_keras")
              if result[name] is not None]
    print("   ".join(ratios))
    if result["mfu"]:
        print("MFU (the steady steps' TFLOP/s over the nominal peak): " + ", ".join(
            f"{way} {value:.2%}" for way, value in result["mfu"].items()))
    return result


if __name__ == "__main__":
    sys.exit(main())
