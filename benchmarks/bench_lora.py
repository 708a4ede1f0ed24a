"""A KerasHub LoRA step on 8 simulated devices: tokens/s through `%%tpu_train` with NumPy
inputs, a tf.data dataset and a grain dataset, against plain Keras on the same mesh.

    python benchmarks/bench_lora.py [--steps N] [--batch B] [--length L] [--rounds R]
        [--repeats K] [--quick] [--json PATH]

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
    if args.way == "plain_keras":  # no tpu_magic in this process: 8 CPU devices by hand
        os.environ["KERAS_BACKEND"] = "jax"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    else:
        shell.run_line_magic("load_ext", "tpu_magic")
        shell.run_line_magic("tpu_connect", "--simulate 8 --backend jax --no-panel")

    import grain
    import jax
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    sequences = args.steps * args.batch
    shell.user_ns.update(tokens(np, sequences, args.length), keras=keras, keras_hub=keras_hub,
                         tf=tf, grain=grain, VOCAB=VOCAB, batch=args.batch)
    fit, timed = FIT[args.way], []
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
    seconds = min(timed)
    result = {
        "way": args.way, "replicas": len(jax.devices()), "batch": args.batch,
        "length": args.length, "steps": args.steps, "seconds": seconds, "every_fit": timed,
        "tokens_per_second": sequences * args.length / seconds,
        "peak_memory_mib": peak_memory_mib(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {"jax": jax.__version__, "keras": keras.__version__,
                     "keras_hub": keras_hub.__version__, "grain": _version("grain"),
                     "tensorflow": tf.__version__},
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
    if args.batch % 8:
        print(f"bench_lora: batch {args.batch} is not divisible by 8 devices")
        return 2
    rounds = args.rounds or (1 if args.quick else 3)
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    runs = {way: [] for way in WAYS}
    for round_number in range(rounds):
        for way in WAYS:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                child = subprocess.run(
                    [sys.executable, "-X", "faulthandler", __file__, "--way", way,
                     "--steps", str(args.steps), "--batch", str(args.batch),
                     "--length", str(args.length), "--repeats", str(args.repeats),
                     "--json", out.name],
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
    median = {way: statistics.median(r["tokens_per_second"] for r in runs[way]) for way in WAYS}
    first = runs["magic_numpy"][-1]
    result = {key: first[key] for key in ("replicas", "batch", "length", "steps", "machine",
                                          "versions")}
    result.update(
        rounds=rounds, repeats=args.repeats, quick=args.quick, tokens_per_second=median,
        all_rounds={way: [r["tokens_per_second"] for r in runs[way]] for way in WAYS},
        peak_memory_mib={way: max(r["peak_memory_mib"] for r in runs[way]) for way in WAYS},
        tfdata_vs_numpy=median["magic_tfdata"] / median["magic_numpy"],
        grain_vs_numpy=median["magic_grain"] / median["magic_numpy"],
        magic_vs_plain_keras=median["magic_numpy"] / median["plain_keras"])
    print(f"\nbench_lora: KerasHub Gemma LoRA rank 4 on JAX, {result['replicas']} simulated "
          f"devices, batch {result['batch']} of {result['length']} tokens, {result['steps']} "
          f"steps, median of {rounds} rounds of the fastest of {args.repeats} fits, each way and "
          "round a process of its own")
    print(f"{'way':<14}{'tokens/s':>10}{'vs magic_numpy':>16}{'vs plain_keras':>16}"
          f"{'peak MiB':>10}")
    for way in WAYS:
        print(f"{way:<14}{median[way]:>10,.0f}{median[way] / median['magic_numpy']:>16.3f}"
              f"{median[way] / median['plain_keras']:>16.3f}"
              f"{result['peak_memory_mib'][way]:>10,.0f}")
    print(f"tfdata_vs_numpy {result['tfdata_vs_numpy']:.3f}   "
          f"grain_vs_numpy {result['grain_vs_numpy']:.3f}   "
          f"magic_vs_plain_keras {result['magic_vs_plain_keras']:.3f}")
    return result


if __name__ == "__main__":
    sys.exit(main())
