"""It fits (issue 58), on one JAX device: micro-batches inside the step and rematerialized
blocks give plain Keras's full-batch numbers (1e-5), in a process of its own
(tests/support/step_forms_run.py); 8 devices and a model-parallel mesh:
tests/jax_backend/test_step_forms_jax.py."""

import json
import subprocess
import sys

import pytest

from support import TESTS
from support.jax_process import blocked_env, require_jax

HERE = TESTS


@pytest.mark.timeout(600)
def test_step_forms_on_one_device_equal_plain_keras_at_the_full_batch():
    require_jax()
    run = subprocess.run([sys.executable, str(HERE / "support" / "step_forms_run.py")],
                         cwd=HERE, env=blocked_env(), capture_output=True, text=True,
                         timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(found) == 4
    for name, result in found.items():
        assert result["history"] < 1e-5 and result["weights"] < 1e-5, (name, result)
        assert "micro-batches" in result["plan"] or "rematerialized" in result["plan"], name
