"""A cell's checkpoints: opening `--checkpoint DIR`, the per-epoch callback, where
`--resume` continues, and what the written checkpoints tell the user.

The files and the directory are `checkpoints.store`'s; this module decides, for one
`%%tpu_train` cell, and returns what to say instead of saying it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pathlib import Path
from typing import Any

import keras

from tpu_magic.core.errors import CheckpointError
from tpu_magic.training.checkpoints.state import Checkpoint, restore
from tpu_magic.training.checkpoints.store import CheckpointStore


def open_store(directory: str, keep: int, resume: bool) -> CheckpointStore:
    """--checkpoint: a writable directory; without --resume, one holding no checkpoints.

    Raises:
        CheckpointError: the directory cannot be used, or holds checkpoints without --resume.
    """
    store = CheckpointStore(directory, keep)
    store.prepare()
    listing = store.listing()
    if listing and not resume:
        raise CheckpointError(
            f"--checkpoint {store.directory} already holds checkpoints (the newest after "
            f"epoch {listing[-1][1]}): add --resume to continue from it, or choose an "
            "empty directory.")
    return store


@dataclass(frozen=True)
class ResumePoint:
    """Where `--resume` continues: the checkpoint (None: from the start), and what to say.

    Attributes:
        warnings: damaged checkpoints skipped on the way.
        message: the line that says where training goes on.
    """

    checkpoint: Checkpoint | None
    message: str
    warnings: tuple[str, ...] = ()

    @property
    def notes(self) -> tuple[tuple[str, str], ...]:
        """What to say, `(text, prefix)`: the skipped checkpoints as warnings, then where
        training goes on (a line of its own)."""
        return tuple((w, "warning: ") for w in self.warnings) + ((self.message, ""),)


def resume_point(store: CheckpointStore, epochs: int, model: Any = None,
                 connection: Any = None) -> ResumePoint:
    """--resume: the newest checkpoint that reads back whole, and where training goes on
    (an orbax one read into `model` as it is laid out on `connection`).

    Raises:
        CheckpointError: checkpoints exist but none reads back whole.
    """
    found = store.newest(model, connection)
    warnings = tuple(f"{moved}; using the checkpoint before it"
                     for moved in store.take_moved_aside())
    checkpoint = found.checkpoint
    if checkpoint is None:
        if found.skipped:
            raise CheckpointError(
                f"--resume: no checkpoint in {store.directory} reads back whole with finite "
                f"weights ({'; '.join(found.skipped)}). They were moved aside (NAME.damaged), "
                "nothing was trained: run the cell again to start over, or point --checkpoint "
                "at a directory with a good checkpoint.")
        return ResumePoint(None, f"--resume: no checkpoint in {store.directory} yet, "
                                 "training from the start.", warnings)
    done = checkpoint.epoch
    return ResumePoint(
        checkpoint,
        f"Resuming from {checkpoint.path}: {done} epoch{'s' * (done != 1)} done, "
        + (f"continuing at epoch {done + 1} of {epochs}." if done < epochs
           else f"all {epochs} are done (the model gets its weights)."),
        warnings)


def not_finite_note(saver: Checkpointing, store: CheckpointStore) -> str | None:
    """Which epochs got no checkpoint because their weights were NaN or infinite."""
    if not saver.not_finite:
        return None
    epochs = ", ".join(map(str, saver.not_finite))
    newest = store.listing()
    return (f"the weights were NaN or infinite after epoch{'s' * (len(saver.not_finite) > 1)} "
            f"{epochs}, so no checkpoint was written for "
            f"{'them' if len(saver.not_finite) > 1 else 'it'}"
            + (f"; the newest finite one, {newest[-1][2].name}, is kept" if newest else "")
            + ". Lower the learning rate or look for NaN/Inf in the data, then re-run with "
            "--resume.")


def cut_short_note(saver: Checkpointing, store: CheckpointStore) -> str | None:
    """Why the last epoch has no checkpoint, where it was stopped early."""
    if saver.cut_short is None:
        return None
    newest = store.listing()
    return (f"epoch {saver.cut_short} was stopped early, so it has no checkpoint"
            + (f" (the newest is {newest[-1][2].name})" if newest else ""))


def shards_note(by_process: dict[int, int], seconds: float) -> str:
    """What the last orbax checkpoint took: each process's bytes, the step's wait."""
    parts = ", ".join(f"{by_process[p] / 2**20:.2f} MiB by process {p}" for p in sorted(by_process))
    return (f"checkpoints are written shard by shard (orbax-checkpoint), each process its own "
            f"part: {parts} for the last one; training waited {seconds:.2f} s for it, the rest "
            "was written while the next epoch trained")


# -- during fit ------------------------------------------------------------------------------

class Checkpointing(keras.callbacks.Callback):
    """Restores a checkpoint when training begins and writes one after every epoch.

    Args:
        store: where to write.
        seed: the data order's seed (saved, so a resumed run sees the same order).
        connection: the connection the model trains on (its strategy and backend).
        resume_from: the checkpoint to restore before the first step, if resuming.
    """

    def __init__(self, store: CheckpointStore, seed: int, connection: Any,
                 resume_from: Checkpoint | None = None):
        super().__init__()
        self.store, self.seed, self.connection = store, seed, connection
        self.resume_from = resume_from
        self.written: list[Path] = []
        self.cut_short: int | None = None  # an epoch stopped early (not checkpointed)
        self.not_finite: list[int] = []  # epochs whose weights were NaN/Inf (not written)

    def on_train_begin(self, logs=None):
        if self.resume_from is not None:
            restore(self.model, self.resume_from, self.connection.strategy)

    def on_train_end(self, logs=None):
        self.store.finish()  # an orbax checkpoint still being written

    def on_epoch_end(self, epoch, logs=None):
        # Called first among the callbacks: a stop requested already came from a batch
        # hook or Ctrl-C, so this epoch ended early and is not a complete one.
        if self.model.stop_training:
            self.cut_short = epoch + 1
            return
        if not self.store.writes_here(self.model, self.connection.backend):
            return  # several hosts, one file: process 0 writes it, once
        written = self.store.save(self.model, epoch + 1, self.seed, self.connection.backend)
        if written is None:
            self.not_finite.append(epoch + 1)
        else:
            self.written.append(written)


class CellCheckpoints:
    """One cell's `--checkpoint DIR [--keep K] [--resume]`: the store, where its first `fit`
    resumes, the callback of each `fit`, and what the written checkpoints tell the user.

    Raises (on construction):
        CheckpointError: the directory cannot be used, or holds checkpoints without --resume.
    """

    def __init__(self, directory: str, keep: int, resume: bool):
        self.store = open_store(directory, keep, resume)
        self._resume_pending = resume

    def resume(self, model: Any, epochs: int, connection: Any) -> ResumePoint | None:
        """Where the cell's first `fit` continues (`fit.plan`'s `resume`): the newest
        checkpoint, read into `model` as laid out on `connection`, and what to say (its
        `notes`); None: --resume was not asked, or an earlier fit of the cell resumed.

        Raises:
            CheckpointError: checkpoints exist but none reads back whole.
        """
        if not self._resume_pending:
            return None
        self._resume_pending = False
        return resume_point(self.store, epochs, model, connection)

    def callback(self, seed: int, connection: Any, resume_from: Checkpoint | None) -> Checkpointing:
        return Checkpointing(self.store, seed, connection, resume_from)

    def outcome(self, saver: Checkpointing) -> tuple[list[str], list[str]]:
        """(warnings, notes) about a `fit`'s checkpoints: files moved aside, epochs with NaN
        weights, an epoch cut short."""
        self.store.finish()  # a fit stopped early may leave one being written
        notes = [n for n in (not_finite_note(saver, self.store),
                             cut_short_note(saver, self.store)) if n]
        if self.store.last_write and saver.written:
            notes.append(shards_note(*self.store.last_write))
        if self.store.adapters and saver.written:
            saved, whole = self.store.adapters
            notes.append(f"the checkpoints hold what trains, {saved / 2**20:.2f} MiB of the "
                         f"weights' {whole / 2**20:.2f} MiB ({100 * saved / whole:.1f} %): frozen "
                         "layers and LoRA's bases never change, so they are left out, and "
                         "--resume needs the same model, frozen alike")
        return self.store.take_moved_aside(), notes


def for_request(request: Any) -> CellCheckpoints | None:
    """The cell's `--checkpoint DIR [--keep K] [--resume]` (None: no --checkpoint).

    Raises:
        CheckpointError: the directory cannot be used, or holds checkpoints without --resume.
    """
    if request.checkpoint is None:
        return None
    return CellCheckpoints(request.checkpoint, request.keep, request.resume)
