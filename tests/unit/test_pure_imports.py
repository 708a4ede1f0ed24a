"""The training decisions this suite tests import no framework, each in a fresh process.

conftest.py checks the whole suite once it has run; this names the module that would bring a
framework in, whatever ran before it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("keras", "tensorflow", "jax")


@pytest.mark.parametrize("module", ["tpu_magic.core.batching", "tpu_magic.training.inputs.planning",
                                    "tpu_magic.training.checkpoints.store",
                                    "tpu_magic.training.checkpoints.orbax_shards",
                                    "tpu_magic.training.placement.sharding",
                                    "tpu_magic.training.request",
                                    "tpu_magic.training.placement.place",
                                    # `backends.get` imports them before choosing: a missing
                                    # framework is then said by the backend, in one line
                                    "tpu_magic.backends.tf.backend",
                                    "tpu_magic.backends.jax.backend"])
def test_the_module_imports_no_framework(module):
    code = (f"import sys, {module}\n"
            f"print(' '.join(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{module} imports {done.stdout.strip()}"
