"""The JAX suite's parts, each a pytest process of its own, KERAS_BACKEND=jax and 8 simulated
devices, TensorFlow blocked (tests/test_jax.py asserts on what they print).

Two parts, each bounded by its own limit: published and unseen code (jax_backend/published/:
KerasHub models, mostly XLA's compiles of them) and the rest (the backend, plain-Keras
parity, several hosts). One process for all took 30 minutes cold, past one limit, with
nothing wrong.

The published part starts in the background as soon as pytest has collected a session that
runs it (tests/conftest.py calls `start_beside`) and runs beside TensorFlow's tests: neither
keeps both cores busy, so side by side they take about the time of the longer, where one
after the other they took both (CONTRIBUTING.md has the figures). The other part runs alone,
last (`last`): its K decisions come from timed steps and its hosts' tests from timeouts,
which a machine shared with another suite would stretch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from support.jax_process import TESTS, blocked_env

PARTS = {
    "backend_and_hosts": ["jax_backend", "--ignore=jax_backend/published"],
    "published": ["jax_backend/published"],
}
BESIDE = "published"  # the part run beside TensorFlow's tests
DRIVER = "tests/test_jax.py::test_the_jax_suite_passes_in_its_own_process"

# A process that dies (XLA aborts it, for one) takes pytest's captured output with it. So the
# suite captures at Python's level only: what XLA writes to the process's stderr (why it
# aborted, which collective waited) reaches this process, and each test's line gives its
# seconds. A test blocked inside XLA never sees pytest-timeout's signal (300 s, setup.cfg):
# past 330 s faulthandler writes every thread's Python stack there too.
SAYS_HOW_IT_DIED = ["--capture=sys", "-o", "console_output_style=times",
                    "-o", "faulthandler_timeout=330"]
SECONDS = 2900  # a part's limit, from its start

_STARTED = pytest.StashKey["Started"]()
_CACHE = pytest.StashKey[Path]()


class PartTimedOut(Exception):
    """A part ran past its limit; the message is how far it got."""


@dataclass(frozen=True)
class Started:
    """A part's running process, its output going to files (a pipe nobody reads would fill
    and stop it while it runs in the background)."""

    part: str
    process: subprocess.Popen
    stdout: IO[str]
    stderr: IO[str]
    deadline: float

    def finish(self) -> subprocess.CompletedProcess:
        """Its outcome, once it ends (by its deadline: killed there, `PartTimedOut`)."""
        try:
            self.process.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.stop()
            raise PartTimedOut(f"the JAX suite's {self.part} part ran past {SECONDS} s; it "
                               f"got to:\n{_read(self.stdout)[-3000:]}") from None
        return subprocess.CompletedProcess(self.process.args, self.process.returncode,
                                           _read(self.stdout), _read(self.stderr))

    def stop(self) -> None:
        """Ends it and whatever it started, where it still runs."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _read(file: IO[str]) -> str:
    file.seek(0)
    return file.read()


def start(part: str, env: dict, deadline: float, extra: list[str] = ()) -> Started:
    """`part`'s pytest process, started in tests/ (`extra`: more arguments)."""
    out, err = (tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
                for _ in range(2))
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-v", *PARTS[part], "--confcutdir=jax_backend",
         *SAYS_HOW_IT_DIED, *extra],
        cwd=TESTS, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
    return Started(part, process, out, err, deadline)


def environment(config: pytest.Config) -> dict:
    """A part's environment: TensorFlow blocked, no backend named (`auto` must choose JAX
    by itself), one JAX compilation cache for both parts (what they share compiles once)."""
    if _CACHE not in config.stash:
        config.stash[_CACHE] = Path(tempfile.mkdtemp(prefix="tpu_magic_jax_cache_"))
    return blocked_env(TPU_MAGIC_COMPILE_CACHE=str(config.stash[_CACHE]))


def start_beside(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Starts the `BESIDE` part now, where this session runs it and JAX is installed (where
    it is not, the test says so)."""
    import importlib.util

    if importlib.util.find_spec("jax") is None or config.option.collectonly:
        return
    if any(item.nodeid == f"{DRIVER}[{BESIDE}]" for item in items):
        config.stash[_STARTED] = start(BESIDE, environment(config),
                                       time.monotonic() + SECONDS)


def started(config: pytest.Config, part: str) -> Started | None:
    """The part's process started beside the other tests, taken (once), or None."""
    begun = config.stash.get(_STARTED, None)
    if begun is None or begun.part != part:
        return None
    del config.stash[_STARTED]
    return begun


def stop_beside(config: pytest.Config) -> None:
    """At the session's end: a part started beside that no test waited for (a session cut
    short) is stopped, and the compilation cache removed."""
    begun = config.stash.get(_STARTED, None)
    if begun is not None:
        begun.stop()
    if _CACHE in config.stash:
        import shutil

        shutil.rmtree(config.stash[_CACHE], ignore_errors=True)


def last(items: list[pytest.Item]) -> None:
    """Puts the parts' tests last (in place, as pytest's hook asks), the part run beside
    first: by then it has mostly run, and the other part then has the machine alone."""
    parts = [item for item in items if item.nodeid.startswith(DRIVER + "[")]
    parts.sort(key=lambda item: not item.nodeid.endswith(f"[{BESIDE}]"))
    items[:] = [item for item in items if item not in parts] + parts


def passed_tests(stdout: str, folder: Path = TESTS) -> list[str]:
    """The ids (as `--deselect` takes them: from pytest's rootdir) of the tests a `pytest -v`
    run in `folder` says passed."""
    rootdir = Path(re.search(r"^rootdir: (.+)$", stdout, re.M).group(1))
    shown = re.findall(r"^(\S.*?::.*?) PASSED", stdout, re.M)
    return [(folder / test).relative_to(rootdir).as_posix() for test in shown]


def how_it_ended(run: subprocess.CompletedProcess) -> str:
    """The test it died in is the stdout's last line."""
    return f"Its stdout ends:\n{run.stdout[-3000:]}\nIts stderr ends:\n{run.stderr[-20000:]}"
