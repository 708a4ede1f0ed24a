"""A checkpoint as one HDF5 file, `ckpt-SEQUENCE-epoch-EPOCH.h5`: written by the process
that leads, whole, and read back whole (a damaged file fails on reading).

Keras is imported only where a checkpoint is written (for its version).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from tpu_magic.core.errors import CheckpointError
from tpu_magic.training.checkpoints.state import FORMAT, Checkpoint, Variables, not_finite


def write_file(path: Path, epoch: int, seed: int, sequence: int, weights: Variables,
                optimizer: Variables, optimizer_class: str, adapters_only: bool = False) -> None:
    """Writes a checkpoint file at `path` (the store writes it to a temporary path first)."""
    import keras

    with h5py.File(path, "w") as handle:
        handle.attrs.update(format=FORMAT, epoch=epoch, seed=seed, sequence=sequence,
                            optimizer_class=optimizer_class, keras_version=keras.__version__,
                            adapters_only=adapters_only)
        for group_name, saved in (("weights", weights), ("optimizer", optimizer)):
            group = handle.create_group(group_name)
            group.attrs["names"] = json.dumps(list(saved.names))
            for i, array in enumerate(saved.arrays):
                group.create_dataset(str(i), data=array)


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Reads a whole checkpoint file (every array), so a damaged file fails here.

    Raises:
        CheckpointError: the file is not a complete tpu_magic checkpoint.
    """
    path = Path(path)
    try:
        with h5py.File(path, "r") as handle:
            if handle.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path.name} is not a tpu_magic checkpoint")
            groups = {}
            for group_name in ("weights", "optimizer"):
                group = handle[group_name]
                names = tuple(json.loads(group.attrs["names"]))
                arrays = tuple(np.asarray(group[str(i)][()]) for i in range(len(names)))
                groups[group_name] = Variables(names, arrays)
            return Checkpoint(path, int(handle.attrs["sequence"]), int(handle.attrs["epoch"]),
                              int(handle.attrs["seed"]), groups["weights"], groups["optimizer"],
                              str(handle.attrs["optimizer_class"]),
                              bool(handle.attrs.get("adapters_only", False)))
    except CheckpointError:
        raise
    except Exception as exc:  # h5py reports damage as OSError, KeyError, ValueError, ...
        raise CheckpointError(f"{path.name} is unreadable ({type(exc).__name__}: {exc})") from exc


def unusable(path: Path) -> str | None:
    """Why a checkpoint file cannot be resumed from (None: it reads back whole and finite)."""
    try:
        checkpoint = read_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    if not_finite(checkpoint.weights.arrays):
        return f"{path.name} holds weights that are NaN or infinite"
    return None
