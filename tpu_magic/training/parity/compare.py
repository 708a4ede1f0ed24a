"""The first-step comparison: its results (`Parity`, `Skipped`), the difference between the
distributed step and one device's, and its likely cause. What need not be compared again
once it agreed, a setup's key, is `setup.py`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import keras
import numpy as np

from tpu_magic.core.packed import MASK, WEIGHT, is_packed
from tpu_magic.core.steps import StepState, Update

TOLERANCE = 1e-4  # relative, float32 compute
LOW_PRECISION_TOLERANCE = 2e-2  # a 16-bit compute policy rounds differently per split


@dataclass(frozen=True)
class Parity:
    """The first step, distributed and on one device.

    Attributes:
        steps: steps compared (the first execution: `steps_per_execution` of them).
        logs: (key, distributed, one device) for every number both logged.
        update: the size (L2 norm) of the trainable variables' update, distributed and on one
            device (None for an inference-mode comparison).
        update_difference: the relative difference of the two updates' sizes.
        state_difference: the same for the non-trainable variables that moved (BatchNorm
            statistics), None where none moved.
        tolerance: the relative difference allowed.
        seconds: what the check added to the first step.
        likely: the likely cause of a difference, in words (None where they agree).
        setup: the model, batch and devices compared (`setup_key`).
        whole: where the split steps differed, the same steps run again from the same state
            with every replica computing the whole batch, against one device's (None: not
            run). Where it agrees (`whole_batch`), the fit went on so.
    """

    steps: int
    logs: tuple[tuple[str, float, float], ...]
    update: tuple[float, float] | None
    update_difference: float | None
    state_difference: float | None
    tolerance: float
    seconds: float
    likely: str | None = None
    setup: str = ""  # what was compared (`setup_key`): the same setup need not be again
    inference: bool = False  # the first batch's logs in inference mode, not a training step
    whole: "Parity | None" = None

    @property
    def whole_batch(self) -> bool:
        """The split steps differed and every replica computing the whole batch agreed with
        one device: the fit ran so from its first step (the split steps undone)."""
        return self.whole is not None and self.whole.agrees

    @property
    def remembered(self) -> str | None:
        """What the notebook keeps of this comparison among its agreed setups: the setup
        where it agreed, marked `WHOLE_BATCH` where it agreed only with every replica
        computing the whole batch; None where it did not agree."""
        if not self.setup:
            return None
        if self.whole_batch:
            return WHOLE_BATCH + self.setup
        return self.setup if self.agrees else None

    @property
    def differences(self) -> list[tuple[str, float]]:
        """Every compared number and its relative difference, largest first."""
        found = [(key, relative(ours, theirs)) for key, ours, theirs in self.logs]
        if self.update_difference is not None:
            found.append(("update", self.update_difference))
        if self.state_difference is not None:
            found.append(("non-trainable state", self.state_difference))
        return sorted(found, key=lambda item: -item[1])

    @property
    def agrees(self) -> bool:
        return all(difference <= self.tolerance for _, difference in self.differences)

    def _numbers(self) -> str:
        shown = [f"{key} {ours:.6g} vs {theirs:.6g}" for key, ours, theirs in self.logs[:3]]
        if self.update is not None:
            shown.append(f"update size {self.update[0]:.6g} vs {self.update[1]:.6g}")
        return ", ".join(shown)

    def _what(self) -> str:
        if self.inference:
            return "first batch, compared in inference mode,"
        return f"first {self.steps} steps" if self.steps > 1 else "first step"

    def line(self) -> str:
        """One line for the report."""
        if self.whole_batch:
            key, difference = self.differences[0]
            return (f"{self._what()} DIFFERS from one device split over the replicas ({key} "
                    f"off by {difference:.2g} relative); every replica computing the whole "
                    f"batch is the same as on one device (whole batch vs one device: "
                    f"{self.whole._numbers()}; checked in "
                    f"{self.seconds + self.whole.seconds:.2f} s)")
        if self.inference:
            verdict = "agrees with one device" if self.agrees else "DIFFERS from one device"
            why = ("random layers such as Dropout are off: each replica draws its own while "
                   "training; ")
        else:
            verdict = "the same as on one device" if self.agrees else "DIFFERS from one device"
            why = ""
        return (f"{self._what()} {verdict} ({why}distributed vs one device: "
                f"{self._numbers()}; checked in {self.seconds:.2f} s)")

    def warning(self) -> str | None:
        """What to say where the first step differs (None where it agrees, or where every
        replica computing the whole batch made it agree: `note` says that)."""
        if self.agrees or self.whole_batch:
            return None
        key, difference = self.differences[0]
        what = ("the first batch's logs in inference mode differ from one device's"
                if self.inference else
                "the first distributed step differs from the same step on one device")
        whole = "" if self.whole is None else (
            f" Every replica computing the whole batch differs too ({self.whole._numbers()}), "
            "so the fit went on split over the replicas.")
        return (f"{what} "
                f"({key} off by {difference:.2g} relative, over {self.tolerance:g}): "
                f"{self._numbers()}. Likely cause: {self.likely or 'not known'}.{whole} This "
                "cell's numbers will not be plain Keras's on one device.")

    def note(self) -> str | None:
        """The one line saying that the fit runs the whole batch on every replica (None
        where it does not)."""
        if not self.whole_batch:
            return None
        key, difference = self.differences[0]
        return (f"the first step split over the replicas differed from one device's ({key} "
                f"off by {difference:.2g} relative; likely cause: {self.likely or 'not known'}"
                "): every replica computes the whole batch instead, from the first step on, "
                "so this fit's numbers are one device's (correct numbers before speed: each "
                "replica does the whole batch's work)")


@dataclass(frozen=True)
class Skipped:
    """The check did not run, and why."""

    why: str
    seconds: float = 0.0
    setup: str = ""

    agrees = True
    remembered = None  # nothing compared: nothing to keep (see `Parity.remembered`)

    def line(self) -> str:
        return f"first step not compared with one device: {self.why}"

    def warning(self) -> None:
        return None

    def note(self) -> None:
        return None


def relative(ours: float, theirs: float) -> float:
    """|ours - theirs| relative to the larger magnitude (0 for two zeros, inf for a NaN)."""
    if math.isnan(ours) or math.isnan(theirs):
        return 0.0 if math.isnan(ours) and math.isnan(theirs) else math.inf
    scale = max(abs(ours), abs(theirs))
    return abs(ours - theirs) / scale if scale > 1e-12 else 0.0


def real_rows(batch: Any) -> tuple[Any, bool]:
    """A batch as plain Keras would get it: the packed sample weight's padding rows left out
    and the user's own weights restored. Returns (the batch, whether it was padded)."""
    x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
    if not is_packed(weight):
        return batch, False
    keep = np.asarray(weight[MASK]) > 0
    users = np.asarray(weight[WEIGHT])
    padded = not bool(keep.all())

    def pick(a: Any) -> Any:
        return keras.tree.map_structure(lambda v: np.asarray(v)[keep], a)

    weight = None if np.all(users == 1) else users[keep]
    return keras.utils.pack_x_y_sample_weight(pick(x), pick(y), weight), padded


