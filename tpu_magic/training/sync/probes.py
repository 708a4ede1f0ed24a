"""A probe batch through a trained model and its CPU copy: the largest difference in their
predictions, which `%tpu_sync` reports."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from tpu_magic.core.errors import SyncError

PROBE_ROWS = 8
# sequence lengths tried, in turn, for inputs that leave theirs open (token ids): a model
# with fewer positions than the first (a GPT-2 of 8) takes a later one
PROBE_LENGTHS = (16, 4, 1)


def probe_batch(model: Any, rows: int = PROBE_ROWS, seed: int = 0,
                length: int = PROBE_LENGTHS[0]) -> Any | None:
    """Inputs for a quick comparison, in the structure the model takes (a dict for KerasHub's
    `token_ids` and `padding_mask`): normal floats; small integers for index inputs (valid for
    any Embedding); ones for a mask; `length` where the model leaves one open (a sequence). None: the model has no inputs to read (a subclassed model never called)."""
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        return _probe_from_build(model, rows, seed, length)
    rng = np.random.default_rng(seed)
    batch = []
    for spec in inputs:
        shape = (rows, *(length if d is None else d for d in tuple(spec.shape)[1:]))
        dtype = np.dtype(getattr(spec, "dtype", "float32"))
        if "mask" in str(getattr(spec, "name", "")) or dtype == np.bool_:
            batch.append(np.ones(shape, dtype))  # every position real
        elif np.issubdtype(dtype, np.integer):
            batch.append(rng.integers(0, 2, size=shape).astype(dtype))
        else:
            batch.append(rng.standard_normal(shape).astype(dtype))
    structure = getattr(model, "_inputs_struct", None)
    if structure is not None and not isinstance(structure, (list, tuple)):
        return keras.tree.pack_sequence_as(structure, batch)  # a dict, as the model takes
    return batch[0] if len(batch) == 1 else batch


def _probe_from_build(model: Any, rows: int, seed: int, length: int) -> Any | None:
    """A subclassed model's probe, from the input shape it was built for (`build_config`):
    0s and 1s as float32, which any index input (an Embedding's) and any dense one takes;
    None where it was never built with one shape."""
    shape = (model.get_build_config() or {}).get("input_shape") if model.built else None
    if not isinstance(shape, (list, tuple)) or not shape or \
            not all(d is None or isinstance(d, int) for d in shape):
        return None
    dims = tuple(length if d is None else d for d in tuple(shape)[1:])
    return np.random.default_rng(seed).integers(0, 2, size=(rows, *dims)).astype("float32")


def _predict(model: Any, batch: Any, backend: Any) -> list[np.ndarray]:
    with backend.reading(model):
        out = model(batch, training=False)
    return [np.asarray(o) for o in keras.tree.flatten(out)]


def compared(model: Any, copy: Any, name: str, backend: Any) -> float | None:
    """The largest prediction difference between the trained model and its copy on a probe
    batch; None where no probe can be made, or the trained model itself refuses the probe's
    made-up input at every length tried (`PROBE_LENGTHS`)."""
    for length in PROBE_LENGTHS:
        probe = probe_batch(copy, length=length)
        if probe is None:
            return None
        try:
            ours = _predict(model, probe, backend)
            break
        except Exception:  # noqa: BLE001 - the made-up input, not the copy, is wrong for it
            continue
    else:
        return None
    try:
        theirs = _predict(copy, probe, backend)
    except Exception as exc:  # noqa: BLE001 - the model takes it and its copy does not
        raise SyncError(f"the CPU copy of {name!r} fails on an input the trained model takes "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                        "its get_config() does not describe the trained model") from None
    return max(float(np.max(np.abs(a - b))) if a.size else 0.0 for a, b in zip(ours, theirs))
