"""The checkpoints in one `--checkpoint DIR`: their names, listing, writing (in the form the
model needs), keeping the newest, moving damaged ones aside, finding the newest to resume.

A checkpoint holds the model's weights, the optimizer's state (its iteration count
included, so schedules continue), the number of epochs done and the seed of the data
order, in one of two forms:
- one HDF5 file (`one_file`), written by the process that leads with `atomic_path`
  (temporary file, fsync, rename, fsync of the directory);
- an orbax-checkpoint directory (`orbax_shards`), where the weights do not all sit
  whole in one process (several hosts, `--shard model`): orbax renames the directory into
  place when every process has written its shards, while the next epoch trains.
What either holds, and whether it fits a model, is `state`'s.
Either way a crash at any moment leaves every checkpoint that was complete before it
readable. The highest sequence is the newest; the last K *usable* ones are kept. Usable
means it reads back whole and its weights are finite: a damaged file is moved aside
(`NAME.damaged`) and never counted, and weights that are NaN or Inf are never written, so a
diverged run cannot prune the finite checkpoints away.

Keras is imported only where a checkpoint is written (for its version): the names, the
listing, what is kept and what is resumed from are unit-tested without it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tpu_magic.core import variables
from tpu_magic.core.atomic import atomic_path
from tpu_magic.core.errors import CheckpointError
from tpu_magic.training.checkpoints.one_file import read_checkpoint, unusable, write_file
from tpu_magic.training.checkpoints.orbax_shards import describe_shards, meta, read_shards
from tpu_magic.training.checkpoints.state import (Checkpoint, OtherModel, not_finite, state_of)

_NAME = re.compile(r"^ckpt-(\d{6,})-epoch-(\d{4,})\.(?:h5|orbax)$")
_ASIDE = re.compile(r"^ckpt-(\d{6,})-epoch-\d{4,}\.(?:h5|orbax)\.damaged$")
_TEMPORARY = re.compile(r"^\.ckpt-\d+-epoch-\d+\.h5\.(\d+)\.tmp$")
_ORBAX_TEMPORARY = ".orbax-checkpoint-tmp"  # orbax's name for a directory being written


@dataclass
class Found:
    """The newest readable checkpoint, and what was skipped to get to it."""

    checkpoint: Checkpoint | None
    skipped: list[str] = field(default_factory=list)  # "NAME: why", newest first


class CheckpointStore:
    """The checkpoints in one directory: list, write (keeping the last K), find the newest.

    Args:
        directory: where checkpoints go (created if missing; a mounted Drive works unchanged).
        keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        if keep < 1:
            raise CheckpointError(f"--keep {keep} must be 1 or more (the checkpoints to keep)")
        self.directory = Path(os.path.expanduser(str(directory)))
        self.keep = keep
        self.moved_aside: list[str] = []  # "why: moved aside to NAME", for the cell to say
        self._usable: set[str] = set()  # names known to read back whole and finite
        # frozen layers or LoRA: (bytes saved, bytes of all the weights)
        self.adapters: tuple[int, int] | None = None
        self.writer: Any = None  # the backend's shard writer, once a checkpoint needs one
        self.leads = True  # this process moves files aside and prunes (process 0 of hosts)
        # bytes each process wrote into the last orbax checkpoint, and its seconds on the step
        self.last_write: tuple[dict[int, int], float] | None = None
        self._started = 0.0

    def prepare(self) -> None:
        """Creates the directory and proves it is writable; removes dead writers' leftovers.

        Raises:
            CheckpointError: the directory cannot be created or written.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".tpu_magic-probe.{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(
                f"--checkpoint {self.directory}: cannot write there "
                f"({exc.strerror or exc}). Choose a directory you can write to, e.g. "
                "/content/drive/MyDrive/checkpoints after mounting Drive.") from exc
        for leftover in self.directory.iterdir():
            match = _TEMPORARY.match(leftover.name)
            if match and not _alive(int(match.group(1))):
                leftover.unlink(missing_ok=True)
            elif _ORBAX_TEMPORARY in leftover.name and leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)  # a write its processes left

    def listing(self) -> list[tuple[int, int, Path]]:
        """(sequence, epoch, path) of the checkpoint files, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                found.append((int(match.group(1)), int(match.group(2)), path))
        return sorted(found)

    def newest(self, model: Any = None, connection: Any = None) -> Found:
        """The newest usable checkpoint; damaged or non-finite newer ones are moved aside.
        An orbax checkpoint is read into `model`'s layout (needs `model` and `connection`).

        Raises:
            OtherModel: the newest readable one was written for another model.
        """
        found = Found(None)
        if connection is not None:
            self.leads = connection.backend.leads()
        for _, _, path in reversed(self.listing()):
            if path.suffix == ".orbax" and model is not None:
                checkpoint, why = self._read_shards(path, model, connection)
            else:
                why = self._check(path)
                checkpoint = read_checkpoint(path) if why is None else None
            if why is None:
                found.checkpoint = checkpoint
                return found
            found.skipped.append(why)
        return found

    def _read_shards(self, path: Path, model: Any, connection: Any
                     ) -> tuple[Checkpoint | None, str | None]:
        """An orbax checkpoint read on every process, and why it is unusable (None: it is),
        agreed by all of them; an unusable one is moved aside."""
        reader = self.writer or connection.backend.shard_writer(None)
        if reader is None:
            raise CheckpointError(
                f"{path.name} was written shard by shard (orbax) by Keras on JAX: resume it "
                "on JAX (`%tpu_connect --backend jax`), or point --checkpoint elsewhere")
        checkpoint, why = None, None
        try:
            checkpoint = read_shards(path, reader, model, connection.strategy)
        except OtherModel:
            raise
        except CheckpointError as exc:
            why = str(exc)
        # each process read its own shards: all agree on the outcome before the next
        # collective (the finiteness check spans every process's devices)
        if not reader.agree(why is None):
            why = why or f"{path.name} is unreadable on another host"
        elif not reader.all_finite(checkpoint.weights.arrays):
            why = f"{path.name} holds weights that are NaN or infinite"
        if why is None:
            self._usable.add(path.name)
            return checkpoint, None
        self._aside(path, why)
        return None, why

    def save(self, model: Any, epoch: int, seed: int, backend: Any) -> Path | None:
        """Writes a checkpoint atomically, then keeps the newest `keep` usable ones.

        `backend` (a `backends.Backend`) reads the model's variables. Weights that are not
        finite are not written (None comes back): they would replace a finite checkpoint.

        Raises:
            CheckpointError: it could not be written (the previous checkpoints are intact).
        """
        self.leads = backend.leads()
        if self._writer_for(model, backend) is not None:
            return self._save_shards(model, epoch, seed)
        weights, optimizer, optimizer_class = state_of(model, backend)
        if not_finite(weights.arrays):
            return None
        adapters_only = bool(variables.frozen_weights(model))
        if adapters_only:  # what a full checkpoint would weigh, for the note
            self.adapters = _share(sum(a.nbytes for a in weights.arrays), model)
        self._require_directory(epoch)
        listing = self.listing()
        sequence = self._next_sequence(listing)
        target = self.directory / f"ckpt-{sequence:06d}-epoch-{epoch:04d}.h5"
        try:
            with atomic_path(target) as temporary:
                write_file(temporary, epoch, seed, sequence, weights, optimizer, optimizer_class,
                            adapters_only)
        except OSError as exc:
            raise _not_written(f"after epoch {epoch} could not be written to {target}",
                               exc.strerror or exc, listing) from exc
        self._usable.add(target.name)
        self._prune()
        return target

    def writes_here(self, model: Any, backend: Any) -> bool:
        """Whether this process calls `save`: every process where checkpoints are written
        shard by shard, else the one that leads."""
        return backend.leads() or self._writer_for(model, backend) is not None

    def _writer_for(self, model: Any, backend: Any) -> Any:
        """The shard writer, made once a checkpoint of this model needs one (None: files)."""
        if self.writer is None:
            self.writer = backend.shard_writer(model)
        return self.writer

    def _require_directory(self, epoch: int) -> None:
        if not self.directory.is_dir():  # a lost mount (Drive), or removed while training
            raise CheckpointError(
                f"the checkpoint after epoch {epoch} could not be written: the --checkpoint "
                f"directory {self.directory} is gone (an unmounted drive, or removed while the "
                "cell trained). Training stopped; the model keeps its weights. Mount it again "
                "or choose another --checkpoint directory, then re-run the cell with --resume.")

    def _save_shards(self, model: Any, epoch: int, seed: int) -> Path | None:
        """Starts an orbax checkpoint on every process (the one before it finished first,
        then the older ones pruned); None where the weights are not finite."""
        writer = self.writer
        self.finish()
        chosen = variables.saved_weights(model)
        if not writer.all_finite([w.value for w in chosen]):
            return None
        optimizer = getattr(model, "optimizer", None)
        slots = list(optimizer.variables) if optimizer is not None and optimizer.built else []
        adapters_only = bool(variables.frozen_weights(model))
        if adapters_only:
            self.adapters = _share(sum(int(np.prod(w.shape)) * w.value.dtype.itemsize
                                       for w in chosen), model)
        self._require_directory(epoch)
        sequence = writer.from_process_0(self._next_sequence(self.listing()))
        target = self.directory / f"ckpt-{sequence:06d}-epoch-{epoch:04d}.orbax"
        started = time.perf_counter()
        try:
            writer.save(target, chosen, slots, meta(
                epoch, seed, sequence, chosen, slots,
                type(optimizer).__name__ if optimizer is not None else "", adapters_only))
        except Exception as exc:  # noqa: BLE001 - orbax's own errors, OSError among them
            raise _not_written(f"after epoch {epoch} could not be written to {target}",
                               f"{type(exc).__name__}: {exc}") from exc
        self._started = time.perf_counter() - started
        return target

    def finish(self) -> None:
        """Waits for an orbax checkpoint still being written, then keeps the newest `keep`.

        Raises:
            CheckpointError: it could not be completed.
        """
        if self.writer is None or self.writer.pending is None:
            return
        try:
            done = self.writer.finish()
        except Exception as exc:  # noqa: BLE001
            raise _not_written(f"{self.writer.pending or ''} could not be completed",
                               f"{type(exc).__name__}: {exc}") from exc
        self._usable.add(done.name)
        self.last_write = (self.writer.bytes_by_process(done), self._started)
        self._prune()

    def _next_sequence(self, listing: list) -> int:
        """One past every checkpoint's sequence, moved-aside ones too (never reused)."""
        aside = [int(m.group(1)) for m in map(_ASIDE.match, os.listdir(self.directory)) if m]
        return max([n for n, _, _ in listing] + aside, default=0) + 1

    def take_moved_aside(self) -> list[str]:
        """What was moved aside since last asked ("why: moved aside to NAME"), said once."""
        taken, self.moved_aside = self.moved_aside, []
        return taken

    def _prune(self) -> None:
        """Keeps the newest `keep` usable checkpoints; damaged files are moved aside."""
        kept = 0
        for _, _, path in reversed(self.listing()):
            if self._check(path) is not None:
                continue
            kept += 1
            if kept > self.keep and self.leads:
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
                self._usable.discard(path.name)

    def _check(self, path: Path) -> str | None:
        """Why `path` is unusable (it is then moved aside, and said in `moved_aside`); an
        orbax directory by its metadata alone (its arrays are read on resume)."""
        if path.name in self._usable:
            return None
        if path.suffix == ".orbax":
            why = None
            try:
                describe_shards(path, self.writer) if self.writer else None
            except CheckpointError as exc:
                why = str(exc)
        else:
            why = unusable(path)
        if why is None:
            self._usable.add(path.name)
            return None
        self._aside(path, why)
        return why

    def _aside(self, path: Path, why: str) -> None:
        aside = path.with_name(path.name + ".damaged")
        try:
            if self.leads:  # on several hosts process 0 moves it, once
                os.replace(path, aside)
        except OSError:
            aside = path
        self.moved_aside.append(f"{why}: moved aside to {aside.name}")


def _not_written(what: str, cause: Any, listing: list | None = None) -> CheckpointError:
    """A checkpoint that could not be written: what, why, what is intact, what to do."""
    return CheckpointError(
        f"the checkpoint {what} ({cause}). Training stopped; the model keeps its weights"
        + (f" and {listing[-1][2].name} is intact" if listing else "")
        + ". Free space or choose another --checkpoint directory, then re-run the cell with "
        "--resume.")


def _share(saved: int, model: Any) -> tuple[int, int]:
    """(bytes a checkpoint holds, bytes of all the model's weights in float32), for the note."""
    return saved, sum(int(np.prod(w.shape)) * 4 for w in model.weights)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
