"""Checkpoints written shard by shard with orbax-checkpoint (JAX): for a model whose weights
do not all sit whole in this process (several hosts, or `--shard model`).

Every process calls the same functions in the same order (they are collectives): each
writes the shards its devices hold, never gathering the model into one process; orbax
writes into a temporary directory and renames it when every process is done, so a
checkpoint directory that exists is complete. Reading lays each array out as the model's
variable is laid out now, so a checkpoint resumes into another mesh. The directory's
naming, `--keep` and damaged checkpoints are `training.checkpoints.store`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tpu_magic.core.errors import CheckpointError

SUFFIX = ".orbax"


def wanted(model_variables: Sequence[Any]) -> bool:
    """Whether checkpoints of these variables are written shard by shard: on several
    processes, or where any variable is split over the devices."""
    import jax

    if jax.process_count() > 1:
        return True
    shardings = (getattr(v.value, "sharding", None) for v in model_variables)
    return any(s is not None and not s.is_fully_replicated for s in shardings)


class ShardWriter:
    """One `--checkpoint` directory's orbax writer: one save in flight at a time, written in
    the background while the next epoch trains (orbax copies the arrays off the devices
    before `save` returns, so the next step cannot change what is written)."""

    def __init__(self) -> None:
        try:
            import orbax.checkpoint as ocp
        except ImportError:
            raise CheckpointError(
                "checkpoints of a model split over the devices or hosts are written shard by "
                "shard with orbax-checkpoint, which is not installed: pip install "
                "orbax-checkpoint (or leave --checkpoint out)") from None

        self._checkpointer = ocp.StandardCheckpointer()
        # reading goes through the handler itself: the checkpointer's `restore` ends in a
        # barrier of every process, which a process whose read failed never reaches, so a
        # checkpoint damaged on one host would hold the others there until the run died;
        # here each process reads on its own and the store agrees on the outcome afterwards
        self._reader = ocp.StandardCheckpointHandler()
        self._restore = ocp.args.StandardRestore
        self.pending: Path | None = None

    def save(self, path: Path, weights: Sequence[Any], optimizer: Sequence[Any],
             meta: dict) -> None:
        """Starts writing the variables' values (`weights`, `optimizer`) and `meta` to `path`."""
        tree = {"weights": {str(i): v.value for i, v in enumerate(weights)},
                "optimizer": {str(i): v.value for i, v in enumerate(optimizer)}}
        self._checkpointer.save(os.fspath(path), tree, custom_metadata=meta)
        self.pending = path

    def finish(self) -> Path | None:
        """Waits for the save in flight, if any; the path it completed."""
        done, self.pending = self.pending, None
        if done is not None:
            self._checkpointer.wait_until_finished()
        return done

    def meta(self, path: Path) -> dict:
        """The `meta` a checkpoint was saved with.

        Raises:
            Exception: whatever orbax raises for a damaged or foreign directory.
        """
        found = self._checkpointer.metadata(os.fspath(path))
        return dict(getattr(found, "custom_metadata", None) or {})

    def read(self, path: Path, weights: Sequence[Any], optimizer: Sequence[Any]
             ) -> tuple[list[Any], list[Any]]:
        """The saved arrays, each laid out as its variable is now (this process reading only
        its own shards, with no barrier: the caller agrees on the outcome, `agree`).

        Raises:
            Exception: whatever orbax raises for a damaged checkpoint or other shapes.
        """
        import jax

        def target(variables: Sequence[Any]) -> dict:
            return {str(i): jax.ShapeDtypeStruct(v.value.shape, v.value.dtype,
                                                 sharding=v.value.sharding)
                    for i, v in enumerate(variables)}

        from etils import epath

        restored = self._reader.restore(epath.Path(path), args=self._restore(
            {"weights": target(weights), "optimizer": target(optimizer)}))
        return ([restored["weights"][str(i)] for i in range(len(weights))],
                [restored["optimizer"][str(i)] for i in range(len(optimizer))])

    @staticmethod
    def all_finite(values: Sequence[Any]) -> bool:
        """Whether every floating-point value is finite: reduced on the devices, the answer the
        same on every process."""
        import jax
        import jax.numpy as jnp

        floats = [v for v in values if jnp.issubdtype(v.dtype, jnp.inexact)]
        if not floats:
            return True
        return bool(jax.jit(lambda vs: jnp.all(jnp.stack([jnp.isfinite(v).all() for v in vs])))(
            floats))

    @staticmethod
    def agree(flag: bool) -> bool:
        """True where `flag` is true on every process."""
        import jax

        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.all(multihost_utils.process_allgather(np.array([flag]))))

    @staticmethod
    def from_process_0(value: int) -> int:
        """Process 0's `value`, on every process (so all name a checkpoint alike)."""
        import jax

        if jax.process_count() == 1:
            return value
        from jax.experimental import multihost_utils

        return int(multihost_utils.broadcast_one_to_all(np.int64(value)))

    @staticmethod
    def bytes_by_process(path: Path) -> dict[int, int]:
        """The bytes each process wrote into a checkpoint directory (orbax's OCDBT layout:
        `ocdbt.process_N/`), process 0's share counting what it wrote at the top too."""
        found: dict[int, int] = {}
        for root, _, files in os.walk(path):
            part = Path(root).relative_to(path).parts
            own = part and part[0].startswith("ocdbt.process_")
            who = int(part[0].split("_")[-1]) if own else 0
            found[who] = found.get(who, 0) + sum(os.path.getsize(Path(root) / f) for f in files)
        return found
