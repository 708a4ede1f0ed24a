"""The runtime doctor: table-driven over fake runtimes (environments, packages, machine signs).

Pure logic, no TensorFlow or JAX needed; never a network call.
"""

import os

import pytest

from tpu_magic.connecting.doctor import Runtime, diagnose, lock_holder, report

COLAB_TPU = {"jax": "0.7.0", "jaxlib": "0.7.0", "libtpu": "0.0.17", "keras": "3.13.0"}
KAGGLE_TPU = {"jax": "0.7.0", "keras": "3.13.0", "tensorflow-cpu": "2.20.0"}


@pytest.mark.parametrize("runtime, backend, wants_tpu, situation, fix", [
    (Runtime(keras_backend="tensorflow", installed=COLAB_TPU), "jax", False,
     "keras was imported with the tensorflow backend", "before `import keras`"),
    (Runtime(tpu_vm=True, installed={**COLAB_TPU, "tensorflow-tpu": "2.18.0"}), "jax", True,
     "tensorflow-tpu 2.18.0 is installed beside JAX", "pip uninstall -y tensorflow-tpu"),
    (Runtime(tpu_vm=True, installed={**COLAB_TPU, "tensorflow": "2.21.0"}), "jax", True,
     "the full tensorflow 2.21.0 is installed beside JAX", "pip install tensorflow-cpu"),
    (Runtime(tpu_vm=True, installed={**COLAB_TPU, "tensorflow": "2.21.0"},
             imported=frozenset({"tensorflow"})), "jax", True,
     "TensorFlow was imported before JAX", "run `%tpu_connect` before importing tensorflow"),
    (Runtime(tpu_vm=True, installed=COLAB_TPU, lock_holder="pid 4242 (python3)"), "jax", True,
     "held by another process, pid 4242 (python3)", "kill 4242"),
    (Runtime(env={"COLAB_RELEASE_TAG": "release-colab"}, installed=COLAB_TPU), None, True,
     "no TPU is attached to this Colab runtime", "Runtime > Change runtime type > TPU"),
    (Runtime(env={"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, installed=KAGGLE_TPU), None, True,
     "no TPU is attached to this Kaggle runtime", "Accelerator > TPU VM v5e-8"),
    (Runtime(gpu=True, installed={"jax": "0.7.0", "tensorflow": "2.21.0"}), "tf", False,
     "JAX and TensorFlow share this GPU", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5"),
])
def test_each_trap_is_found_with_its_fix(runtime, backend, wants_tpu, situation, fix):
    findings = diagnose(runtime, backend=backend, wants_tpu=wants_tpu)
    matching = [f for f in findings if situation in f.situation]
    assert len(matching) == 1, findings
    assert fix in matching[0].fix and str(matching[0]) in report(findings)


@pytest.mark.parametrize("runtime, backend, wants_tpu", [
    (Runtime(tpu_vm=True, installed=COLAB_TPU), "jax", True),  # Colab's TPU image, as shipped
    (Runtime(tpu_vm=True, installed=KAGGLE_TPU, env={"ISTPUVM": "1"}), "jax", True),  # Kaggle's
    (Runtime(gpu=True, installed={"jax": "0.7.0", "tensorflow": "2.21.0"},
             env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}), "jax", False),
    (Runtime(keras_backend="jax", installed=COLAB_TPU), "jax", False),
    (Runtime(installed={"tensorflow-cpu": "2.21.0"}), "tf", True),  # a laptop: nothing to say
])
def test_healthy_runtimes_get_no_finding(runtime, backend, wants_tpu):
    assert diagnose(runtime, backend=backend, wants_tpu=wants_tpu) == ()
    assert report(()) == ""


def test_the_lock_holder_is_found_through_proc(tmp_path):
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    proc = tmp_path / "proc"
    (proc / "4242" / "fd").mkdir(parents=True)
    (proc / "4242" / "comm").write_text("python3\n")
    os.symlink(lock, proc / "4242" / "fd" / "7")
    (proc / "99" / "fd").mkdir(parents=True)
    assert lock_holder(str(lock), proc) == "pid 4242 (python3)"
    assert lock_holder(str(tmp_path / "absent"), proc) is None


def test_a_failed_connect_says_what_the_doctor_finds(monkeypatch):
    from tpu_magic.connecting import connect as connect_module
    from tpu_magic.core.errors import ConnectError
    from tpu_magic.core.target import MachineSigns

    def no_tpu(*args, **kwargs):
        raise ConnectError("no TPU is attached (local)")

    monkeypatch.setattr(connect_module, "_connect", no_tpu)
    with pytest.raises(ConnectError) as error:
        connect_module.connect("local", env={"COLAB_RELEASE_TAG": "x"}, signs=MachineSigns())
    assert str(error.value).startswith("no TPU is attached (local)")
    assert "doctor: no TPU is attached to this Colab runtime: Runtime > Change runtime type" \
        in str(error.value)


def test_the_doctor_does_not_repeat_what_the_message_already_says():
    colab = Runtime(env={"COLAB_RELEASE_TAG": "x"}, installed=COLAB_TPU)
    findings = diagnose(colab, backend="jax", wants_tpu=True)
    assert findings  # on its own, the doctor names the missing TPU
    said = ("JAX finds no TPU here (Unable to initialize backend 'tpu'). No TPU is attached "
            "to this Colab runtime: Runtime > Change runtime type > a TPU, then run the "
            "notebook again.")
    assert report(findings, said) == ""
    assert report(findings, "something else").count("no TPU is attached") == 1


def test_the_doctor_runs_on_its_own_and_says_what_it_looked_at():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLAB_", "KAGGLE_"))} | {"COLAB_RELEASE_TAG": "release-colab"}
    done = subprocess.run([sys.executable, "-m", "tpu_magic.connecting.doctor", "--tpu"],
                          capture_output=True, text=True, timeout=60, cwd=root, env=env)
    lines = done.stdout.splitlines()
    assert lines[0] == "The runtime doctor" and lines[1].startswith("  machine: "), done.stdout
    assert "; a Colab runtime" in lines[1] and lines[2].startswith("  installed: ")
    from tpu_magic.core.target import read_machine_signs

    if not read_machine_signs().tpu_vm:
        assert ("  doctor: no TPU is attached to this Colab runtime: Runtime > Change runtime "
                "type > TPU, then run the notebook again") in lines
        assert done.returncode == 1  # a finding: a script can tell
    assert done.stderr == ""
