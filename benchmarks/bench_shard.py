"""Data against model sharding on 8 simulated devices: step time and one device's memory.

    python benchmarks/bench_shard.py [--rounds 3] [--width 1024] [--json bench_shard.json]

Each way (`--shard data`, `--shard model` on meshes 1x8 and 2x4) trains the same
transformer block (Embedding, 8-head attention, two Dense layers of `--width`) on token ids
in one `%%tpu_train` cell, in a process of its own (Keras on JAX, TensorFlow blocked), the
rounds interleaved. Per way: the steady step time (median over rounds), the weights one
device holds (from the variables' shards) and the memory plan's peak for one device (XLA's
memory analysis of the compiled step; for data sharding planned with `--plan-for`).
Prints a table, writes JSON. On a 2-core CPU the 8 devices share the cores: read the ratios
of memory, not of time, as what a TPU slice would show.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
WAYS = {"data": "--shard data --plan-for v5e-8", "model 1x8": "--shard model --mesh 1x8",
        "model 2x4": "--shard model --mesh 2x4"}

CHILD = textwrap.dedent("""
    import json, re, sys
    sys.path.insert(0, {tests!r})
    from support.shell import testing_shell
    ip = testing_shell()
    ip.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    ip.run_cell('''
    import numpy as np, keras
    keras.utils.set_random_seed(5)
    tokens = np.random.RandomState(0).randint(1, 1024, (512, 32))
    targets = np.random.RandomState(1).randint(0, 1024, (512, 32))
    ''')
    report = ip.run_cell_magic("tpu_train", "--no-progress " + {line!r}, '''
    inputs = keras.Input((32,), dtype="int32")
    hidden = keras.layers.Embedding(1024, {width})(inputs)
    hidden = keras.layers.MultiHeadAttention(num_heads=8, key_dim={width} // 8)(hidden, hidden)
    hidden = keras.layers.Dense(4 * {width}, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1024)(hidden))
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tokens, targets, batch_size=64, epochs=2, verbose=0)
    ''')
    model = ip.user_ns["model"]
    weights = sum(w.value.addressable_shards[0].data.nbytes for w in model.weights)
    peak = re.search(r"memory plan: ([\\d.e-]+)", report.memory_plan or "")
    json.dump({{"step_seconds": 64 / report.samples_per_second,
               "tokens_per_second": report.tokens_per_second,
               "weights_mib": weights / 2**20,
               "planned_peak_mib": float(peak.group(1)) * 1024 if peak else None}},
              open(sys.argv[1], "w"))
""")


def one_run(line: str, width: int, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(TESTS / "without_tensorflow"))
    for name in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(name, None)
    code = CHILD.format(tests=str(TESTS), line=line, width=width)
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True,
                   capture_output=True, text=True, timeout=900)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--json", default="bench_shard.json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    out = Path(args.json).with_suffix(".run.json")
    for _ in range(args.rounds):
        for way, line in WAYS.items():
            runs[way].append(one_run(line, args.width, out))
    out.unlink(missing_ok=True)
    rows = []
    print(f"{'way':<12}{'step s':>10}{'tokens/s':>12}{'weights MiB/device':>20}"
          f"{'planned peak MiB/device':>25}")
    for way, found in runs.items():
        row = {"way": way,
               "step_seconds": statistics.median(r["step_seconds"] for r in found),
               "tokens_per_second": statistics.median(r["tokens_per_second"] for r in found),
               "weights_mib": found[0]["weights_mib"],
               "planned_peak_mib": found[0]["planned_peak_mib"]}
        rows.append(row)
        print(f"{way:<12}{row['step_seconds']:>10.3f}{row['tokens_per_second']:>12,.0f}"
              f"{row['weights_mib']:>20.2f}{row['planned_peak_mib'] or float('nan'):>25.2f}")
    Path(args.json).write_text(json.dumps({"width": args.width, "rounds": args.rounds,
                                           "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
