"""The grouped examples (`support.grouped_examples`) beside plain Keras on one JAX device, in a
process of its own (a process connects once, and the JAX suite's has 8 devices), for
tests/training/published/test_grouped_examples_one_device.py.

    python examples_run.py [--auto] [NAME ...]

Keras on JAX over one simulated CPU device (`%tpu_connect --backend jax --simulate 1`),
TensorFlow blocked (run with `PYTHONPATH=tests/without_tensorflow`). Each example (all, or
those named) runs plainly, then through `%%tpu_train --steps-per-execution 4`, and is
compared within 1e-5 relative. Prints one JSON line: each example's
`grouped_examples.compare` (its differences, empty where none; K; seconds).

The default line (`--steps-per-execution auto`) runs with `--auto`; the test leaves it to
the 8-device suite: on one CPU device auto chooses one step an execution for these small
examples, Keras's own ungrouped step (the path the other one-device tests compare), at a
third of this run's time.
"""

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

from support.grouped_examples import EXAMPLES, compare  # noqa: E402
from support.shell import testing_shell  # noqa: E402

GROUPED = "--steps-per-execution 4"
ONE_DEVICE = dict(rel=1e-5, abs=1e-6)


def main() -> None:
    warnings.simplefilter("ignore")
    names = [a for a in sys.argv[1:] if a != "--auto"] or list(EXAMPLES)
    lines = [GROUPED, ""] if "--auto" in sys.argv[1:] else [GROUPED]
    shell = testing_shell()
    shell.run_line_magic("tpu_connect", "--backend jax --simulate 1 --no-panel")
    print(json.dumps({name: compare(shell, name, lines, ONE_DEVICE) for name in names}))


if __name__ == "__main__":
    main()
