"""The JAX backend: the choice of backend (pure), and the JAX suite in a process of its own.

A process has one Keras backend, and this one's is TensorFlow, so tests/jax_backend
runs in a subprocess with KERAS_BACKEND=jax and 8 simulated devices. Without JAX
installed it is skipped, unless TPU_MAGIC_JAX=required (CI) makes that a failure.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_magic.backends import choose_backend
from tpu_magic.errors import ConnectError
from tpu_magic.jax_backend import host_device_flags

HERE = Path(__file__).parent
JAX = {"jax": "0.10.2"}
TF_TPU = {"tensorflow-tpu": "2.21.0", "jax": "0.10.2"}


@pytest.mark.parametrize("requested, imported, env, tpu_vm, installed, backend, why", [
    ("auto", "jax", {}, False, {}, "jax", "already imported with the jax backend"),
    ("auto", "tensorflow", {"KERAS_BACKEND": "jax"}, False, JAX, "tf", "already imported"),
    ("auto", None, {"KERAS_BACKEND": "jax"}, False, JAX, "jax", "KERAS_BACKEND=jax"),
    ("auto", None, {}, True, JAX, "jax", "TensorFlow has no TPU runtime"),
    ("auto", None, {}, True, TF_TPU, "tf", "the default"),
    ("auto", None, {}, False, JAX, "tf", "the default"),
    ("jax", None, {"KERAS_BACKEND": "tensorflow"}, False, JAX, "jax", "--backend jax"),
    ("TensorFlow", "tensorflow", {}, False, {}, "tf", "--backend tf"),
])
def test_the_backend_choice(requested, imported, env, tpu_vm, installed, backend, why):
    choice = choose_backend(requested, imported, env, tpu_vm, installed)
    assert choice.backend == backend and why in choice.reason


@pytest.mark.parametrize("importable, env, tpu_vm, backend, why", [
    # Colab's TPU image: JAX and Keras, no TensorFlow; --simulate or not, no backend named.
    ({"jax"}, {}, False, "jax", "TensorFlow cannot be imported here and JAX can"),
    ({"jax"}, {}, True, "jax", "TensorFlow cannot be imported here and JAX can"),
    ({"jax"}, {"KERAS_BACKEND": "tensorflow"}, False, "tf", "KERAS_BACKEND=tensorflow"),
    ({"jax", "tensorflow"}, {}, False, "tf", "the default"),
    (set(), {}, False, "tf", "the default"),  # neither: connect then says how to install
])
def test_auto_takes_jax_where_tensorflow_cannot_be_imported(importable, env, tpu_vm, backend,
                                                           why):
    choice = choose_backend("auto", None, env, tpu_vm, JAX, importable=frozenset(importable))
    assert choice.backend == backend and why in choice.reason


@pytest.mark.parametrize("requested, imported, message", [
    ("jax", "tensorflow", "already imported with the tensorflow backend, and a running process "
                          "cannot switch it to jax. Restart the runtime, then run `%tpu_connect "
                          "--backend jax` before importing keras"),
    ("auto", "torch", "imported with the torch backend; tpu_magic trains with tensorflow or jax"),
    ("pytorch", None, "--backend 'pytorch': use tf, jax or auto"),
])
def test_impossible_backends_say_what_to_do(requested, imported, message):
    with pytest.raises(ConnectError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        choose_backend(requested, imported, {}, False, JAX)


def test_an_earlier_device_count_in_xla_flags_is_replaced():
    flags = "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
    assert host_device_flags(flags, 8) == ("--xla_cpu_enable_fast_math=false "
                                           "--xla_force_host_platform_device_count=8")


def test_jax_after_keras_started_on_tensorflow_says_to_restart(ip):
    import keras

    assert keras.backend.backend() == "tensorflow"  # this process runs Keras on TensorFlow
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="already imported with the tensorflow backend"):
        ip.run_line_magic("tpu_connect", "--backend jax --simulate 8 --no-panel")


def test_the_jax_suite_passes_in_its_own_process(tmp_path):
    if importlib.util.find_spec("jax") is None:
        if os.environ.get("TPU_MAGIC_JAX") == "required":
            pytest.fail("TPU_MAGIC_JAX=required but jax is not installed: pip install -e '.[jax]'")
        pytest.skip("jax is not installed (pip install -e '.[jax]')")
    # No backend named: with TensorFlow blocked there, `auto` must choose JAX by itself.
    env = dict(os.environ)
    env.pop("KERAS_BACKEND", None)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(HERE / "without_tensorflow")  # TensorFlow blocked
    env["TPU_MAGIC_COMPILE_CACHE"] = str(tmp_path / "compile_cache")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "jax_backend", "--confcutdir=jax_backend"],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout
