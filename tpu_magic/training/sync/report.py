"""What `%tpu_sync` did: the report a CPU copy returns, and its text."""

from __future__ import annotations

from dataclasses import dataclass

from tpu_magic.training.sync.probes import PROBE_ROWS


@dataclass(frozen=True)
class SyncReport:
    """What `%tpu_sync` did.

    Attributes:
        name: the trained model's name in the namespace; as_name: the CPU copy's.
        parameters: the number of weights copied (scalars).
        seconds: time for the whole sync (and save).
        max_abs_diff: largest |prediction difference| on the probe batch (None: no probe).
        averaged: variables whose replicas disagreed and were averaged.
        averaged_names: their paths (e.g. `.../batch_normalization/moving_mean`).
        replicas: how many replicas the model's variables had.
        path: the `.weights.h5` written, if any.
    """

    name: str
    as_name: str
    parameters: int
    seconds: float
    max_abs_diff: float | None
    averaged: int = 0
    replicas: int = 1
    averaged_names: tuple[str, ...] = ()
    path: str | None = None
    adapters: tuple[int, int] | None = None  # --adapters: (bytes saved, bytes of the model)
    source: str | None = None  # where the weights came from, if not this process's model
    how: str | None = None  # how it was copied, where not from its config

    def summary(self) -> str:
        lines = [f"tpu_sync: `{self.name}` → `{self.as_name}` on the CPU, "
                 f"{self.parameters:,} parameters, {self.seconds:.2f} s"]
        if self.averaged:
            lines.append(f"  averaged over {self.replicas} replicas: {self.averaged} variable"
                         f"{'s' * (self.averaged != 1)} that replicas update on their own "
                         f"({_which(self.averaged_names)})")
        if self.how:
            lines.append(f"  {self.how}")
        if self.source:
            lines.append(f"  weights from {self.source}")
        elif self.max_abs_diff is None:
            lines.append("  probe: no input the model takes could be made up, predictions "
                         "not compared")
        else:
            against = " from replica 0 (before averaging)" if self.averaged else ""
            lines.append(f"  probe batch of {PROBE_ROWS}: largest prediction difference{against} "
                         f"{self.max_abs_diff:.3g}")
        if self.path and self.adapters:
            saved, whole = self.adapters
            lines.append(f"  saved the adapters alone: {self.path}, {saved / 2**20:.2f} MiB of the "
                         f"model's {whole / 2**20:.2f} MiB (load with "
                         f"`tpu_magic.load_adapters(model, path)` into the model built from "
                         "the same preset, LoRA enabled with the same rank)")
        elif self.path:
            lines.append(f"  saved: {self.path} (load with `{self.as_name}.load_weights(path)`)")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.summary())


def _which(paths: tuple[str, ...]) -> str:
    """BatchNorm moving statistics where that is what they are, else their names."""
    if paths and all(p.rsplit("/", 1)[-1] in ("moving_mean", "moving_variance") for p in paths):
        return "BatchNorm moving statistics"
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return shown or "unnamed"
