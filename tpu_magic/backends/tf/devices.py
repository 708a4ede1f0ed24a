"""A TensorFlow device as the user sees it: its name, chip, memory in use, and a matmul
measurement of its TFLOP/s."""

from __future__ import annotations

from typing import Any, Mapping

from tpu_magic.core.deps import require_tensorflow
from tpu_magic.core.devices import DeviceView, chip_named, device_name, host_memory, memory_of, \
    runs_per_second
from tpu_magic.core.session import Connection


def device_view(connection: Connection, env: Mapping[str, str]) -> DeviceView:
    """The connection's first device: its name, chip, memory, and a matmul measurement."""
    tf = require_tensorflow()
    device = connection.devices[0] if connection.devices else "/cpu:0"
    runtime_name = ""
    if connection.kind == "gpu":
        details = tf.config.experimental.get_device_details(
            tf.config.list_physical_devices("GPU")[0])
        runtime_name = details.get("device_name", "GPU")
    name = device_name(connection.kind, runtime_name, connection.simulated, env)
    chip = chip_named(connection.kind, name, env)
    memory = host_memory() if connection.kind == "cpu" else None
    if connection.kind in ("gpu", "tpu"):
        try:
            info = tf.config.experimental.get_memory_info(device.lstrip("/").upper())
            memory = memory_of(info["current"], None, info["peak"], chip, name)
        except (ValueError, RuntimeError, tf.errors.OpError):
            memory = memory_of(None, None, None, chip, name)
    return DeviceView(name, chip, memory, lambda dtype, n: measure_matmul(tf, device, dtype, n))


def measure_matmul(tf: Any, device: str, dtype: str, n: int, min_seconds: float = 0.3) -> float:
    """TFLOP/s of repeated n×n matmuls on one device, after a warm-up run."""
    with tf.device(device):
        a = tf.random.uniform((n, n), dtype=tf.float32)
        a = tf.cast(a, dtype)
        b = tf.identity(a)
        tf.linalg.matmul(a, b).numpy()  # warm-up: kernel selection, transfers
        rate = runs_per_second(lambda: tf.linalg.matmul(a, b), lambda c: c.numpy(), min_seconds)
    return 2.0 * n ** 3 * rate / 1e12
