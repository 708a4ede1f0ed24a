"""What each accelerator can do on paper: nominal bf16 peak and memory per chip.

Pure data and lookups, no TensorFlow or JAX. `--check` sets a measurement against
these figures, and precision and utilization read them.

Figures are dense (no sparsity) bf16 TFLOP/s per chip; where a GPU has no bf16
(T4, P100, V100), its fp16 figure, with `bf16=False`. Memory is HBM (GPU memory) per
chip in GiB as the vendor states it. TPU v2 and v3 have two TensorCores per chip and
every runtime shows each core as its own device; from v4 on one device is one chip
(v4 and v5p join their two cores as one "megacore"; v5e and v6e have one core).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One accelerator chip's nominal figures.

    Attributes:
        name: the usual name, e.g. "TPU v5e", "NVIDIA T4".
        kind: "tpu" or "gpu".
        peak_tflops: dense bf16 TFLOP/s per chip (fp16 where `bf16` is False).
        memory_gib: HBM per chip.
        bf16: whether the chip computes bf16 natively (else fp16 is its fast type).
        devices_per_chip: devices a runtime shows per chip (2 on TPU v2/v3: one per core).
        source: where the figures come from.
    """

    name: str
    kind: str
    peak_tflops: float
    memory_gib: float
    bf16: bool
    devices_per_chip: int
    source: str

    @property
    def device_peak_tflops(self) -> float:
        """The nominal peak of one device as a runtime shows it."""
        return self.peak_tflops / self.devices_per_chip

    @property
    def device_memory_gib(self) -> float:
        return self.memory_gib / self.devices_per_chip


_CLOUD_TPU = "Google Cloud TPU system architecture, cloud.google.com/tpu/docs/"
CHIPS: dict[str, Chip] = {c.name: c for c in (
    # TPUs: "Peak compute per chip (bf16)" and "HBM2 capacity per chip" in each version's page.
    Chip("TPU v2", "tpu", 45.0, 16.0, True, 2, _CLOUD_TPU + "v2"),
    Chip("TPU v3", "tpu", 123.0, 32.0, True, 2, _CLOUD_TPU + "v3"),
    Chip("TPU v4", "tpu", 275.0, 32.0, True, 1, _CLOUD_TPU + "v4"),
    Chip("TPU v5e", "tpu", 197.0, 16.0, True, 1, _CLOUD_TPU + "v5e"),
    Chip("TPU v5p", "tpu", 459.0, 95.0, True, 1, _CLOUD_TPU + "v5p"),
    Chip("TPU v6e", "tpu", 918.0, 32.0, True, 1, _CLOUD_TPU + "v6e"),
    # GPUs: the vendor's datasheet, dense tensor-core figures (the headline ones with
    # sparsity are twice these), SXM parts where a PCIe one differs.
    Chip("NVIDIA P100", "gpu", 18.7, 16.0, False, 1,
         "NVIDIA Tesla P100 datasheet (PCIe 16 GB: 18.7 TFLOP/s fp16)"),
    Chip("NVIDIA V100", "gpu", 125.0, 16.0, False, 1,
         "NVIDIA V100 datasheet (SXM2: 125 TFLOP/s tensor fp16; 16 or 32 GB)"),
    Chip("NVIDIA T4", "gpu", 65.0, 16.0, False, 1,
         "NVIDIA T4 datasheet (65 TFLOP/s mixed fp16, 16 GB GDDR6)"),
    Chip("NVIDIA A10", "gpu", 125.0, 24.0, True, 1, "NVIDIA A10 datasheet (125 TFLOP/s bf16)"),
    Chip("NVIDIA L4", "gpu", 121.0, 24.0, True, 1,
         "NVIDIA L4 datasheet (242 TFLOP/s bf16 with sparsity, 121 dense; 24 GB)"),
    Chip("NVIDIA A100", "gpu", 312.0, 40.0, True, 1,
         "NVIDIA A100 datasheet (312 TFLOP/s bf16 dense; 40 or 80 GB)"),
    Chip("NVIDIA L40S", "gpu", 362.0, 48.0, True, 1,
         "NVIDIA L40S datasheet (733 TFLOP/s bf16 with sparsity, 362 dense)"),
    Chip("NVIDIA H100", "gpu", 989.0, 80.0, True, 1,
         "NVIDIA H100 datasheet (SXM: 1,979 TFLOP/s bf16 with sparsity, 989 dense; 80 GB)"),
    Chip("NVIDIA H200", "gpu", 989.0, 141.0, True, 1,
         "NVIDIA H200 datasheet (SXM: 989 TFLOP/s bf16 dense; 141 GB HBM3e)"),
)}

# The names runtimes use: JAX's `device_kind` ("TPU v5 lite" is a v5e, a bare "TPU v5" a
# v5p; "TPU v4 lite" is an inference chip, not listed), TPU VM accelerator types
# ("v5litepod-8", "v6e-1", "v2-8") and CUDA device names ("Tesla T4",
# "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3").
_TPU_NAMES = {("v2", ""): "TPU v2", ("v3", ""): "TPU v3", ("v4", ""): "TPU v4",
              ("v5", "lite"): "TPU v5e", ("v5litepod", ""): "TPU v5e", ("v5e", ""): "TPU v5e",
              ("v5", ""): "TPU v5p", ("v5p", ""): "TPU v5p",
              ("v6", "lite"): "TPU v6e", ("v6e", ""): "TPU v6e"}
# PCIe cards that run slower than the SXM part of the same name.
_PCIE = {
    "H100": Chip("NVIDIA H100 PCIe", "gpu", 756.0, 80.0, True, 1,
                 "NVIDIA H100 datasheet (PCIe: 1,513 TFLOP/s bf16 with sparsity, 756 dense)"),
    "V100": Chip("NVIDIA V100 PCIe", "gpu", 112.0, 16.0, False, 1,
                 "NVIDIA V100 datasheet (PCIe: 112 TFLOP/s tensor fp16)"),
}
_GPU_MODELS = ("H200", "H100", "A100", "L40S", "A10", "L4", "T4", "V100", "P100")


def chip_for(name: str) -> Chip | None:
    """The chip a runtime's device name or accelerator type names, or None if unknown.

    >>> [chip_for(n).name for n in ("TPU v5 lite", "v6e-1", "TPU v5", "Tesla T4")]
    ['TPU v5e', 'TPU v6e', 'TPU v5p', 'NVIDIA T4']
    """
    words = name.lower().replace("-", " ").replace("_", " ").split()
    if words[:1] == ["tpu"]:
        words = words[1:]
    if words and re.fullmatch(r"v\d\w*", words[0]):
        lite = "lite" if words[1:2] == ["lite"] else ""
        chip = _TPU_NAMES.get((words[0], lite))
        return CHIPS[chip] if chip else None
    words = name.upper().replace("-", " ").split()
    for word in words:
        if word in _GPU_MODELS:
            return _PCIE.get(word, CHIPS[f"NVIDIA {word}"]) if "PCIE" in words else CHIPS[f"NVIDIA {word}"]
    return None


def gpu_memory_gib(chip: Chip, device_name: str) -> float:
    """A GPU's memory where its name says which variant it is ("A100-SXM4-80GB", "V100 32GB")."""
    for word in device_name.upper().replace("-", " ").split():
        if word.endswith("GB") and word[:-2].isdigit():
            return float(word[:-2])
    return chip.memory_gib
