"""Keras on JAX, K steps an execution: every step trains on the batch plain Keras trains on
at one step an execution, and a fit leaves the notebook's random state where plain Keras
leaves it (issue 55). Over a grid of input kinds (arrays, with a short last batch and
shuffled; tf.data, ending and repeated; a PyDataset; a generator), `steps_per_epoch`
(none, dividing the input's 40 batches or not, past its end), K (auto, 3, 6),
`initial_epoch`, `validation_steps` and `validation_freq`, on one device and on 8; each
in a JAX process of its own where TensorFlow can be imported (tests/support/reads_run.py).
"""

import json
import os
import subprocess
import sys

import pytest

from support import TESTS
from support.jax_process import require_jax

HERE = TESTS


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 8])
def test_every_step_reads_what_plain_keras_reads_and_the_random_state_is_kept(devices):
    require_jax()
    env = {k: v for k, v in os.environ.items()
           if k not in ("KERAS_BACKEND", "XLA_FLAGS", "PYTHONPATH")}
    run = subprocess.run([sys.executable, str(HERE / "support" / "reads_run.py"), str(devices)],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["fits"] >= 90
    shown = "\n".join(f"{d['fit']} {d['line']}\n  plain: {d['plain']}\n  magic: {d['magic']}"
                      for d in found["differ"][:3])
    assert not found["differ"], f"{len(found['differ'])} fits read other batches:\n{shown}"
    assert not found["random_states"], found["random_states"]
