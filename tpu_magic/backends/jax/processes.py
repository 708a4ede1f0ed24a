"""Several processes, one a host, joined into one multi-controller JAX run, with Keras's
`DataParallel` over every process's devices."""

from __future__ import annotations

import os

from tpu_magic.backends.jax.connect import (host_device_flags, host_pool_size,
                                            schedulable_cpus, set_pool_size)
from tpu_magic.core import process
from tpu_magic.core.deps import require_jax
from tpu_magic.core.errors import ConnectError
from tpu_magic.core.session import Connection


def join_processes(coordinator: str, count: int, index: int, local_devices: int | None,
                   timeout: float) -> Connection:
    """This process as process `index` of `count` in one multi-controller JAX run (one
    process a host, all running the same program), and Keras's `DataParallel` over every
    process's devices, each process feeding its own rows of a batch (`auto_shard_dataset`
    off; `data` picks the rows). `local_devices`: a rehearsal on one machine, that many
    CPU devices a process and gloo collectives.

    Raises:
        ConnectError: the coordinator or another process did not answer within `timeout`.
    """
    process.set_environment("KERAS_BACKEND", "jax", "every host's process runs Keras on JAX "
                            "(multi-controller JAX)")
    if local_devices is not None:
        process.set_environment("JAX_PLATFORMS", "cpu", "a rehearsal of several hosts runs on "
                                "the CPU")
        process.set_environment(
            "XLA_FLAGS", host_device_flags(os.environ.get("XLA_FLAGS", ""), local_devices),
            "JAX splits the CPU into devices once, when its runtime starts")
        pool = host_pool_size(os.environ, local_devices, schedulable_cpus())
        if pool is not None:  # a fresh engine: JAX starts below
            set_pool_size(pool)
    jax = require_jax()
    if local_devices is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, count, index,
                                   initialization_timeout=max(int(timeout), 1))
    except Exception as exc:  # noqa: BLE001 - JAX raises XlaRuntimeError/RuntimeError here
        raise ConnectError(f"process {index} of {count} could not join the JAX run at "
                           f"{coordinator} within {timeout:g} s: {str(exc).splitlines()[0]}"
                           ) from None
    import keras

    from tpu_magic.backends.jax.backend import BACKEND

    devices = jax.devices()
    connection = Connection(
        target=f"hosts:{count}x{jax.local_device_count()}", kind=devices[0].platform,
        replicas=len(devices),
        strategy=keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False),
        backend=BACKEND, simulated=local_devices is not None,
        devices=tuple(str(d) for d in devices))
    process.set_connection(connection)
    return connection
