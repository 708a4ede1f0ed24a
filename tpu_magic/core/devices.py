"""What a backend tells of a device: its name, its chip, its memory, and a timing loop.

Backends fill these in (`Backend.device_view`); `--check`, the panel's device line and the
reports read them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tpu_magic.core.chips import Chip, chip_for, gpu_memory_gib


def runs_per_second(run: Callable[[], Any], finish: Callable[[Any], Any],
                    min_seconds: float = 0.3) -> float:
    """Calls `run` (asynchronous work) for at least `min_seconds`, waiting for every 4th result."""
    runs, start = 0, time.perf_counter()
    while True:
        result = run()
        runs += 1
        if runs % 4 == 0:
            finish(result)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                return runs / elapsed


@dataclass(frozen=True)
class Memory:
    """A device's memory: what is in use against what there is.

    Attributes:
        in_use_gib / peak_gib: allocated now and at most so far, where the runtime says.
        total_gib: the memory there is; `total_from` says whose figure it is: "runtime"
            (the allocator's limit), "nominal" (the chip table) or "host" (the CPU's RAM).
    """

    in_use_gib: float | None
    total_gib: float | None
    total_from: str = "runtime"
    peak_gib: float | None = None

    def __str__(self) -> str:
        total = (f"{self.total_gib:.2f} GiB" + {"nominal": " (the chip's nominal HBM)",
                                                "host": " host RAM"}.get(self.total_from, "")
                 if self.total_gib is not None else None)
        if self.in_use_gib is None:
            return total or "not reported by the runtime"
        text = f"{self.in_use_gib:.2f} GiB in use" + (f" of {total}" if total else "")
        if self.in_use_gib is not None and self.total_gib:
            text += f" ({100 * self.in_use_gib / self.total_gib:.0f} %)"
        return text + (f", peak {self.peak_gib:.2f} GiB" if self.peak_gib is not None else "")


def memory_of(in_use: int | None, limit: int | None, peak: int | None,
              chip: Chip | None, device_name: str = "") -> Memory | None:
    """`Memory` from a runtime's byte counts, the total from the chip table where it gives none."""
    gib = 2.0 ** 30
    if limit:
        total, source = limit / gib, "runtime"
    elif chip is not None:
        total = (gpu_memory_gib(chip, device_name) if chip.kind == "gpu"
                 else chip.device_memory_gib)
        source = "nominal"
    else:
        total, source = None, "runtime"
    if in_use is None and total is None:
        return None
    return Memory(None if in_use is None else in_use / gib, total, source,
                  None if peak is None else peak / gib)


def host_memory() -> Memory | None:
    """The CPU's RAM (a CPU device's memory)."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return Memory(None, pages * size / 2**30, "host")


@dataclass(frozen=True)
class DeviceView:
    """A backend's view of the session's first device.

    Attributes:
        name: as the runtime names it ("TPU v5 lite", "Tesla T4", "CPU (simulated TPU core)").
        chip: its nominal figures, where the name is a known chip.
        memory: in use against total, where known.
        measure: `measure(dtype, n)`: TFLOP/s of n×n matmuls on it.
    """

    name: str
    chip: Chip | None
    memory: Memory | None
    measure: Callable[[str, int], float]


def device_name(kind: str, runtime_name: str, simulated: bool, env: Mapping[str, str]) -> str:
    """The device's name for people: the runtime's, with the TPU VM's accelerator type."""
    if simulated:
        return "CPU (simulated TPU core)"
    accelerator = env.get("TPU_ACCELERATOR_TYPE", "")  # e.g. "v5litepod-8", "v6e-1", "v2-8"
    if kind == "tpu":
        name = runtime_name if runtime_name.upper().startswith("TPU") else "TPU"
        return f"{name} ({accelerator})" if accelerator else name
    return runtime_name or kind.upper()


def chip_named(kind: str, name: str, env: Mapping[str, str]) -> Chip | None:
    """The chip for a device: from its name, or on a TPU from the accelerator type."""
    if kind not in ("tpu", "gpu"):
        return None
    chip = chip_for(name.split(" (")[0])
    if chip is None and kind == "tpu":
        chip = chip_for(env.get("TPU_ACCELERATOR_TYPE", ""))
    return chip if chip is not None and chip.kind == kind else None


@dataclass(frozen=True)
class StepMemory:
    """What one device holds during a training step, from the compiler's memory analysis of
    the step lowered for the real mesh (bytes).

    Attributes:
        weights / optimizer / batch: the step's arguments, by kind.
        temporaries: what the step allocates while it runs (activations, gradients).
        outputs: outputs not written in place of their arguments.
        compiled_on: the devices the analysis was compiled for ("cpu", "tpu", "gpu").
        flops: the step's FLOPs on one device, from the same executable's cost analysis
            (None: not counted); the memory plan ranks the forms that fit by it.
        devices: the devices the step runs on (its FLOPs on all: `flops` × `devices`).
    """

    weights: int
    optimizer: int
    batch: int
    temporaries: int
    outputs: int
    compiled_on: str
    flops: float | None = None
    devices: int = 1

    @property
    def peak(self) -> int:
        return self.weights + self.optimizer + self.batch + self.temporaries + self.outputs
