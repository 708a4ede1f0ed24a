"""A distributed model's variables: finding, reading, averaging, and the user's name for it.

Rewrap, `%tpu_sync` and checkpoints all read a model trained under a strategy. The
backend says where its variables can be read and what each replica holds (see
`backends.Backend.reading` and `replica_values`); the averaging rule is here, once.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def variable_bytes(variable: Any) -> int:
    """A variable's bytes, whole (on one device), from its shape and dtype: nothing read."""
    return int(np.prod(variable.shape)) * np.dtype(str(variable.dtype)).itemsize


def variables_of(model: Any) -> list[Any]:
    """The model's weights, then its optimizer's variables."""
    found = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        found += list(optimizer.variables)
    return found


def replica_weights(model: Any, backend: Any, weights: list[Any] | None = None
                    ) -> tuple[list[np.ndarray], list[str], int]:
    """The model's weights as arrays, averaged over replicas where the replicas disagree.

    Replicas disagree on variables each replica updates alone (e.g. BatchNormalization's
    moving statistics under MirroredStrategy); trained weights agree. 16-bit float
    variables (a bfloat16 policy) come back as float32, for a float32 CPU model.

    Replicas that hold the same NaN agree (a diverged model is not "averaged").

    Args:
        weights: the variables to read (default: all of `model.weights`).

    Returns:
        (the arrays in `weights` order, the paths of the variables averaged,
        the number of replicas seen).
    """
    arrays, averaged, replicas = [], [], 1
    with backend.reading(model):
        for weight in model.weights if weights is None else weights:
            parts = [float32(np.asarray(p)) for p in backend.replica_values(weight)]
            replicas = max(replicas, len(parts))
            first = parts[0]
            if len(parts) > 1 and not all(same(first, p) for p in parts[1:]):
                if np.issubdtype(first.dtype, np.floating):
                    first = np.mean(np.stack(parts), axis=0).astype(first.dtype)
                    averaged.append(weight.path)
            arrays.append(first)
    return arrays, averaged, replicas


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, NaN equal to NaN where the dtype can hold one."""
    return np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.inexact))


def float32(array: np.ndarray) -> np.ndarray:
    """A bfloat16 or float16 array as float32; any other as it is."""
    return array.astype(np.float32) if array.dtype.name in ("bfloat16", "float16") else array


def frozen_lora_bases(model: Any) -> set[int]:
    """ids of the frozen base weights of layers with LoRA enabled (`layer.enable_lora(rank)`:
    the kernel or embeddings stop training; only the small `lora_*` factors change)."""
    found = set()
    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, "lora_enabled", False):
            found |= {id(v) for v in layer.weights
                      if not v.trainable and "lora" not in v.path.rsplit("/", 1)[-1]}
    return found


def frozen_weights(model: Any) -> set[int]:
    """ids of the weights training never changes: LoRA's frozen bases, and the floating-point
    weights a layer whose `trainable` is False holds itself (not through a sublayer), unless
    Keras trains them (a frozen layer's kernels, embeddings and norms; a frozen
    BatchNormalization runs in inference mode, so its statistics stay too). KerasHub's
    `enable_lora` freezes the embedding and every block this way, and leaves the LoRA layers
    inside them trainable. Integer state (a seed generator's) may change: never frozen."""
    trained = {id(v) for v in model.trainable_weights}
    found = frozen_lora_bases(model)
    for layer in model._flatten_layers(include_self=True):
        if layer.trainable:
            continue
        inner = {id(v) for sub in layer._flatten_layers(include_self=False) for v in sub.weights}
        found |= {id(v) for v in layer.weights
                  if id(v) not in inner and id(v) not in trained
                  and "float" in str(getattr(v.dtype, "name", v.dtype))}
    return found


def changing_weights(model: Any) -> list[Any]:
    """The weights training may change: all of them, less `frozen_weights` (the model that
    loads them has those already). The trainable ones, and the non-trainable state that
    changes with them (BatchNorm statistics of trainable layers)."""
    frozen = frozen_weights(model)
    return [w for w in model.weights if id(w) not in frozen]


def saved_weights(model: Any) -> list[Any]:
    """The weights a checkpoint holds: `changing_weights`, and the seed generators' states."""
    return changing_weights(model) + seed_states(model)


def seed_states(model: Any) -> list[Any]:
    """The states of the model's random layers' seed generators (Dropout's, ...): not among
    its weights, yet each step moves them, so a resumed run draws as the run it continues."""
    states, seen = [], set()
    for layer in model._flatten_layers(include_self=True):
        for generator in getattr(layer, "_seed_generators", ()):
            state = getattr(generator, "state", None)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states


def optimizer_state(model: Any, backend: Any) -> list[np.ndarray] | None:
    """The optimizer's variables as arrays (None: no optimizer, or not built yet)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return None
    with backend.reading(model):
        return [np.asarray(backend.replica_values(v)[0]) for v in optimizer.variables]


def names_of(namespace: Mapping[str, Any], obj: Any) -> list[str]:
    """The notebook's names for `obj`, sorted (private `_names` left out)."""
    if obj is None:
        return []
    return sorted(k for k, v in namespace.items() if v is obj and not k.startswith("_"))


def name_of(namespace: Mapping[str, Any], obj: Any, preferred: str | None = None) -> str | None:
    """The user's name for `obj`: `preferred` where it still names it, else the first."""
    names = names_of(namespace, obj)
    if preferred in names:
        return preferred
    return names[0] if names else None
