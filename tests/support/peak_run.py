"""The memory plan against a measured peak, in a process of its own (nothing resident from
earlier work that a step could reuse without growing the process).

    python peak_run.py FLAGS...      (e.g. --plan-for v5e-8, or --shard model --mesh 2x4)

Run with `PYTHONPATH=tests/without_tensorflow`. It connects to 8 simulated devices, which
share this process's memory, trains a wide MLP once (compiling, and planning its step),
then measures a second, compiled fit: the growth of the process's resident high-water mark
(Linux's VmHWM, reset through /proc/self/clear_refs), over 8, is one device's temporaries
and outputs; the state it holds (weights, optimizer, batch) is resident already. Prints one
JSON line: the planned and measured peak a device, in bytes.
"""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

from support.shell import testing_shell  # noqa: E402

WIDE = """
import numpy as np, keras
keras.utils.set_random_seed(2)
features = np.random.RandomState(0).rand(512, 2048).astype("float32")
labels = np.random.RandomState(1).randint(0, 10, 512)
wide = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(2048, activation="relu"),
                         keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])
wide.compile(keras.optimizers.Adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
"""
FIT = "wide.fit(features, labels, batch_size=512, epochs={epochs}, shuffle=False)"


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    # the step alone: no check, and one step an execution (no group compiled beside it,
    # whose compiler memory would count in the high-water mark)
    flags = "--no-progress --verify off --steps-per-execution 1 " + " ".join(sys.argv[1:])
    shell = testing_shell()
    shell.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    report = shell.run_cell_magic("tpu_train", flags, WIDE + FIT.format(epochs=1))
    plan = report.memory_plan
    planned = float(re.search(r"memory plan: ([\d.e-]+)", plan).group(1)) * 2**30
    held = sum(float(v) * 2**30 for v in re.findall(r"(?:weights|optimizer|batch) ([\d.e-]+)",
                                                     plan))
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _status("VmRSS")
    shell.run_cell_magic("tpu_train", flags, FIT.format(epochs=2))
    grown = _status("VmHWM") - before
    print(json.dumps({"planned": planned, "measured": held + grown / 8, "plan": plan}))


if __name__ == "__main__":
    main()
