"""Connecting through TensorFlow: `TPUStrategy` on a TPU (a TPU VM's `local` or a TPU node,
its system initialised once a process), `MirroredStrategy` over several GPUs or over N
logical CPUs (`--simulate N`), `OneDeviceStrategy` on one GPU, the default strategy on the
CPU. TensorFlow is imported by the functions, never here."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from tpu_magic.backends.protocol import Backend
from tpu_magic.backends.tf.variables import scalars_readable
from tpu_magic.core import process
from tpu_magic.core.deps import require_tensorflow
from tpu_magic.core.errors import ConnectError
from tpu_magic.core.session import Connection
from tpu_magic.core.target import Target, no_tpu_fix


class TpuRuntime:
    """The TensorFlow calls that need a real TPU; tests replace this object."""

    def initialize(self, address: str) -> Any:
        tf = require_tensorflow()
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return resolver

    def strategy(self, resolver: Any) -> Any:
        tf = require_tensorflow()
        return tf.distribute.TPUStrategy(resolver)


tpu_runtime = TpuRuntime()


def connect(backend: Backend, chosen: Target, simulate: int | None, explicit_gpu: bool,
            env: Mapping[str, str], probe_node: Callable[[Target], Any]
            ) -> tuple[Connection, Target]:
    """The connection to `chosen` through TensorFlow (`probe_node`: the bounded
    reachability check of a TPU node, before connecting to one).

    Raises:
        ConnectError: another TPU is connected already, or the device cannot be reached.
    """
    if chosen.kind == "tpu" and process.tpu_system() not in (None, chosen.address):
        raise ConnectError(
            f"this process is already connected to TPU {process.tpu_system()}; TensorFlow cannot "
            f"switch to {chosen.address} in the same process. Restart the runtime "
            f"(Runtime > Restart session), then `%tpu_connect {chosen.address}`."
        )
    if chosen.is_tpu_node and process.tpu_system() is None:
        probe_node(chosen)
    tf = require_tensorflow()
    if simulate is not None:
        return _simulated(backend, tf, simulate), chosen
    if chosen.kind == "tpu":
        return _tpu(backend, tf, chosen, env), chosen
    if chosen.kind == "gpu":
        return _gpu(backend, tf, chosen, explicit_gpu)
    return Connection(target="cpu", kind="cpu", replicas=1, backend=backend,
                      strategy=tf.distribute.get_strategy(), devices=("/cpu:0",)), chosen


def configure_logical_cpus(n: int) -> None:
    """Splits the CPU into `n` logical devices (before TensorFlow's runtime starts).

    Raises:
        ConnectError: the runtime already started with another split.
    """
    tf = require_tensorflow()
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise ConnectError(
                f"--simulate {n} needs {n} logical CPU devices, but TensorFlow's runtime already "
                f"started with {have}. Restart the runtime and run `%tpu_connect --simulate {n}` "
                "before anything else uses TensorFlow."
            ) from None


def mirrored_strategy(tf: Any, devices: tuple[str, ...]) -> Any:
    """The process's MirroredStrategy over `devices` (made once: see `process`); its
    variables read as numbers in a plain cell, as a plain variable does
    (`variables.scalars_readable`)."""
    scalars_readable()
    return process.strategy_for(devices, lambda: tf.distribute.MirroredStrategy(list(devices)))


def _simulated(backend: Backend, tf: Any, n: int) -> Connection:
    configure_logical_cpus(n)
    devices = tuple(f"/cpu:{i}" for i in range(n))
    return Connection(target=f"simulate:{n}", kind="cpu", replicas=n, backend=backend,
                      strategy=mirrored_strategy(tf, devices), simulated=True, devices=devices)


def _tpu(backend: Backend, tf: Any, chosen: Target, env: Mapping[str, str]) -> Connection:
    address = chosen.address
    try:
        resolver = tpu_runtime.initialize(address)
    except tf.errors.NotFoundError as exc:
        if address == "local":
            raise ConnectError(f"{no_tpu_fix(env)} (TensorFlow said: {_said(exc)})") from None
        raise ConnectError(f"TPU {address} could not be initialised: {exc}") from None
    except ValueError as exc:
        raise ConnectError(f"TPU {address} could not be resolved: {exc}") from None
    process.set_tpu_system(address)
    strategy = tpu_runtime.strategy(resolver)
    devices = tuple(d.name for d in tf.config.list_logical_devices("TPU"))
    return Connection(target=address, kind="tpu", replicas=strategy.num_replicas_in_sync,
                      strategy=strategy, devices=devices, backend=backend)


def _gpu(backend: Backend, tf: Any, chosen: Target, explicit: bool
         ) -> tuple[Connection, Target]:
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        fix = (
            "TensorFlow sees no GPU: in Colab choose Runtime > Change runtime type > a GPU; "
            "elsewhere install a CUDA build (`pip install \"tensorflow[and-cuda]\"`; "
            "tensorflow-cpu has no GPU support)."
        )
        if explicit:
            raise ConnectError(fix)
        chosen = Target("cpu", None, chosen.reason + ", but " + fix, chosen.notes)
        return Connection(target="cpu", kind="cpu", replicas=1, backend=backend,
                          strategy=tf.distribute.get_strategy(), devices=("/cpu:0",)), chosen
    devices = tuple(f"/gpu:{i}" for i in range(len(gpus)))
    strategy = (tf.distribute.OneDeviceStrategy(devices[0]) if len(gpus) == 1
                else mirrored_strategy(tf, devices))
    return Connection(target="gpu", kind="gpu", replicas=len(gpus), strategy=strategy,
                      devices=devices, backend=backend), chosen


def _said(exc: BaseException, limit: int = 160) -> str:
    """The first line of an error, cut at a word (never mid-word) if long."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(first) <= limit:
        return first
    return first[:limit].rsplit(" ", 1)[0] + " …"
