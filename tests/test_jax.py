"""The JAX backend: the JAX suite in a process of its own (the pure choice of backend is in
tests/unit/test_backend_choice.py).

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

from support.jax_process import blocked_env, require_jax
from tpu_magic.backends.jax.connect import (COLLECTIVE_WAIT, COLLECTIVE_WAIT_SECONDS,
                                            host_device_flags)

HERE = Path(__file__).parent


def test_an_earlier_device_count_in_xla_flags_is_replaced():
    flags = "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
    assert host_device_flags(flags, 8, jaxlib="0.7.2") == (
        "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8")


def test_simulated_devices_wait_long_for_a_starved_device_where_jaxlib_has_the_flag():
    # XLA aborts the process when one device reaches a collective 40 s after the others, as a
    # thread of a loaded 2-core host can; jaxlib 0.7 has no such flag and would abort on it
    wait = f"{COLLECTIVE_WAIT}={COLLECTIVE_WAIT_SECONDS}"
    assert host_device_flags("", 8, jaxlib="0.8.0").split() == [
        "--xla_force_host_platform_device_count=8", wait]
    assert wait in host_device_flags("", 8, jaxlib="0.12.0.dev20260920")
    assert COLLECTIVE_WAIT not in host_device_flags("", 8, jaxlib="0.7.2")
    assert COLLECTIVE_WAIT not in host_device_flags("", 8, jaxlib="")
    users = f"{COLLECTIVE_WAIT}=5"  # the user's own setting stays
    assert host_device_flags(users, 8, jaxlib="0.10.2").split() == [
        users, "--xla_force_host_platform_device_count=8"]


def test_jax_after_keras_started_on_tensorflow_says_to_restart(ip):
    import keras

    assert keras.backend.backend() == "tensorflow"  # this process runs Keras on TensorFlow
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="already imported with the tensorflow backend"):
        ip.run_line_magic("tpu_connect", "--backend jax --simulate 8 --no-panel")


# The JAX suite in two processes, each bounded by its own limit: published and unseen code
# (test_unseen_jax.py: KerasHub models, about 20 minutes on a cold compilation cache on
# 2 cores) and the rest (the backend, plain-Keras parity, several hosts: about 12). One
# process for all took 30 minutes cold, past one limit, with nothing wrong.
JAX_SUITE_PARTS = {
    "backend_and_hosts": ["jax_backend", "--ignore=jax_backend/test_unseen_jax.py"],
    "unseen": ["jax_backend/test_unseen_jax.py"],
}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One JAX compilation cache for both parts (programs the two share compile once)."""
    return tmp_path_factory.mktemp("compile_cache")


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("part", sorted(JAX_SUITE_PARTS))
def test_the_jax_suite_passes_in_its_own_process(compile_cache, part):
    require_jax()
    # No backend named: with TensorFlow blocked there, `auto` must choose JAX by itself.
    env = blocked_env(TPU_MAGIC_COMPILE_CACHE=str(compile_cache))
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-v", *JAX_SUITE_PARTS[part],
             "--confcutdir=jax_backend"],
            cwd=HERE, env=env, capture_output=True, text=True, timeout=2300)
    except subprocess.TimeoutExpired as exc:  # say how far it got
        done = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"the JAX suite's {part} part ran past 2300 s; it got to:\n{done[-3000:]}")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = run.stdout.strip().splitlines()[-1]  # "== 61 passed in 700.00s (0:11:40) =="
    assert " passed" in summary and "skipped" not in summary, summary


def test_import_keras_before_connect_runs_on_jax_where_tensorflow_cannot_be_imported(tmp_path):
    # issue 34: in a clean `[jax]` install `import keras` before `%tpu_connect` died inside
    # Keras (it defaults to TensorFlow); %load_ext now makes JAX the default there, and says so
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed (pip install -e '.[jax]')")
    env = blocked_env(KERAS_HOME=str(tmp_path))
    script = (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'tpu_magic')\n"
        "ip.run_cell('import keras\\nbackend = keras.backend.backend()', store_history=False)\n"
        "print('backend:', ip.user_ns.get('backend'))\n"
        "r = ip.run_line_magic('tpu_connect', '--simulate 2 --no-panel')\n"
        "print('connected:', r.backend, r.replicas)\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=HERE.parent, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == ("tpu_magic: Keras will run on JAX (KERAS_BACKEND=jax): TensorFlow, its "
                        "default, cannot be imported here")
    assert "backend: jax" in lines and "connected: jax 2" in lines, run.stdout


@pytest.mark.timeout(600)
def test_a_tf_data_cell_on_hosts_equals_one_process_where_tensorflow_is_installed():
    # issue 32: Kaggle's TPU image has JAX with tensorflow-cpu, so a cell's tf.data pipeline
    # (shuffled, mapped, a short last batch, validation and evaluate) runs on every host;
    # the hosts suite blocks TensorFlow, so this runs in a process of its own
    # (tests/hosts_tfdata_run.py), TensorFlow importable, Keras on JAX
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("ipyparallel") is None:
        if os.environ.get("TPU_MAGIC_JAX") == "required":
            pytest.fail("TPU_MAGIC_JAX=required but jax or ipyparallel is not installed")
        pytest.skip("jax and ipyparallel are not installed (pip install -e '.[hosts]')")
    import json

    env = {k: v for k, v in os.environ.items()
           if k not in ("KERAS_BACKEND", "XLA_FLAGS", "PYTHONPATH")}
    run = subprocess.run([sys.executable, str(HERE / "hosts_tfdata_run.py")], cwd=HERE,
                         env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    one, hosts = found["one"], found["hosts"]
    assert one["replicas"] == hosts["replicas"] == 8
    for key, values in one["history"].items():  # validation too
        assert hosts["history"][key] == pytest.approx(values, rel=1e-5), key
    for key, value in one["evaluation"].items():
        assert hosts["evaluation"][key] == pytest.approx(value, rel=1e-5), key
