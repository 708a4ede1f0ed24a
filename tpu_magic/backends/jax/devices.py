"""A JAX device as the user sees it: its name, chip, memory in use, and a matmul
measurement of its TFLOP/s."""

from __future__ import annotations

from typing import Any, Mapping

from tpu_magic.core.deps import require_jax
from tpu_magic.core.devices import DeviceView, chip_named, device_name, host_memory, \
    memory_of, runs_per_second
from tpu_magic.core.session import Connection


def device_view(connection: Connection, env: Mapping[str, str]) -> DeviceView:
    """The connection's first device: its name, chip, memory, and a matmul measurement."""
    jax = require_jax()
    device = jax.devices(connection.kind)[0]
    name = device_name(connection.kind, getattr(device, "device_kind", ""),
                       connection.simulated, env)
    chip = chip_named(connection.kind, name, env)
    if connection.kind == "cpu":
        memory = host_memory()
    else:
        memory = memory_of(*memory_bytes(device), chip, name)
    return DeviceView(name, chip, memory, lambda dtype, n: measure_matmul(device, dtype, n))


def memory_bytes(device: Any) -> tuple[int | None, int | None, int | None]:
    """(in use, limit, peak) bytes on one device, where the runtime reports them (TPUs, GPUs)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - CPU devices raise or return None
        return None, None, None
    stats = stats or {}
    return stats.get("bytes_in_use"), stats.get("bytes_limit"), stats.get("peak_bytes_in_use")


def measure_matmul(device: Any, dtype: str, n: int, min_seconds: float = 0.3) -> float:
    """TFLOP/s of repeated n×n matmuls on one JAX device, after a compiled warm-up."""
    jax = require_jax()
    import jax.numpy as jnp

    a = jax.device_put(jnp.asarray(jax.random.uniform(jax.random.PRNGKey(0), (n, n)), dtype),
                       device)
    matmul = jax.jit(lambda u, v: u @ v)
    matmul(a, a).block_until_ready()  # warm-up: compiling
    rate = runs_per_second(lambda: matmul(a, a), lambda c: c.block_until_ready(), min_seconds)
    return 2.0 * n ** 3 * rate / 1e12
