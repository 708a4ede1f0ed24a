"""Chip knowledge: names runtimes use → nominal figures; memory in use against total."""

import pytest

from tpu_magic.connecting import check
from tpu_magic.core import devices
from tpu_magic.core.batching import plan_batches
from tpu_magic.core.chips import CHIPS, chip_for
from tpu_magic.core.session import Connection


@pytest.mark.parametrize("name, chip", [
    # JAX's device_kind on today's TPU VMs
    ("TPU v2", "TPU v2"), ("TPU v3", "TPU v3"), ("TPU v4", "TPU v4"),
    ("TPU v5 lite", "TPU v5e"), ("TPU v5", "TPU v5p"), ("TPU v5p", "TPU v5p"),
    ("TPU v6 lite", "TPU v6e"),
    # TPU_ACCELERATOR_TYPE on Colab, Kaggle and Cloud TPU VMs
    ("v2-8", "TPU v2"), ("v5litepod-8", "TPU v5e"), ("v5e-1", "TPU v5e"), ("v6e-1", "TPU v6e"),
    ("v6e-8", "TPU v6e"), ("v5p-8", "TPU v5p"),
    # CUDA device names
    ("Tesla T4", "NVIDIA T4"), ("NVIDIA L4", "NVIDIA L4"), ("Tesla P100-PCIE-16GB", "NVIDIA P100"),
    ("Tesla V100-SXM2-16GB", "NVIDIA V100"), ("NVIDIA A100-SXM4-80GB", "NVIDIA A100"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100"), ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H200", "NVIDIA H200"),
])
def test_runtime_names_map_to_chips(name, chip):
    assert chip_for(name).name == chip


@pytest.mark.parametrize("name", ["TPU v4 lite", "TPU7x", "cpu", "", "NVIDIA GeForce RTX 4090",
                                  "TPU"])
def test_unknown_names_have_no_chip(name):
    assert chip_for(name) is None


def test_every_figure_names_its_source_and_the_table_covers_the_issue():
    wanted = {"TPU v2", "TPU v3", "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e", "NVIDIA T4",
              "NVIDIA L4", "NVIDIA P100", "NVIDIA V100", "NVIDIA A100", "NVIDIA H100", "NVIDIA H200"}
    assert wanted <= set(CHIPS)
    for chip in CHIPS.values():
        assert chip.source and chip.peak_tflops > 0 and chip.memory_gib > 0
    assert (CHIPS["TPU v5e"].memory_gib, CHIPS["TPU v6e"].memory_gib) == (16, 32)
    assert not CHIPS["NVIDIA T4"].bf16 and CHIPS["NVIDIA A100"].bf16


def test_a_tpu_v2_device_is_one_core_half_a_chip():
    v2 = CHIPS["TPU v2"]
    assert (v2.device_peak_tflops, v2.device_memory_gib) == (22.5, 8.0)
    v5e = CHIPS["TPU v5e"]
    assert (v5e.device_peak_tflops, v5e.device_memory_gib) == (197.0, 16.0)


def test_a_kaggle_tpu_is_named_by_device_kind_and_accelerator_type():
    env = {"TPU_ACCELERATOR_TYPE": "v5litepod-8", "ISTPUVM": "1"}
    name = devices.device_name("tpu", "TPU v5 lite", False, env)
    assert name == "TPU v5 lite (v5litepod-8)"
    assert devices.chip_named("tpu", name, env).name == "TPU v5e"
    # TensorFlow gives no device kind: the accelerator type alone names the chip
    assert devices.chip_named("tpu", devices.device_name("tpu", "", False, env), env).name == "TPU v5e"
    assert devices.chip_named("cpu", "CPU (simulated TPU core)", env) is None


def test_memory_in_use_against_the_runtimes_limit_or_the_nominal_figure():
    gib = 2 ** 30
    runtime = devices.memory_of(2 * gib, 16 * gib, 3 * gib, CHIPS["TPU v5e"])
    assert str(runtime) == "2.00 GiB in use of 16.00 GiB (12 %), peak 3.00 GiB"
    nominal = devices.memory_of(4 * gib, None, None, CHIPS["TPU v6e"])
    assert str(nominal) == "4.00 GiB in use of 32.00 GiB (the chip's nominal HBM) (12 %)"
    a100 = devices.memory_of(gib, None, None, CHIPS["NVIDIA A100"], "NVIDIA A100-SXM4-80GB")
    assert a100.total_gib == 80
    assert devices.memory_of(None, None, None, None) is None


def test_the_check_shows_measured_against_nominal_and_memory(monkeypatch):
    v5e = CHIPS["TPU v5e"]
    memory = devices.memory_of(2 ** 30, 16 * 2 ** 30, None, v5e)
    view = devices.DeviceView("TPU v5 lite (v5litepod-1)", v5e, memory, lambda dtype, n: 98.5)
    monkeypatch.setattr(check, "device_view", lambda s, env=None: view)
    monkeypatch.setattr(check, "_doctor", lambda s, env, versions: ())
    one_chip = Connection(target="local", kind="tpu", replicas=1, strategy=None, backend=None,
                          devices=("TPU_0",))
    result = check.run_check(one_chip, env={})
    text = result.summary()
    assert "1 × TPU v5 lite (v5litepod-1), 1 replica\n" in text
    assert "98.500 TFLOP/s measured of a nominal 197 TFLOP/s per device (50 %)" in text
    assert "chip: TPU v5e, nominal 197 TFLOP/s bf16 and 16 GiB per chip" in text
    assert "memory: 1.00 GiB in use of 16.00 GiB (6 %)" in text
    assert result.dtype == "bfloat16" and result.share_of_peak == pytest.approx(0.5)


def test_a_single_chip_tpu_takes_the_batch_rules_of_one_replica():
    plan = plan_batches(128, 1, tpu_rules=True)
    assert (plan.per_replica, plan.warnings) == (128, ())
    advice = plan_batches(100, 1, tpu_rules=True).warnings[0]
    assert "100 samples per replica" in advice and "batch_size 128 (128 per replica) for a good start" in advice
