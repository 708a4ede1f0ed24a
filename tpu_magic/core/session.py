"""The connected accelerator: one frozen `Connection` per process, `tpu_magic.session()`.

What `%tpu_connect` made does not change until the next connect replaces it. What a
notebook did since (its panel, the model trained last, a running job) is per shell,
in `notebook.workspace.Workspace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpu_magic.core import process


@dataclass(frozen=True)
class Connection:
    """What `%tpu_connect` set up.

    Attributes:
        target: the target as typed or chosen ("local", "grpc://…", "gpu", "cpu",
            "simulate:N").
        kind: "tpu", "gpu" or "cpu" (a simulated TPU runs on the CPU).
        replicas: number of model replicas a global batch is split over.
        strategy: the `tf.distribute.Strategy`, or Keras's `DataParallel` on JAX.
        backend: the `backends.Backend` that made it (`.name` is "tf" or "jax").
        simulated: True for `--simulate N` (an N-core TPU rehearsal on the CPU).
        devices: the device names the strategy replicates over.
    """

    target: str
    kind: str
    replicas: int
    strategy: Any
    backend: Any
    simulated: bool = False
    devices: tuple[str, ...] = ()

    @property
    def strategy_name(self) -> str:
        """The strategy's name for people: its class, or "one device" for the framework's
        default (TensorFlow's private `_DefaultDistributionStrategy`)."""
        name = type(self.strategy).__name__
        return "one device (no distribution)" if name.startswith("_") else name

    @property
    def tpu_rules(self) -> bool:
        """Whether TPU batch advice applies (a real or a simulated TPU)."""
        return self.kind == "tpu" or self.simulated


def session() -> Connection | None:
    """The current connection, or None before `%tpu_connect` (one per process: see
    `process`)."""
    return process.connection()


def current() -> Any:
    """What the notebook is connected to, as `tpu_magic.session()` gives it: the
    `Connection`, or the `hosts.cluster.Hosts` after `%tpu_connect --hosts/--simulate HxD`
    (its `replicas` and `target` read as a `Connection`'s), or None before `%tpu_connect`."""
    return process.hosts() or process.connection()
