"""The step-form comparisons on one JAX device, in a process of its own (the JAX suite's
has 8), for tests/training/fit/test_step_forms_one_device.py.

    python step_forms_run.py

Each of `support.step_forms.ONE_DEVICE` runs plainly, then through `%%tpu_train` with its
form's flag on `--simulate 1`; prints one JSON line: each comparison's largest relative
difference in the loss history and largest absolute difference in the weights.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

import numpy as np  # noqa: E402

from support.same import both  # noqa: E402
from support.shell import testing_shell  # noqa: E402
from support.step_forms import ONE_DEVICE  # noqa: E402


def main() -> None:
    shell = testing_shell()
    shell.run_line_magic("tpu_connect", "--simulate 1 --backend jax --no-panel")
    found = {}
    for name, (data, cell, flag, model) in ONE_DEVICE.items():
        plain, ours, report = both(shell, data, cell, f"--no-progress {flag}")
        theirs, mine = plain["history"].history, ours["history"].history
        loss = max(abs(a - b) / max(abs(a), 1e-12) for key in theirs
                   for a, b in zip(theirs[key], mine[key]))
        weights = max(float(np.max(np.abs(a - b))) for a, b in
                      zip(plain[model].get_weights(), ours[model].get_weights()))
        found[name] = {"history": loss, "weights": weights, "plan": report.memory_plan}
    print(json.dumps(found))


if __name__ == "__main__":
    main()