def compare(before: StepState, after: StepState, theirs: Update, logs: dict,
            their_logs: dict, steps: int, tolerance: float, seconds: float,
            likely: Callable[[bool, float | None, bool], str], setup: str = "",
            padded: bool = False) -> Parity:
    """The distributed run (`after`, `logs`) against one device's (`theirs`: its update's
    sizes, `their_logs`), both from `before`. `likely(loss_differs, update_ratio, padded)`
    names a cause."""
    shared = [key for key in their_logs if key in logs]
    numbers = tuple((key, _number(logs[key]), _number(their_logs[key])) for key in shared)
    # Sizes, not the vectors: Adam's first step divides each gradient by its own size, so
    # a weight whose gradient is float noise (a bias before a BatchNormalization) moves by
    # a noisy amount on any two devices; the size of the whole update does not.
    ours = Update.between(before, after)
    size = (ours.trainable, theirs.trainable)
    difference = relative(*size)
    moved = (ours.non_trainable, theirs.non_trainable)
    state = relative(*moved) if any(moved) else None
    parity = Parity(steps, numbers, size, difference, state, tolerance, seconds, setup=setup)
    if parity.agrees:
        return parity
    loss_differs = any(relative(a, b) > tolerance for key, a, b in numbers)
    ratio = size[0] / size[1] if size[1] > 0 else None
    return Parity(steps, numbers, size, difference, state, tolerance, seconds,
                  likely(loss_differs, ratio, padded, loss_ratio=_loss_ratio(numbers)), setup)


def _loss_ratio(numbers: tuple[tuple[str, float, float], ...]) -> float | None:
    """The distributed loss over one device's (None where either is missing or zero)."""
    for key, ours, theirs in numbers:
        if key == "loss" and theirs and math.isfinite(ours) and math.isfinite(theirs):
            return ours / theirs
    return None


