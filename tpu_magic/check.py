"""The quick device check (`%tpu_connect --check`): what is there, and how fast it really is."""

from __future__ import annotations

import importlib.metadata
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tpu_magic.session import Session

# Nominal dense bf16 peaks in TFLOP/s per device as TensorFlow lists it: one TPU
# core on v2/v3 (two cores a chip), one chip from v4 on; fp16/bf16 tensor cores on GPUs.
TPU_PEAKS = {"v2": 22.5, "v3": 61.5, "v4": 275.0, "v5e": 197.0, "v5litepod": 197.0,
             "v5p": 459.0, "v6e": 918.0}
GPU_PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
             "A10G": 125.0, "A10": 125.0, "T4": 65.0, "V100": 125.0, "P100": 18.7}

PACKAGES = ("tensorflow", "tensorflow-cpu", "tensorflow-tpu", "keras", "jax", "jaxlib", "libtpu")


@dataclass(frozen=True)
class DeviceCheck:
    """What `--check` measured and found."""

    kind: str
    device_type: str
    device_count: int
    replicas: int
    memory: str | None
    versions: Mapping[str, str]
    warnings: tuple[str, ...]
    dtype: str
    matmul_size: int
    measured_tflops: float
    peak_tflops: float | None
    doctor: tuple[str, ...] = ()  # the runtime doctor's findings, each with its fix

    def summary(self) -> str:
        peak = (f" of a nominal {self.peak_tflops:g} TFLOP/s peak "
                f"({100 * self.measured_tflops / self.peak_tflops:.0f} %)"
                if self.peak_tflops else " (no nominal peak known for this device)")
        lines = [
            f"Device check: {self.device_count} × {self.device_type}, {self.replicas} replicas",
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


def installed_versions() -> dict[str, str]:
    """Versions of the packages that must fit together, for those installed."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def version_warnings(versions: Mapping[str, str]) -> list[str]:
    """Combinations that are known not to work together."""
    warnings = []
    flavours = [n for n in ("tensorflow", "tensorflow-cpu", "tensorflow-tpu") if n in versions]
    if len(flavours) > 1:
        distinct = {versions[n] for n in flavours}
        if len(distinct) > 1:
            warnings.append(
                "TensorFlow flavours of different versions are installed ("
                + ", ".join(f"{n} {versions[n]}" for n in flavours)
                + "): they share one `tensorflow` package; keep one, e.g. "
                f"`pip uninstall -y {' '.join(f for f in flavours if f != flavours[-1])}`."
            )
    keras = versions.get("keras")
    if keras and int(keras.split(".")[0]) < 3:
        warnings.append(f"keras {keras} is older than 3: `pip install -U \"keras>=3\"`.")
    if "jax" in versions and "jaxlib" in versions:
        if versions["jax"].split(".")[:2] != versions["jaxlib"].split(".")[:2]:
            warnings.append(f"jax {versions['jax']} and jaxlib {versions['jaxlib']} differ.")
    if "libtpu" in versions and "tensorflow-tpu" not in versions and "jax" not in versions:
        warnings.append("libtpu is installed but neither tensorflow-tpu nor jax can use it.")
    return warnings


def nominal_peak(kind: str, device_name: str, env: Mapping[str, str]) -> float | None:
    """The nominal bf16 peak of a known device, or None."""
    if kind == "tpu":
        accel = env.get("TPU_ACCELERATOR_TYPE", "").lower()  # e.g. "v2-8", "v5litepod-1"
        generation = accel.split("-")[0]
        return TPU_PEAKS.get(generation)
    if kind == "gpu":
        for model, peak in GPU_PEAKS.items():
            if model in device_name.upper().replace("TESLA ", ""):
                return peak
    return None


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


def measure_matmul(tf: Any, device: str, dtype: str, n: int, min_seconds: float = 0.3) -> float:
    """TFLOP/s of repeated n×n matmuls on one device, after a warm-up run."""
    with tf.device(device):
        a = tf.random.uniform((n, n), dtype=tf.float32)
        a = tf.cast(a, dtype)
        b = tf.identity(a)
        tf.linalg.matmul(a, b).numpy()  # warm-up: kernel selection, transfers
        rate = runs_per_second(lambda: tf.linalg.matmul(a, b), lambda c: c.numpy(), min_seconds)
    return 2.0 * n ** 3 * rate / 1e12


def device_memory(tf: Any, kind: str, device: str) -> str | None:
    if kind in ("gpu", "tpu"):
        try:
            info = tf.config.experimental.get_memory_info(device.lstrip("/").upper())
        except (ValueError, RuntimeError, tf.errors.OpError):
            return None
        return f"{info['current'] / 2**30:.2f} GiB in use, peak {info['peak'] / 2**30:.2f} GiB"
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return f"host RAM {pages * size / 2**30:.1f} GiB"


def run_check(s: Session, env: Mapping[str, str] | None = None) -> DeviceCheck:
    """Lists the devices and library versions and measures matmul throughput."""
    env = os.environ if env is None else env
    probe = _jax_device if s.backend == "jax" else _tf_device
    device_type, memory, measure = probe(s, env)
    dtype, n = ("bfloat16", 4096) if s.kind in ("tpu", "gpu") else ("float32", 1024)
    versions = installed_versions()
    return DeviceCheck(
        kind=s.kind, device_type=device_type, device_count=max(len(s.devices), 1),
        replicas=s.replicas, memory=memory, versions=versions,
        warnings=tuple(version_warnings(versions)), dtype=dtype, matmul_size=n,
        measured_tflops=measure(dtype, n),
        peak_tflops=nominal_peak(s.kind, device_type, env),
        doctor=_doctor(s, env, versions),
    )


def _doctor(s: Session, env: Mapping[str, str], versions: Mapping[str, str]) -> tuple[str, ...]:
    from tpu_magic import doctor
    from tpu_magic.target import read_machine_signs

    signs = read_machine_signs()
    runtime = doctor.read_runtime(signs.tpu_vm, bool(signs.gpu_devices), env, versions)
    return tuple(str(f) for f in doctor.diagnose(runtime, backend=s.backend,
                                                 wants_tpu=s.kind == "tpu" and not s.simulated))


# A backend's view of the session's first device: its type, its memory, and a matmul
# measurement `measure(dtype, n) -> TFLOP/s`.
_Device = tuple[str, "str | None", Callable[[str, int], float]]


def _tf_device(s: Session, env: Mapping[str, str]) -> _Device:
    import tensorflow as tf  # the session exists, so TensorFlow is importable

    device = s.devices[0] if s.devices else "/cpu:0"
    device_type = "CPU (simulated TPU core)" if s.simulated else s.kind.upper()
    if s.kind == "gpu":
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
        device_type = details.get("device_name", "GPU")
    elif s.kind == "tpu":
        device_type = f"TPU {env.get('TPU_ACCELERATOR_TYPE', '')}".strip()
    return (device_type, device_memory(tf, s.kind, device),
            lambda dtype, n: measure_matmul(tf, device, dtype, n))


def _jax_device(s: Session, env: Mapping[str, str]) -> _Device:
    import jax

    from tpu_magic import jax_backend

    device = jax.devices(s.kind)[0]
    device_type = ("CPU (simulated TPU core)" if s.simulated
                   else f"TPU {env.get('TPU_ACCELERATOR_TYPE', '')}".strip() if s.kind == "tpu"
                   else getattr(device, "device_kind", s.kind.upper()))
    memory = jax_backend.device_memory(device) or (
        device_memory(None, "cpu", "") if s.kind == "cpu" else None)
    return device_type, memory, lambda dtype, n: jax_backend.measure_matmul(device, dtype, n)
