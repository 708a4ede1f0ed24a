"""A checkpoint as an orbax-checkpoint directory, `ckpt-SEQUENCE-epoch-EPOCH.orbax`, where
the weights do not all sit whole in one process (several hosts, `--shard model`): every
process writes its own shards (the backend's `shard_writer`), and reads them back into the
model's current layout (another mesh works). Its metadata says what `Checkpoint` says.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tpu_magic.core import variables
from tpu_magic.core.errors import CheckpointError
from tpu_magic.training.checkpoints.state import (FORMAT, Checkpoint, Variables, check_fits)


def meta(epoch: int, seed: int, sequence: int, chosen: list, slots: list,
          optimizer_class: str, adapters_only: bool) -> dict:
    """The checkpoint's metadata: its counters, and the variables' names and shapes."""
    import keras

    return {"format": FORMAT, "epoch": epoch, "seed": seed, "sequence": sequence,
            "optimizer_class": optimizer_class, "keras_version": keras.__version__,
            "adapters_only": adapters_only,
            "weights": [w.path for w in chosen], "weight_shapes": [list(w.shape) for w in chosen],
            "optimizer": [v.path for v in slots], "optimizer_shapes": [list(v.shape) for v in slots]}


def describe_shards(path: Path, reader: Any) -> Checkpoint:
    """An orbax checkpoint's names, shapes and counters, its arrays not read.

    Raises:
        CheckpointError: it is damaged or not a tpu_magic checkpoint.
    """
    try:
        meta = reader.meta(path)
    except Exception as exc:  # noqa: BLE001 - orbax reports damage in many types
        raise unreadable(path, exc) from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path.name} is not a tpu_magic checkpoint")

    def described(names: str, shapes: str) -> Variables:
        return Variables(tuple(meta[names]), (), tuple(tuple(s) for s in meta[shapes]))

    return Checkpoint(path, int(meta["sequence"]), int(meta["epoch"]), int(meta["seed"]),
                      described("weights", "weight_shapes"),
                      described("optimizer", "optimizer_shapes"), str(meta["optimizer_class"]),
                      bool(meta["adapters_only"]))


def unreadable(path: Path, exc: Exception) -> CheckpointError:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return CheckpointError(f"{path.name} is unreadable ({type(exc).__name__}: {first})")


def read_shards(path: Path, reader: Any, model: Any, strategy: Any) -> Checkpoint:
    """An orbax checkpoint read into arrays laid out as the model's variables are now (each
    process reading its own shards; another mesh works).

    Raises:
        OtherModel: it was written for another model.
        CheckpointError: it is damaged.
    """
    described = describe_shards(path, reader)
    check_fits(model, described, strategy)
    slots = list(model.optimizer.variables) if described.optimizer.names else []
    try:
        weights, optimizer = reader.read(path, variables.saved_weights(model), slots)
    except Exception as exc:  # noqa: BLE001
        raise unreadable(path, exc) from exc
    return dataclasses.replace(
        described, weights=Variables(described.weights.names, tuple(weights)),
        optimizer=Variables(described.optimizer.names, tuple(optimizer)))
