"""Published Keras code whose numbers a grouped loop could change, on one JAX device: every
example of `support.grouped_examples` (each names its keras-io path or Keras docstring
there) runs plainly and through `%%tpu_train --steps-per-execution 4` from the same seed
(K chosen, one step an execution on one CPU device, is left to the 8-device suite), and
must match plain Keras to 1e-5 (relative): the histories, the weights, the data a later
cell draws, its predictions and the notebook's random state. One device is a process of its
own (tests/support/examples_run.py), Keras on JAX with TensorFlow blocked, as on Colab's
TPU image. The same examples on 8 devices: tests/jax_backend/test_grouped_examples_jax.py.
"""

import json
import subprocess
import sys

import pytest

from support import TESTS
from support.grouped_examples import EXAMPLES
from support.jax_process import blocked_env, require_jax

HERE = TESTS
GROUPED = "--steps-per-execution 4"


@pytest.mark.timeout(600)
def test_grouped_published_examples_train_on_one_device_as_plain_keras():
    require_jax()
    run = subprocess.run([sys.executable, str(HERE / "support" / "examples_run.py")],
                         cwd=HERE, env=blocked_env(), capture_output=True, text=True,
                         timeout=560)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(found) == sorted(EXAMPLES)
    differ = {name: runs["lines"][GROUPED]["differ"] for name, runs in found.items()
              if runs["lines"][GROUPED]["differ"]}
    assert not differ, "\n".join(f"{name} ({EXAMPLES[name].source}):\n  " +
                                 "\n  ".join(lines) for name, lines in differ.items())
    assert {name: runs["lines"][GROUPED]["k"] for name, runs in found.items()} == \
        {name: 4 for name in EXAMPLES}
