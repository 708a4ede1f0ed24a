"""The connected accelerator: one `Session` per process, reachable as `tpu_magic.session()`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Session:
    """What `%tpu_connect` set up.

    Attributes:
        target: the target as typed or chosen ("local", "grpc://…", "gpu", "cpu").
        kind: "tpu", "gpu" or "cpu" (a simulated TPU runs on the CPU).
        replicas: number of model replicas a global batch is split over.
        strategy: the `tf.distribute.Strategy` in force.
        simulated: True for `--simulate N` (an N-core TPU rehearsal on the CPU).
        devices: the device names the strategy replicates over.
        panel: the ipywidgets panel, when one is shown.
        last_model: the model trained last by `%%tpu_train`, and its name.
        last_fit: that model's last `fit` call (data, validation data, callbacks).
        train_job: the training job the panel started last.
        backend: the Keras backend, "tf" or "jax" (then `strategy` is Keras's `DataParallel`).
    """

    target: str
    kind: str
    replicas: int
    strategy: Any
    simulated: bool = False
    devices: tuple[str, ...] = ()
    panel: Any = None
    last_model: Any = None
    last_model_name: str | None = None
    last_fit: Any = None  # a `train.FitCall`: the last fit of a %%tpu_train cell
    train_job: Any = None  # a `job.TrainJob` started by the panel's Train button
    backend: str = "tf"

    @property
    def tpu_rules(self) -> bool:
        """Whether TPU batch advice applies (a real or a simulated TPU)."""
        return self.kind == "tpu" or self.simulated


_current: Session | None = None


def session() -> Session | None:
    """The current session, or None before `%tpu_connect`."""
    return _current


def set_session(new: Session | None) -> None:
    global _current
    _current = new
