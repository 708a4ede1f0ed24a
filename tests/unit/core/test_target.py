"""The pure target logic: forms, validation and the `auto` decision (no TensorFlow)."""

import pytest

from tpu_magic.core.errors import AddressError
from tpu_magic.core.target import MachineSigns, parse_grpc_address, parse_target, resolve_target

NONE = MachineSigns()


@pytest.mark.parametrize("text,kind,address", [
    ("cpu", "cpu", None), ("GPU", "gpu", None), ("local", "tpu", "local"),
    ("grpc://10.0.0.2:8470", "tpu", "grpc://10.0.0.2:8470"),
    ("grpc://tpu-host.example:8470", "tpu", "grpc://tpu-host.example:8470"),
    ("grpc://[::1]:8470", "tpu", "grpc://[::1]:8470"),
    ("my-tpu", "tpu", "my-tpu"),
])
def test_accepted_forms(text, kind, address):
    target = parse_target(text)
    assert (target.kind, target.address) == (kind, address)


@pytest.mark.parametrize("text,fragment", [
    ("grpc://10.0.0.2", "needs a host and a port"),
    ("grpc://:8470", "needs a host and a port"),
    ("grpc://10.0.0.2:0", "port '0'"),
    ("grpc://10.0.0.2:65536", "port '65536'"),
    ("grpc://10.0.0.2:http", "port 'http'"),
    ("grpc://999.1.1.1:8470", "not a valid host"),
    ("grpc://bad_host!:8470", "not a valid host"),
    ("grpc://[zz::1]:8470", "not an IPv6 address"),
    ("http://10.0.0.2:8470", "scheme 'http'"),
    ("10.0.0.2:8470", "write grpc://10.0.0.2:8470"),
    ("My_TPU", "is not valid"),
    ("", "is not valid"),
])
def test_bad_forms_name_the_value(text, fragment):
    with pytest.raises(AddressError) as err:
        parse_target(text)
    assert fragment in str(err.value)
    assert repr(text) in str(err.value)


def test_grpc_parts():
    assert parse_grpc_address("grpc://10.1.2.3:8470") == ("10.1.2.3", 8470)
    assert parse_grpc_address("grpc://[::1]:1") == ("::1", 1)


def test_auto_prefers_tpu_name_then_vm_then_gpu_then_cpu():
    vm = MachineSigns(accel_devices=("/dev/accel0",))
    gpu = MachineSigns(gpu_devices=("/dev/nvidia0",))
    assert resolve_target("auto", {"TPU_NAME": "my-tpu"}, vm).address == "my-tpu"
    assert resolve_target("auto", {}, vm).address == "local"
    assert "/dev/accel0" in resolve_target("auto", {}, vm).reason
    assert resolve_target("auto", {}, MachineSigns(libtpu_importable=True)).address == "local"
    assert resolve_target("auto", {}, gpu).kind == "gpu"
    cpu = resolve_target("auto", {}, NONE)
    assert cpu.kind == "cpu" and "no TPU_NAME" in cpu.reason


def test_auto_notes_obsolete_colab_tpu_addr_and_does_not_use_it():
    target = resolve_target("auto", {"COLAB_TPU_ADDR": "10.0.0.2:8470"}, NONE)
    assert target.kind == "cpu"
    assert any("obsolete" in n and "local" in n for n in target.notes)


def test_auto_rejects_a_bad_tpu_name():
    with pytest.raises(AddressError):
        resolve_target("auto", {"TPU_NAME": "grpc://nohost"}, NONE)


@pytest.mark.parametrize("env, devices, cause, fix", [
    ({}, (), "No GPU is attached to this runtime (no /dev/nvidia* device files)",
     "in Colab: Runtime > Change runtime type > a GPU"),
    ({"COLAB_RELEASE_TAG": "x"}, (), "No GPU is attached", "Runtime > Change runtime type"),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, (), "No GPU is attached",
     "Settings > Accelerator > a GPU"),
    ({}, ("/dev/nvidia0",), "This machine has a GPU (/dev/nvidia0), but the installed JAX has "
                            "no GPU support", '`pip install -U "jax[cuda12]"`'),
])
def test_no_gpu_names_its_real_cause_from_the_device_files(env, devices, cause, fix):
    from tpu_magic.backends.jax.connect import GPU_BUILD
    from tpu_magic.core.target import no_gpu_fix

    text = no_gpu_fix("JAX", env, devices, GPU_BUILD)
    assert text.startswith(cause) and fix in text
    assert "not installed" not in text
