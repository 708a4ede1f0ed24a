"""LoRA adapters alone (`%tpu_sync --save PATH --adapters`, `tpu_magic.load_adapters`).

A model with LoRA enabled (`layer.enable_lora(rank)`, KerasHub's `backbone.enable_lora`)
trains only its adapters and what was left trainable; its frozen bases are those of the
preset it came from. Saving the trainable variables alone makes a file a few percent of the
model's, which `load_adapters` puts back into the same model built from the same preset.
The file is HDF5: one dataset per variable, named by its path, written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np

from tpu_magic.core.atomic import atomic_path
from tpu_magic.core.variables import changing_weights, variable_bytes
from tpu_magic.core.errors import SyncError

SUFFIX = ".adapters.h5"
ADAPTER_SHARE = 0.5  # trainable variables under this share of the model's bytes: adapters


def adapters_path(text: str) -> Path:
    """`text` ending in `.adapters.h5`, in a directory that exists.

    Raises:
        SyncError: the directory does not exist.
    """
    path = Path(text).expanduser()
    for ending in (".weights.h5", ".h5"):
        if path.name.endswith(ending) and not path.name.endswith(SUFFIX):
            path = path.with_name(path.name[: -len(ending)])
    if not path.name.endswith(SUFFIX):
        path = path.with_name(path.name + SUFFIX)
    if not path.parent.is_dir():
        raise SyncError(f"--save {text!r}: the directory {str(path.parent)!r} does not exist; "
                        "create it first or save elsewhere")
    return path


def save_adapters(model: Any, path: Path, name: str) -> tuple[int, int]:
    """Writes what the model trains to `path` (gathered, float as trained): its trainable
    variables and the state that changes with them (the BatchNorm statistics of a trainable
    layer), never a frozen layer's weights or LoRA's bases (`core.variables.changing_weights`).

    Returns:
        (bytes written, bytes of all the model's weights).

    Raises:
        SyncError: the model has no adapters (most of it trains), or the file cannot be
            written.
    """
    trainable = changing_weights(model)
    whole = sum(variable_bytes(w) for w in model.weights)
    return write_adapters(path, [(v.path, np.asarray(v.value)) for v in trainable], whole,
                          name)


def write_adapters(path: Path, named: list, whole: int, name: str) -> tuple[int, int]:
    """Writes `named` ((variable path, array) pairs: what a model trains) to `path`, where
    they are adapters: under `ADAPTER_SHARE` of the model's `whole` bytes. Shared by a
    model here (`save_adapters`) and one whose arrays were gathered from several hosts.

    Returns:
        (bytes written, `whole`).

    Raises:
        SyncError: not adapters (most of the model trains), or the file cannot be written.
    """
    saved = sum(int(np.asarray(a).nbytes) for _, a in named)
    if not named or saved >= ADAPTER_SHARE * whole:
        raise SyncError(
            f"--adapters: {saved / 2**20:.2f} of {name!r}'s {whole / 2**20:.2f} MiB train, so "
            "it has no adapters to save alone; enable LoRA (`layer.enable_lora(4)`, KerasHub: "
            "`backbone.enable_lora(rank=4)`) or leave --adapters out to save every weight")
    try:
        with atomic_path(path, suffix=SUFFIX) as temporary:
            with h5py.File(temporary, "w") as handle:
                handle.attrs["tpu_magic_adapters"] = 1
                for variable_path, array in named:
                    handle.create_dataset(variable_path, data=np.asarray(array))
    except OSError as exc:
        raise SyncError(f"could not write {str(path)!r}: {exc.strerror or exc}") from None
    return saved, whole


def load_adapters(model: Any, path: str | Path) -> int:
    """Puts adapters saved by `%tpu_sync --save PATH --adapters` into `model` (the same model,
    LoRA enabled with the same rank). Returns how many variables were loaded.

    Raises:
        SyncError: not an adapters file, or a variable it names is missing or of another
            shape in `model`.
    """
    by_path = {variable.path: variable for variable in model.weights}
    with h5py.File(Path(path).expanduser(), "r") as handle:
        if not handle.attrs.get("tpu_magic_adapters"):
            raise SyncError(f"{str(path)!r} is not an adapters file of %tpu_sync --adapters")
        stored: dict[str, np.ndarray] = {}
        handle.visititems(lambda key, item: stored.__setitem__(key, item[()])
                          if isinstance(item, h5py.Dataset) else None)
    for key, value in stored.items():
        variable = by_path.get(key)
        if variable is None or tuple(variable.shape) != value.shape:
            raise SyncError(f"{str(path)!r} holds {key} {value.shape}, which the model "
                            f"{'has not' if variable is None else 'has as ' + str(tuple(variable.shape))}: "
                            "load adapters into the model they were trained on, LoRA enabled "
                            "with the same rank")
    for key, value in stored.items():
        by_path[key].assign(value)
    return len(stored)
