"""Connecting through JAX: the devices of a kind, `DataParallel` over them, and
`--simulate N`, which splits the host CPU into N XLA devices with
`--xla_force_host_platform_device_count`, and gives XLA:CPU's thread pools room for them
(`PJRT_NPROC`; JAX reads both once, when it first starts).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Any, Callable, Iterator, Mapping

from tpu_magic.backends.jax import compile_cache as cache
from tpu_magic.backends.protocol import Backend
from tpu_magic.core import process
from tpu_magic.core.deps import installed_versions, require_jax
from tpu_magic.core.errors import ConnectError
from tpu_magic.core.session import Connection
from tpu_magic.core.target import Target, no_gpu_fix, no_tpu_fix, read_machine_signs

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")
# A simulated device is a thread of the host: on a loaded CPU (two cores running eight
# devices, or a notebook's other work) one can reach a collective far later than the rest,
# and past XLA's 40 s XLA aborts the whole process (the notebook's kernel). Simulated devices
# wait this long instead. jaxlib < 0.8.0 has no such flag, and an unknown flag aborts it.
COLLECTIVE_WAIT = "--xla_cpu_collective_call_terminate_timeout_seconds"
COLLECTIVE_WAIT_SECONDS = 600
_COLLECTIVE_WAIT_FROM = (0, 8, 0)
# XLA:CPU runs each simulated device's part of a program on a thread of one pool, and
# launches the programs on that pool too. A launch waits on its thread while its device has
# 32 programs queued; a program with a collective holds a thread for each device until every
# device's part arrives. At XLA's size (the cores, at least a thread a device) a host that
# dispatches ahead (Keras's loop with its batch-end hooks on worker threads) fills the pool
# with waiting launches: one device's part never gets a thread, the others wait in the
# collective for good, and XLA aborts the process when COLLECTIVE_WAIT passes. It needs a
# thread a device for the program that runs, and one a device for each Python thread that
# dispatches at that time: room here for three.
POOL_VARIABLE = "PJRT_NPROC"  # XLA sizes the CPU client's pools from it, else NPROC, else cores
POOL_THREADS_PER_DEVICE = 4
GPU_BUILD = '`pip install -U "jax[cuda12]"`'  # JAX with its CUDA plugin


def connect(backend: Backend, chosen: Target, simulate: int | None, explicit_gpu: bool,
            compile_cache: str | None, env: Mapping[str, str]) -> tuple[Connection, Target]:
    """Connects through JAX and makes Keras's `DataParallel` over the devices.

    `compile_cache` (a directory, "off", or None to choose) sets JAX's persistent
    compilation cache (see `compile_cache`); where it went is one of the notes.

    Raises:
        ConnectError: no such device here, or JAX already started with another CPU split
            or with thread pools too small for the simulated devices.
        MissingDependencyError: JAX is not installed.
    """
    short = None  # the threads the simulated devices need, where JAX started with fewer
    if simulate is not None:
        started = _jax_started()
        process.set_environment(
            "XLA_FLAGS", host_device_flags(os.environ.get("XLA_FLAGS", ""), simulate),
            "JAX splits the CPU into devices once, when its runtime starts")
        pool = host_pool_size(os.environ, simulate, schedulable_cpus())
        if pool is not None and started:
            short = pool
        elif pool is not None:
            set_pool_size(pool)
        if "jax" not in sys.modules:  # a rehearsal never starts libtpu (and its stderr)
            process.set_environment("JAX_PLATFORMS", "cpu", "JAX picks its platforms once, "
                                    "when it starts: --simulate rehearses on the CPU")
    jax = require_jax()
    import keras

    if simulate is not None:
        devices, kind, target = _simulated_devices(jax, simulate, short), "cpu", \
            f"simulate:{simulate}"
    else:
        chosen, kind, devices = _devices_of(jax, chosen, explicit_gpu, env)
        target = chosen.label
    # In force only inside %%tpu_train cells (its `scope()`), like a tf.distribute strategy:
    # a global distribution would also split every batch of the user's other models.
    distribution = keras.distribution.DataParallel(devices=list(devices))
    chosen = Target(chosen.kind, chosen.address, chosen.reason,
                    chosen.notes + (_cache_note(compile_cache, env),))
    return Connection(target=target, kind=kind, replicas=len(devices), strategy=distribution,
                      simulated=simulate is not None, devices=tuple(str(d) for d in devices),
                      backend=backend), chosen


def _simulated_devices(jax: Any, simulate: int, short: int | None = None) -> list:
    """The `simulate` CPU devices JAX started with. `short`: the threads XLA's pools need
    for them, where JAX started with fewer (None: enough).

    Raises:
        ConnectError: JAX already started with another split, or with pools too small for
            the devices (their collectives could wait on each other for good).
    """
    devices = jax.devices("cpu")
    restart = (f"Restart the runtime and run `%tpu_connect --backend jax --simulate {simulate}` "
               "before anything uses JAX")
    if len(devices) != simulate:
        raise ConnectError(
            f"--simulate {simulate} needs {simulate} CPU devices, but JAX already started "
            f"with {len(devices)}. {restart}.")
    if short is not None:
        raise ConnectError(
            f"--simulate {simulate} needs XLA:CPU's thread pools of {short} threads, but JAX "
            f"already started with fewer (sized from {POOL_VARIABLE}, NPROC or the "
            f"{schedulable_cpus()} cores): a step could wait in a collective for good. "
            f"{restart}, or set `%env {POOL_VARIABLE}={short}` before JAX starts.")
    return devices


def _jax_started() -> bool:
    """Whether JAX's runtime has started in this process (its flags are read by then)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)  # not in every JAX
    return bool(started and started())


