"""Nothing a notebook started outlives it: the several-hosts rehearsal's ipyparallel engines
(about 750 MB each) and controller end when `%tpu_connect` replaces them and when the
kernel ends, shut down as a runner does or killed outright. The notebook runs as CI runs the
examples (examples/run_notebook.py, a real kernel, TensorFlow blocked); its processes are
told from others' by a variable in their environment."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from support import TESTS
from support.jax_process import blocked_env, require_jax

ROOT = TESTS.parent
MARK = "TPU_MAGIC_TEST_RUN"

COUNT_ENGINES = f"""import os
def engines(mark={{mark!r}}):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/environ", "rb") as env, open(f"/proc/{{pid}}/cmdline", "rb") as cmd, \\
                    open(f"/proc/{{pid}}/stat") as stat:
                if f"{MARK}={{mark}}".encode() in env.read() and \\
                        cmd.read().split(b"\\0")[:3][-1] == b"ipyparallel.engine" and \\
                        stat.read().rsplit(")", 1)[1].split()[0] not in "ZX":
                    found.append(pid)
        except OSError:
            pass
    return found
print("engines running:", len(engines()))"""


def marked(mark: str) -> list[str]:
    """ipyparallel's live processes (engines, nannies, controller) of the run `mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in environ and "ipyparallel" in cmdline and state != "Z":
            found.append(f"{pid} {cmdline.strip()}")
    return found


def gone(mark: str, within: float = 15.0) -> list[str]:
    """What of the run is still there after `within` seconds (an engine's nanny notices its
    engine's end in a second or two)."""
    deadline = time.monotonic() + within
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    return marked(mark)


@pytest.mark.parametrize("ending", ["shut down", "killed"])
def test_the_hosts_rehearsal_leaves_no_process_after_a_new_connect_or_the_kernel(tmp_path,
                                                                                ending):
    require_jax()
    pytest.importorskip("ipyparallel")
    mark = uuid.uuid4().hex
    count = COUNT_ENGINES.replace("{mark!r}", repr(mark))
    cells = ["%load_ext tpu_magic", "%tpu_connect --simulate 2x1", count,
             "%tpu_connect --simulate 2x1", count]
    if ending == "killed":  # a kernel that runs no clean-up of its own: its engines end it
        cells.append("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    notebook = tmp_path / "hosts.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]),
                   notebook)
    env = blocked_env(HOME=str(tmp_path), JAX_PLATFORMS="cpu", **{MARK: mark})
    try:
        done = subprocess.run([sys.executable, str(ROOT / "examples" / "run_notebook.py"),
                               str(notebook), "--timeout", "240"], capture_output=True,
                              text=True, timeout=400, cwd=tmp_path, env=env)
        seen = done.stdout + done.stderr
        # the second connect replaced the first engines: two run, not four
        assert seen.count("engines running: 2") == 2, seen
        if ending == "shut down":
            assert done.returncode == 0, seen
        assert gone(mark) == [], seen
    finally:
        for line in marked(mark):  # never leave them to the next test
            os.kill(int(line.split()[0]), 9)
