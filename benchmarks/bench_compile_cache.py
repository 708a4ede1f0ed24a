"""JAX's persistent compilation cache: a cell's compile in a new process, cold and from cache.

    python benchmarks/bench_compile_cache.py [--pairs 3] [--simulate 8] [--json out.json]

Each pair is two fresh processes against a new, empty cache directory: the first compiles
(and fills the cache), the second is the same notebook after a restart. Both run the seeds'
CIFAR CNN (16×16 inputs) in one `%%tpu_train` cell on the JAX backend with TensorFlow blocked,
as on Colab's TPU image (tests/support/compile_cache_run.py). Prints a table, writes JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def one_run(cache: Path, out: Path, simulate: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(TESTS / "without_tensorflow"),
               TPU_MAGIC_COMPILE_CACHE=str(cache))
    env.pop("KERAS_BACKEND", None)
    env.pop("XLA_FLAGS", None)
    subprocess.run([sys.executable, str(TESTS / "support" / "compile_cache_run.py"), str(out),
                    "--model", "cnn", "--simulate", str(simulate)],
                   env=env, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--simulate", type=int, default=8)
    parser.add_argument("--json", default="bench_compile_cache.json")
    args = parser.parse_args()
    rows = []
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp) / "cache"
            cold = one_run(cache, Path(tmp) / "cold.json", args.simulate)
            warm = one_run(cache, Path(tmp) / "warm.json", args.simulate)
        rows.append({"pair": pair, "cold": cold, "warm": warm})
        print(f"pair {pair}: cold XLA {cold['xla_compile_seconds']:.2f} s "
              f"(first step {cold['first_step_seconds']:.2f} s), warm XLA "
              f"{warm['xla_compile_seconds']:.2f} s (first step {warm['first_step_seconds']:.2f} s)",
              flush=True)

    def median(run: str, key: str) -> float:
        return statistics.median(r[run][key] for r in rows)

    print(f"\n{args.simulate} simulated devices, seeds' CIFAR CNN, {args.pairs} pairs of processes")
    print(f"{'run':<22}{'programs':>18}{'XLA compile s':>15}{'first step s':>14}")
    for run, label in (("cold", "new cache (compiles)"), ("warm", "after a restart")):
        programs = (f"{rows[0][run]['misses']} compiled" if run == "cold"
                    else f"{rows[0][run]['hits']} from cache")
        print(f"{label:<22}{programs:>18}{median(run, 'xla_compile_seconds'):>15.2f}"
              f"{median(run, 'first_step_seconds'):>14.2f}")
    ratio_xla = median("warm", "xla_compile_seconds") / median("cold", "xla_compile_seconds")
    ratio_first = median("warm", "first_step_seconds") / median("cold", "first_step_seconds")
    print(f"ratio warm/cold: XLA compile {ratio_xla:.3f}, first step {ratio_first:.2f}")
    Path(args.json).write_text(json.dumps({"simulate": args.simulate, "rows": rows,
                                           "ratio_xla_compile": ratio_xla,
                                           "ratio_first_step": ratio_first}, indent=1))


if __name__ == "__main__":
    main()