def compare_inference(logs: dict, their_logs: dict, tolerance: float, seconds: float,
                      likely: Callable[[bool, float | None, bool], str], setup: str = "",
                      padded: bool = False) -> Parity:
    """The first batch's logs in inference mode, distributed against one device's."""
    shared = [key for key in their_logs if key in logs]
    numbers = tuple((key, _number(logs[key]), _number(their_logs[key])) for key in shared)
    parity = Parity(1, numbers, None, None, None, tolerance, seconds, setup=setup,
                    inference=True)
    if parity.agrees:
        return parity
    return Parity(1, numbers, None, None, None, tolerance, seconds,
                  likely(True, None, padded, loss_ratio=_loss_ratio(numbers)), setup,
                  inference=True)


def _number(value: Any) -> float:
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError):
        return math.nan


def likely_cause(replicas: int, per_replica_norms: list[str], batch_losses: list[str],
                 own_step: bool) -> Callable[..., str]:
    """Names the likely cause of a difference, from what the model is made of.

    Args:
        replicas: how many parts the batch is split into.
        per_replica_norms: layers that normalize each replica's share of the batch on their
            own (a non-synchronized BatchNormalization on TensorFlow replicas).
        batch_losses: losses that reduce the batch to one number themselves.
        own_step: the model trains with its own `train_step`.
    """
    def likely(loss_differs: bool, update_ratio: float | None, padded: bool,
               inference: bool = False, loss_ratio: float | None = None) -> str:
        def near_replicas(ratio: float | None) -> bool:
            return bool(ratio) and any(abs(ratio - r) / r < 0.05
                                       for r in (replicas, 1 / replicas))

        if padded:
            return ("padding: the first batch was padded to split over the replicas, and the "
                    "padded rows reached the loss or a layer that mixes a batch's rows "
                    "(BatchNormalization's statistics, a sum over the batch)")
        if per_replica_norms and not inference:  # inference normalizes by moving statistics
            return (f"per-replica state: {', '.join(per_replica_norms[:3])} normalize each "
                    f"replica's 1/{replicas} of the batch with its own statistics; "
                    "`BatchNormalization(synchronized=True)` normalizes the whole batch, as "
                    "one device does")
        if near_replicas(loss_ratio):
            return (f"loss scaling: the logged loss is {loss_ratio:.3g}x one device's, about "
                    f"the {replicas} replicas: the loss is divided or summed over the "
                    "replicas once too often (a custom train_step's own loss object?)")
        if not loss_differs and near_replicas(update_ratio):
            return (f"loss scaling: the update is {update_ratio:.3g}x one device's, about the "
                    f"{replicas} replicas: the loss or its gradient is summed or averaged over "
                    "the replicas once too often (a custom train_step's own reduction?)")
        if batch_losses or own_step:
            what = ", ".join(batch_losses) if batch_losses else "its own train_step's loss"
            return (f"a loss over the whole batch: {what} is computed on each replica's "
                    f"1/{replicas} of the batch (in-batch negatives, a batch mean or "
                    "statistic), not on the whole batch as on one device")
        if loss_differs:  # nothing else split the batch: something computed over it did
            return (f"a loss or layer over the whole batch: something in the model or its loss "
                    f"combines the batch's rows (in-batch negatives, a batch mean or "
                    f"statistic), and each replica has only its 1/{replicas} of them")
        return "not one tpu_magic knows: please report it with the cell"
    return likely


AGREED = "the same model, batch and devices agreed with one device earlier in this notebook"
# an agreed setup's mark where it agreed only with every replica computing the whole batch
WHOLE_BATCH = "whole batch "
WHOLE_EARLIER = ("every replica computes the whole batch: split over the replicas, the same "
                 "model, batch and devices differed from one device earlier in this notebook, "
                 "and computing the whole batch on each agreed (correct numbers before speed)")


def random_layers(model: Any) -> list[str]:
    """The model's layers that draw random numbers while training (Dropout, noise,
    augmentation), by class, once each."""
    found = []
    for layer in model._flatten_layers(include_self=False):
        name = type(layer).__name__
        if getattr(layer, "_seed_generators", None) and name not in found:
            found.append(name)
    return found


def per_replica_norms(model: Any) -> list[str]:
    """Trainable BatchNormalization layers that normalize each replica's share on its own."""
    return [layer.name for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            and not getattr(layer, "synchronized", False)]
