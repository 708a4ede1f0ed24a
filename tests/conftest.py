"""One real IPython shell and one TensorFlow runtime split into 8 logical CPUs for the suite.

The CPU must be split before TensorFlow runs its first op, so it happens here, when pytest
starts (before any test module is imported), through tpu_magic's own function. Tests then
connect with `--simulate 8` (8 replicas, as a TPU v2-8) or `cpu` (1 replica) as they need.

`python -m pytest tests/unit` (the pure modules' suite) starts no TensorFlow: it is
collected alone then, and its own conftest checks that nothing heavy was imported.
"""

import os
import socket
import sys
import threading
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

from tpu_magic.core.process import set_connection as set_session

REPLICAS = 8
HERE = Path(__file__).parent
# Another Keras backend needs another process: tests/test_jax.py runs that suite; the unit
# suite runs without TensorFlow in a process of its own too (tests/test_unit.py).
OWN_PROCESS = ("jax_backend", "unit")


def _unit_only(config) -> bool:
    """Whether pytest was asked for tests/unit alone."""
    args = [Path(a.split("::")[0]).resolve() for a in config.args]
    return bool(args) and all(a.is_relative_to(HERE / "unit") for a in args)


def pytest_configure(config):
    if not _unit_only(config):
        from tpu_magic.backends.tf import connect as tf_connect

        tf_connect.configure_logical_cpus(REPLICAS)


def pytest_ignore_collect(collection_path, config):
    if _unit_only(config):
        return None
    if any(collection_path == HERE / name for name in OWN_PROCESS):
        return True
    return None


def pytest_collection_modifyitems(session, config, items):
    if not _unit_only(config):
        from support import jax_suite

        jax_suite.last(items)


def pytest_collection_finish(session):
    """The JAX suite's published part starts now, beside the TensorFlow tests
    (support/jax_suite.py)."""
    if not _unit_only(session.config):
        from support import jax_suite

        jax_suite.start_beside(session.config, session.items)


def pytest_sessionfinish(session, exitstatus):
    session.config._tpu_magic_status = int(exitstatus)
    if not _unit_only(session.config):
        from support import jax_suite

        jax_suite.stop_beside(session.config)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    """Bounds pytest's final garbage collection, which can hang inside TensorFlow.

    Seen once in CI after every test had passed: freeing a partly read distributed
    iterator (`~MultiDeviceIterator`) waited for its tf.data autotune thread for ever.
    A suite that has finished must not hang CI, so after 120 s the process exits
    with the suite's own status and says why.
    """
    status = getattr(config, "_tpu_magic_status", 1)

    def give_up():
        sys.stderr.write("conftest: TensorFlow hung for 120 s while freeing memory after the "
                         f"suite ended; exiting with the suite's status {status}\n")
        sys.stderr.flush()
        os._exit(status)

    watchdog = threading.Timer(120, give_up)
    watchdog.daemon = True
    watchdog.start()


@pytest.fixture(scope="session")
def ip():
    from support.shell import testing_shell

    yield testing_shell()


@pytest.fixture
def fresh(ip):
    """No session before the test, none left after it."""
    set_session(None)
    yield ip
    set_session(None)


@pytest.fixture
def sim8(fresh):
    """A simulated 8-core TPU (MirroredStrategy over 8 logical CPUs)."""
    fresh.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    return fresh


@pytest.fixture
def digits(sim8):
    """8 simulated replicas, with sklearn's digits as `x` and `y` in the namespace."""
    from support.data import SETUP

    sim8.run_cell(SETUP)
    return sim8


@pytest.fixture
def closed_port():
    """A loopback port that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server():
    """A loopback server that accepts TCP connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()