def schedulable_cpus() -> int:
    """The cores this process may run on, as XLA counts them for its pools."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_pool_size(env: Mapping[str, str], devices: int, cpus: int) -> int | None:
    """The threads XLA:CPU's pools need for `devices` simulated devices
    (`POOL_THREADS_PER_DEVICE` a device), or None where the size XLA takes from `env`
    (`PJRT_NPROC`, else `NPROC`, the first that is a number) or else the `cpus` is enough."""
    need = POOL_THREADS_PER_DEVICE * devices
    for name in (POOL_VARIABLE, "NPROC"):
        try:
            size = max(int(env.get(name, "")), 0)
        except ValueError:
            continue
        break
    else:
        size = cpus
    return None if max(size, devices) >= need else need


def set_pool_size(threads: int) -> None:
    """XLA:CPU's pools sized for simulated devices (`host_pool_size`), before JAX starts."""
    process.set_environment(POOL_VARIABLE, str(threads),
                            "XLA:CPU sizes its thread pools once, when JAX starts: simulated "
                            "devices need a thread each for a program's part and for each "
                            "launch waiting behind it")


def _devices_of(jax: Any, chosen: Target, explicit_gpu: bool, env: Mapping[str, str]
                ) -> tuple[Target, str, list]:
    """The devices of `chosen`'s kind (one, on the CPU): (the target, as it turned out, its
    kind, the devices).

    Raises:
        ConnectError: JAX finds no such device here.
    """
    kind = chosen.kind
    try:
        with _native_stderr_kept() as said:  # libtpu's own lines stay out of the cell
            devices = jax.devices(kind)
    except RuntimeError as exc:
        if kind == "gpu" and not explicit_gpu:  # auto saw GPU device files JAX cannot use
            chosen = Target("cpu", None, f"{chosen.reason}, but JAX has no GPU backend "
                                         f"({GPU_BUILD})", chosen.notes)
            kind, devices = "cpu", jax.devices("cpu")
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else said()
            raise ConnectError(f"JAX finds no {kind.upper()} here ({first}). "
                               + (no_tpu_fix(env, _rehearsal_from_here(jax)) if kind == "tpu"
                                  else no_gpu_fix("JAX", env, read_machine_signs().gpu_devices,
                                                  GPU_BUILD))) from None
    if kind == "cpu":
        devices = devices[:1]
    return chosen, kind, devices


@contextlib.contextmanager
def _native_stderr_kept() -> Iterator[Callable[[], str]]:
    """Catches what native code writes to the process's stderr (libtpu's "could not determine
    TPU accelerator type", its source-location traces) in a file instead of the cell; yields
    a function giving the last line it wrote, for an error message."""
    caught = tempfile.TemporaryFile(mode="w+")
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 here: nothing to keep out
        yield lambda: ""
        return
    sys.stderr.flush()
    os.dup2(caught.fileno(), 2)

    def last_line() -> str:
        caught.seek(0)
        lines = [line.strip() for line in caught.read().splitlines() if line.strip()]
        return lines[-1] if lines else ""

    try:
        yield last_line
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def host_device_flags(flags: str, n: int, jaxlib: str | None = None) -> str:
    """XLA_FLAGS with the host platform split into `n` devices (any earlier count replaced),
    whose collectives wait `COLLECTIVE_WAIT_SECONDS` for a starved device where the installed
    `jaxlib` (its version; None: looked up) knows the flag and the flags do not set it."""
    kept = _DEVICE_COUNT.sub("", flags).split()
    kept.append(f"--xla_force_host_platform_device_count={n}")
    jaxlib = installed_versions().get("jaxlib") if jaxlib is None else jaxlib
    if _release(jaxlib) >= _COLLECTIVE_WAIT_FROM and \
            not any(flag.startswith(COLLECTIVE_WAIT + "=") for flag in kept):
        kept.append(f"{COLLECTIVE_WAIT}={COLLECTIVE_WAIT_SECONDS}")
    return " ".join(kept)


def _release(version: str | None) -> tuple[int, ...]:
    """(0, 8, 1) of "0.8.1" or "0.8.1.dev20251120"; () where unknown (older than any)."""
    numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", version or "")
    return tuple(int(part) for part in numbers.groups()) if numbers else ()


def _cache_note(setting: str | None, env: Mapping[str, str]) -> str:
    try:
        return cache.enable(setting, env, installed_versions()).note()
    except OSError as exc:
        return f"JAX's compilation cache is off: its directory cannot be made ({exc})"


def _rehearsal_from_here(jax: Any, cores: int = 8) -> str:
    """How to rehearse after JAX looked for a TPU in this process: JAX has started, and it
    splits the CPU into devices once, so `--simulate` works next only where the split is
    already `cores` (else after a restart)."""
    line = f"`%tpu_connect --backend jax --simulate {cores}`"
    try:
        started = len(jax.devices("cpu"))
    except RuntimeError:
        started = 0
    if started == cores:
        return line
    return (f"restart the runtime (JAX started here with {started} CPU "
            f"device{'s' * (started != 1)}, and it splits the CPU only once), then {line} "
            "before anything uses JAX")
