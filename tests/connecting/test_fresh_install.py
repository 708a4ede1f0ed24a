"""A `[jax]` install's first sessions, as a newcomer runs them: each session a process of its
own with TensorFlow blocked (tests/without_tensorflow, as on Colab's TPU image) and a home of
its own (Keras writes keras.json there, never in the real ~/.keras). What comes back is read
as the user sees it: one line naming the fix, never a traceback."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import RUNS
from support.jax_process import blocked_env, require_jax

SESSION = RUNS / "session_run.py"


@pytest.fixture
def home(tmp_path):
    require_jax()
    return tmp_path / "home"


def session(home: Path, *cells: str, tensorflow: bool = False) -> str:
    """What the user sees of `cells`, run in a fresh process with `home` as HOME (and
    TensorFlow blocked, unless `tensorflow`)."""
    home.mkdir(exist_ok=True)
    environ = blocked_env(HOME=str(home), JAX_PLATFORMS="cpu")
    environ.pop("KERAS_HOME", None)
    if tensorflow:
        environ.pop("PYTHONPATH")
    done = subprocess.run([sys.executable, str(SESSION), *cells], capture_output=True,
                          text=True, timeout=300, env=environ, cwd=home)
    return done.stdout + done.stderr


def usage_error(seen: str) -> str:
    """The one UsageError line the user saw; fails on a traceback or anything else."""
    assert "Traceback" not in seen, seen
    lines = [line for line in seen.splitlines() if line.startswith("UsageError: ")]
    assert len(lines) == 1, seen
    return lines[0]


def first_session(home: Path) -> None:
    """A first session that imports Keras (on JAX): Keras writes keras.json."""
    session(home, "%load_ext tpu_magic", "import keras")
    assert (home / ".keras" / "keras.json").exists()


def test_a_backend_whose_framework_is_missing_is_one_line_naming_the_install_command(home):
    first_session(home)
    seen = session(home, "%load_ext tpu_magic", "%tpu_connect --backend tf --simulate 8")
    line = usage_error(seen)
    assert line.startswith("UsageError: --backend tf: TensorFlow is not installed")
    assert "`pip install tensorflow`" in line
    # the line after it is the next cell's, not the rest of a message
    assert seen.split(line, 1)[1].strip() == ""


def test_keras_gets_jax_in_every_later_session_of_a_jax_install(home):
    first = session(home, "%load_ext tpu_magic", "import keras; print('on', keras.backend.backend())")
    assert "on jax" in first
    written = home / ".keras" / "keras.json"
    # Keras writes its default there on its first import, whatever KERAS_BACKEND says
    assert json.loads(written.read_text())["backend"] == "tensorflow"
    later = session(home, "%load_ext tpu_magic", "import keras; print('on', keras.backend.backend())")
    assert "Traceback" not in later and "on jax" in later, later
    assert ("tpu_magic: Keras will run on JAX (KERAS_BACKEND=jax): ~/.keras/keras.json names "
            "tensorflow, which cannot be imported here") in later


def test_a_gpu_jax_cannot_find_names_the_machine_not_a_missing_jax(home):
    if any(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine has a GPU")
    line = usage_error(session(home, "%load_ext tpu_magic", "%tpu_connect gpu --no-panel"))
    assert line.startswith("UsageError: JAX finds no GPU here (")
    assert "No GPU is attached to this runtime (no /dev/nvidia* device files)" in line
    assert "not installed" not in line


def test_a_backend_asked_for_that_keras_json_contradicts_is_said_with_a_fix_that_works(home):
    # beside TensorFlow (a full install, Kaggle's image): Keras writes "tensorflow" on its
    # first import, so a later session's `import keras` would not start on JAX
    seen = session(home, "%load_ext tpu_magic", "%tpu_connect --backend jax --simulate 2 --no-panel",
                   tensorflow=True)
    assert ("note: ~/.keras/keras.json names tensorflow, so a later session that imports keras "
            "before %tpu_connect starts Keras on tensorflow; to make jax its default, set "
            '"backend": "jax" there (or KERAS_BACKEND=jax)') in seen, seen
    written = home / ".keras" / "keras.json"
    config = json.loads(written.read_text())
    written.write_text(json.dumps({**config, "backend": "jax"}))  # the fix it names
    later = session(home, "%load_ext tpu_magic", "import keras; print('on', keras.backend.backend())",
                    "%tpu_connect --simulate 2 --no-panel", tensorflow=True)
    assert "on jax" in later and "Keras on JAX" in later and "note: ~/.keras" not in later, later
    # and `auto`, before keras is imported, follows it rather than Keras's default
    auto = session(home, "%load_ext tpu_magic", "%tpu_connect --simulate 2 --no-panel",
                   tensorflow=True)
    assert re.search(r"Keras on JAX \(keras\.json names jax\)", auto), auto
