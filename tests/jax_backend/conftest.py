"""The JAX backend suite: one process on Keras's JAX backend and 8 simulated CPU devices.

It runs in its own process (tests/test_jax.py starts it), because a process has one
Keras backend. TensorFlow is blocked here: Colab's TPU runtimes ship JAX without it,
so the JAX path must not need it (Keras's own optional uses of TF see it as missing).
No backend is named (no KERAS_BACKEND, `%tpu_connect --simulate 8`): `auto` must find
that TensorFlow cannot be imported and choose JAX, as on Colab's TPU image.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/: the `support` package
from support.data import DIGITS, IMAGES  # noqa: E402
from support.shell import testing_shell  # noqa: E402


# TensorFlow blocked, as on Colab's TPU image (test_jax.py also puts this on PYTHONPATH).
_blocker = importlib.util.spec_from_file_location(
    "no_tensorflow", Path(__file__).parent.parent / "without_tensorflow" / "sitecustomize.py")
_blocker.loader.exec_module(importlib.util.module_from_spec(_blocker))


@pytest.fixture(scope="session")
def ip():
    shell = testing_shell()
    shell.connected = shell.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    shell.run_cell("import numpy as np, keras\n" + DIGITS + IMAGES)
    return shell


SHARED_DATA = ("digits", "x", "y", "images")


@pytest.fixture(autouse=True)
def shared_data_kept(request):
    """Each test may write its own `x` and `y` into the shared shell, as a notebook does; the
    next test still finds the digits the session's shell started with."""
    if "ip" not in request.fixturenames:
        yield
        return
    shell = request.getfixturevalue("ip")
    kept = {name: shell.user_ns[name] for name in SHARED_DATA if name in shell.user_ns}
    yield
    shell.user_ns.update(kept)


@pytest.fixture(autouse=True)
def memory_maps_relieved():
    """After each test, the memory maps relieved as a fit relieves them (`core.host_maps`:
    past half of Linux's limit, a collection, then JAX's kept programs let go). The suite
    runs hundreds of tests in one process, and its plain-Keras reference cells compile
    without a `%%tpu_train` fit's relief (docs/limits.md)."""
    yield
    import jax

    from tpu_magic.core import host_maps

    host_maps.relieve(jax.clear_caches)
