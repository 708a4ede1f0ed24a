"""The unit suite (tests/unit) runs in a process of its own with TensorFlow blocked, and in
seconds: the pure modules need no TensorFlow, Keras or JAX."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.quick
def test_the_unit_suite_passes_without_tensorflow():
    env = dict(os.environ, PYTHONPATH=str(HERE / "without_tensorflow"))
    # As a person types it, from the repository's root.
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit"],
        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
