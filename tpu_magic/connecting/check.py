"""The quick device check (`%tpu_connect --check`): what is there, and how fast it really is."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from tpu_magic.core.chips import Chip
from tpu_magic.core.deps import installed_versions, version_warnings
from tpu_magic.core.devices import DeviceView, Memory
from tpu_magic.core.session import Connection

@dataclass(frozen=True)
class DeviceCheck:
    """What `--check` measured and found."""

    kind: str
    device_type: str
    device_count: int
    replicas: int
    memory: "Memory | None"
    versions: Mapping[str, str]
    warnings: tuple[str, ...]
    dtype: str
    matmul_size: int
    measured_tflops: float
    peak_tflops: float | None
    doctor: tuple[str, ...] = ()  # the runtime doctor's findings, each with its fix
    chip: Chip | None = None  # the chip's nominal figures, where it is known

    @property
    def share_of_peak(self) -> float | None:
        """Measured TFLOP/s as a share of the device's nominal peak."""
        return self.measured_tflops / self.peak_tflops if self.peak_tflops else None

    def summary(self) -> str:
        peak = (f" of a nominal {self.peak_tflops:g} TFLOP/s per device "
                f"({100 * self.share_of_peak:.0f} %)"
                if self.peak_tflops else " (no nominal peak known for this device)")
        chip = (f"  chip: {self.chip.name}, nominal {self.chip.peak_tflops:g} TFLOP/s "
                f"{'bf16' if self.chip.bf16 else 'fp16'} and {self.chip.memory_gib:g} GiB per chip "
                f"(source: {self.chip.source})" if self.chip else None)
        lines = [
            f"Device check: {self.device_count} × {self.device_type}, {self.replicas} "
            f"replica{'s' * (self.replicas != 1)}",
            *([chip] if chip else []),
            f"  memory: {self.memory or 'not reported by the runtime'}",
            "  versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
            f"  matmul {self.matmul_size}×{self.matmul_size} {self.dtype}: "
            f"{self.measured_tflops:.3f} TFLOP/s measured{peak}",
        ]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  doctor: {d}" for d in self.doctor]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.summary())


def run_check(s: Connection, env: Mapping[str, str] | None = None) -> DeviceCheck:
    """Lists the devices and library versions and measures matmul throughput."""
    env = os.environ if env is None else env
    view = device_view(s, env)
    dtype, n = ("bfloat16", 4096) if s.kind in ("tpu", "gpu") else ("float32", 1024)
    versions = installed_versions()
    return DeviceCheck(
        kind=s.kind, device_type=view.name, device_count=max(len(s.devices), 1),
        replicas=s.replicas, memory=view.memory, versions=versions,
        warnings=tuple(version_warnings(versions)), dtype=dtype, matmul_size=n,
        measured_tflops=view.measure(dtype, n),
        peak_tflops=view.chip.device_peak_tflops if view.chip else None,
        doctor=_doctor(s, env, versions), chip=view.chip,
    )


def device_view(s: Connection, env: Mapping[str, str] | None = None) -> DeviceView:
    """The session's first device: name, chip, memory and a matmul measurement."""
    return s.backend.device_view(s, os.environ if env is None else env)


def _doctor(s: Connection, env: Mapping[str, str], versions: Mapping[str, str]) -> tuple[str, ...]:
    from tpu_magic.connecting import doctor
    from tpu_magic.core.target import read_machine_signs

    signs = read_machine_signs()
    runtime = doctor.read_runtime(signs.tpu_vm, bool(signs.gpu_devices), env, versions)
    return tuple(str(f) for f in doctor.diagnose(runtime, backend=s.backend.name,
                                                 wants_tpu=s.kind == "tpu" and not s.simulated))
