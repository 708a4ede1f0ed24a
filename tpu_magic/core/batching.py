"""Batch rules for R replicas: pure arithmetic, no TensorFlow.

A global batch B is split into R equal per-replica batches, so B must divide by R.
On a TPU each per-replica batch fills 8×128 MXU tiles best in multiples of 8;
128 per replica is the suggested start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SUGGESTED_PER_REPLICA = 128
TPU_TILE = 8


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch splits over the replicas.

    Attributes:
        global_batch: samples per step over all replicas.
        replicas: number of replicas.
        per_replica: samples per replica per step.
        warnings: advice that does not stop training.
    """

    global_batch: int
    replicas: int
    per_replica: int
    warnings: tuple[str, ...] = field(default_factory=tuple)


def nearest_valid(batch: int, replicas: int) -> tuple[int, int]:
    """The two valid sizes nearest `batch`: the multiples of `replicas` around it.

    Below one replica's worth, the two smallest valid sizes.
    """
    below = (batch // replicas) * replicas
    if below < replicas:
        return replicas, 2 * replicas
    return below, below + replicas


def plan_batches(
    batch: int,
    replicas: int,
    *,
    tpu_rules: bool = False,
    static_per_replica: int | None = None,
    what: str = "batch_size",
) -> BatchPlan:
    """Checks a global batch against the replicas.

    Args:
        batch: the global batch size.
        replicas: the number of replicas it is split over.
        tpu_rules: add TPU advice (per-replica multiples of 8).
        static_per_replica: a batch size fixed in the model's Input, if any.
        what: how the value is named in messages (an argument or a flag).

    Returns:
        A `BatchPlan`.

    Raises:
        BatchSizeError: the batch is not positive, not divisible by the replicas,
            or does not fit the model's static batch size.
    """
    from tpu_magic.core.errors import BatchSizeError

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise BatchSizeError(f"{what} {batch!r} must be a positive whole number, e.g. {128 * replicas}")
    if static_per_replica is not None and batch != static_per_replica * replicas:
        raise BatchSizeError(
            f"{what} {batch} does not fit the model: its Input has a static batch size of "
            f"{static_per_replica}, so each of the {replicas} replicas takes exactly "
            f"{static_per_replica}: use {what} {static_per_replica * replicas} "
            "(or build the Input without a batch size)"
        )
    if batch % replicas:
        below, above = nearest_valid(batch, replicas)
        raise BatchSizeError(
            f"{what} {batch} is not divisible by {replicas} replicas: use {below} or {above}"
        )
    per_replica = batch // replicas
    warnings = []
    if tpu_rules and per_replica % TPU_TILE:
        near = TPU_TILE * max(1, round(per_replica / TPU_TILE))
        start = SUGGESTED_PER_REPLICA * replicas
        warnings.append(
            f"{per_replica} samples per replica ({what} {batch} / {replicas}) is not a multiple "
            f"of {TPU_TILE}: TPU cores compute in 8×128 tiles, so part of each step is wasted. "
            f"Try {what} {near * replicas} ({near} per replica)"
            + (", a good start." if near * replicas == start else
               f", or {what} {start} ({SUGGESTED_PER_REPLICA} per replica) for a good start.")
        )
    return BatchPlan(batch, replicas, per_replica, tuple(warnings))


def steps_for(samples: int, batch: int, drop: bool = False) -> int:
    """Steps that cover `samples` once: the last one padded to a whole batch, or with
    `drop` only whole batches (the remainder left out)."""
    if drop:
        return samples // batch
    return max(1, math.ceil(samples / batch))


def scaled_learning_rate(base: float, plan: BatchPlan) -> float:
    """Linear scaling: the rate tuned for one replica's batch, times the replicas."""
    return base * plan.global_batch / plan.per_replica
