"""What a checkpoint holds, whichever form it takes on disk, and whether it fits a model:
the model's weights and optimizer state as named arrays (`Variables`), a checkpoint read
back (`Checkpoint`), and the checks before its arrays go into a model.

Variables are matched by position and shape, not by name: Keras numbers its layer
names per process (`dense` vs `dense_3`), and rewrapping renames them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tpu_magic.core import variables
from tpu_magic.core.errors import CheckpointError

FORMAT = "tpu_magic checkpoint 1"


@dataclass(frozen=True)
class Variables:
    """Named arrays in a fixed order: a model's weights or an optimizer's state (NumPy from
    a file; JAX arrays laid out as the model's variables from an orbax checkpoint). `described`:
    their shapes where the arrays are not read (yet)."""

    names: tuple[str, ...]
    arrays: tuple[Any, ...]
    described: tuple[tuple[int, ...], ...] | None = None

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        if self.described is not None:
            return list(self.described)
        return [tuple(a.shape) for a in self.arrays]


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint read back from disk, every array already in memory."""

    path: Path
    sequence: int
    epoch: int  # epochs completed
    seed: int  # the data order's seed
    weights: Variables
    optimizer: Variables
    optimizer_class: str
    adapters_only: bool = False  # what never trains (frozen layers, LoRA's bases) left out


class OtherModel(CheckpointError):
    """A checkpoint written for another model: said, never moved aside."""


def state_of(model: Any, backend: Any) -> tuple[Variables, Variables, str]:
    """The model's weights (averaged over replicas where they differ) and optimizer state."""
    chosen = variables.saved_weights(model)
    arrays, _, _ = variables.replica_weights(model, backend, chosen)
    weights = Variables(tuple(w.path for w in chosen), tuple(arrays))
    optimizer = getattr(model, "optimizer", None)
    slots = variables.optimizer_state(model, backend)
    if slots is None:
        return weights, Variables((), ()), type(optimizer).__name__ if optimizer else ""
    return weights, Variables(tuple(v.path for v in optimizer.variables), tuple(slots)), \
        type(optimizer).__name__


def not_finite(arrays: Sequence[np.ndarray]) -> bool:
    """Whether any floating-point array holds a NaN or an infinity."""
    return any(np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a))
               for a in arrays)


def mismatch(saved: Variables, current: Sequence[Any], what: str) -> str | None:
    """How saved arrays and the model's variables differ, in words (None: same count and shapes).

    Only the variables' shapes are read, not their values.
    """
    if len(saved.names) != len(current):
        return f"the checkpoint has {len(saved.names)} {what}, the model has {len(current)}"
    for i, (old, variable) in enumerate(zip(saved.shapes, current)):
        new = tuple(variable.shape)
        if old != new:
            return (f"{what} {i} ({variable.path}) has shape {new} in the model but "
                    f"{old} in the checkpoint ({saved.names[i]})")
    return None


def restore(model: Any, checkpoint: Checkpoint, strategy: Any) -> None:
    """Puts a checkpoint's weights and optimizer state into the model (all or nothing).

    Raises:
        CheckpointError: the model is not built, or has another architecture or optimizer.
    """
    with strategy.scope():
        check_fits(model, checkpoint, strategy)
        for variable, array in zip(variables.saved_weights(model), checkpoint.weights.arrays):
            variable.assign(array)
        if checkpoint.optimizer.names:
            for variable, array in zip(model.optimizer.variables, checkpoint.optimizer.arrays):
                variable.assign(array)


def check_fits(model: Any, checkpoint: Checkpoint, strategy: Any) -> None:
    """Raises `OtherModel` where the checkpoint was written for another model (its shapes,
    frozen weights or optimizer differ); builds the model's optimizer to compare.

    Raises:
        CheckpointError: the model is not built.
    """
    where = checkpoint.path.name
    if not model.built:
        raise CheckpointError(
            f"cannot resume from {where}: the model has no weights yet. Start it with "
            "keras.Input(shape) so its weights exist before training.")
    optimizer = getattr(model, "optimizer", None)
    with strategy.scope():
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
    problem = mismatch(checkpoint.weights, variables.saved_weights(model), "weights")
    if problem is None and checkpoint.adapters_only != bool(variables.frozen_weights(model)):
        problem = ("one of the two has frozen layers or LoRA and the other not: "
                   "checkpoints leave out the weights that never train")
    if problem is None and checkpoint.optimizer.names:
        optimizer_class = type(optimizer).__name__ if optimizer is not None else ""
        if checkpoint.optimizer_class != optimizer_class:
            problem = (f"the checkpoint's optimizer is {checkpoint.optimizer_class}, the "
                       f"model's is {optimizer_class}")
        else:
            problem = mismatch(checkpoint.optimizer, optimizer.variables,
                               "optimizer variables")
    if problem:
        raise OtherModel(
            f"cannot resume from {where}: it was written for another model ({problem}). "
            "Use the model that wrote it, or another --checkpoint directory.")
