"""A cell's checkpoint wiring: opening `--checkpoint DIR`, where `--resume` continues, and
what the written checkpoints tell the user.

The files, the directory and the per-epoch callback are `checkpoint`'s; this module
decides, for one `%%tpu_train` cell, and returns what to say instead of saying it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpu_magic.checkpoint import Checkpoint, CheckpointStore, Checkpointing
from tpu_magic.errors import CheckpointError


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


@dataclass
class ResumePoint:
    """Where `--resume` continues: the checkpoint (None: from the start), and what to say.

    Attributes:
        warnings: damaged checkpoints skipped on the way.
        message: the line that says where training goes on.
    """

    checkpoint: Checkpoint | None
    message: str
    warnings: list[str] = field(default_factory=list)


def resume_point(store: CheckpointStore, epochs: int) -> ResumePoint:
    """--resume: the newest checkpoint that reads back whole, and where training goes on.

    Raises:
        CheckpointError: checkpoints exist but none reads back whole.
    """
    found = store.newest()
    warnings = [f"{moved}; using the checkpoint before it" for moved in store.take_moved_aside()]
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
