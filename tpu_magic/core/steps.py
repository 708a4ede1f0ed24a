"""A model's training state at one moment, as host arrays: what the first-step parity check
compares (`training.parity`) and what the backends read and run it from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tpu_magic.core.errors import KerasBuildError
from tpu_magic.core.variables import variable_bytes


@dataclass(frozen=True)
class StepState:
    """A model's variables in Keras's order (`Model._get_jax_state`): trainable,
    non-trainable, optimizer, metrics. A `None` entry is a variable not copied because no
    step changes it (a weight of a frozen layer); a run reads it from the model."""

    trainable: tuple
    non_trainable: tuple
    optimizer: tuple
    metrics: tuple

    @property
    def groups(self) -> tuple[tuple, tuple, tuple, tuple]:
        return self.trainable, self.non_trainable, self.optimizer, self.metrics

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for group in self.groups for a in group if a is not None)


def host_copy(value: Any) -> np.ndarray:
    """A variable's value as a NumPy array of its own (gathered where it is sharded)."""
    return np.array(value, copy=True)


@dataclass(frozen=True)
class Update:
    """What the first-step check compares of a step's change of the state: the size (L2
    norm) of the trainable variables' update, and of the non-trainable ones' (BatchNorm's
    statistics; 0 where none moved), over the floating-point variables both sides copied.
    Sizes, not the vectors: a one-device step can return them instead of a second copy of
    the state on its device (`backends/jax/parity.py`)."""

    trainable: float
    non_trainable: float

    @classmethod
    def between(cls, before: "StepState", after: "StepState") -> "Update":
        return cls(float(np.linalg.norm(update_of(before.trainable, after.trainable))),
                   float(np.linalg.norm(update_of(before.non_trainable, after.non_trainable))))

    @classmethod
    def from_squares(cls, trainable: Any, non_trainable: Any) -> "Update":
        """From each variable's sum of squared changes (a device's, in float32), added up
        here in float64."""
        return cls(float(np.sqrt(np.sum(np.asarray(trainable, np.float64)))),
                   float(np.sqrt(np.sum(np.asarray(non_trainable, np.float64)))))


def update_of(before: tuple, after: tuple) -> np.ndarray:
    """The change of the floating-point arrays of a group, flattened into one vector."""
    parts = [np.asarray(b, np.float64).ravel() - np.asarray(a, np.float64).ravel()
             for a, b in zip(before, after)
             if a is not None and b is not None and is_float(np.asarray(a).dtype)]
    return np.concatenate(parts) if parts else np.zeros(0)


def is_float(dtype: Any) -> bool:
    """NumPy's floats and ml_dtypes' (bfloat16 is not a NumPy floating type)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or "float" in dtype.name


def state_groups(model: Any) -> tuple[list, list, list, list]:
    """A model's variables in the order of Keras's JAX state (`_get_jax_state`)."""
    optimizer = getattr(model, "optimizer", None)
    return (list(model.trainable_variables), list(model.non_trainable_variables),
            list(optimizer.variables) if optimizer is not None else [],
            list(getattr(model, "metrics_variables", [])))


def copied_bytes(model: Any) -> int:
    """The bytes of the model's state the first-step check copies onto one device: every
    variable of Keras's JAX state but a frozen layer's (which it reads in place), whole."""
    frozen = frozen_variables(model)
    return sum(variable_bytes(v) for group in state_groups(model) for v in group
               if id(v) not in frozen)


def batch_signature(batch: Any) -> tuple:
    """A host batch's type: each array's shape and dtype, in the tree's order (what a step
    measured on one batch holds for)."""
    import keras

    return tuple((tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", type(a))))
                 for a in keras.tree.flatten(batch))


def frozen_variables(model: Any) -> set[int]:
    """The floating-point variables of frozen layers (`trainable = False`), by id: no step
    changes them, so the parity check reads them from the model instead of copying them."""
    # what Keras trains is never frozen: a layer set trainable again inside a frozen one (a
    # KerasHub backbone after enable_lora: its blocks frozen, their LoRA layers not)
    trained = {id(v) for v in model.trainable_variables}
    return {id(v) for layer in model._flatten_layers() if not layer.trainable
            for v in layer.variables if is_float(v.dtype) and id(v) not in trained}


def layers_built(model: Any) -> bool:
    """Whether every layer of the model is built (all a `predict` step needs)."""
    return all(layer.built for layer in model._flatten_layers())


def build(model: Any, batch: Any) -> None:
    """What Keras's call does first, from a batch like `batch` (`Trainer._symbolic_build`):
    the model, its compiled loss and metrics and its optimizer built, where they are not;
    run early, once, by what plans a call before it (the memory plan, the check's step).

    Raises:
        KerasBuildError: the cell's own error, where building fails as in plain Keras (the
            call raises it; a retry from the half-built model would raise another).
    """
    try:
        model._symbolic_build(data_batch=batch)
    except Exception as exc:  # noqa: BLE001 - the cell's own error, raised by the call
        raise KerasBuildError(exc) from exc


def builds_from_a_pass(model: Any) -> bool:
    """Whether Keras's next `fit`, `evaluate` or `predict` of the model reads a batch of a
    pass of its own to build it (`Trainer._symbolic_build`: a layer, the compiled metrics or
    the compiled loss not built yet) before the call's own passes; that pass draws from the
    notebook's random state where its input shuffles."""
    if not layers_built(model):
        return True
    return any(part is not None and not part.built
               for part in (getattr(model, "_compile_metrics", None),
                            getattr(model, "_compile_loss", None)))


@dataclass(frozen=True)
class StepForm:
    """How a training step is run to fit a device: as written (`micro` 1, `remat` False),
    its batch as `micro` micro-batches inside the step (gradients accumulated, one update:
    the full batch's numbers), and/or its repeated blocks rematerialized (recomputed in the
    backward pass instead of kept)."""

    micro: int = 1
    remat: bool = False

    @property
    def as_written(self) -> bool:
        return self.micro == 1 and not self.remat

    def describe(self, batch: int | None = None) -> str:
        """E.g. "4 micro-batches of 2 (the same update as batch 8), blocks rematerialized"."""
        parts = []
        if self.micro > 1:
            size = f" of {batch // self.micro}" if batch else ""
            same = f" (the same update as batch {batch})" if batch else ""
            parts.append(f"{self.micro} micro-batches{size}{same}")
        if self.remat:
            parts.append("its repeated blocks rematerialized")
        return ", ".join(parts) or "as written"
