"""Batch rules for R replicas (pure arithmetic)."""

import pytest

from tpu_magic.core.batching import nearest_valid, plan_batches, scaled_learning_rate, steps_for
from tpu_magic.core.errors import BatchSizeError


@pytest.mark.parametrize("batch, replicas, valid", [
    (100, 8, (96, 104)), (6, 8, (8, 16)), (1000, 3, (999, 1002)), (7, 1, (7, 8)),
])
def test_the_nearest_valid_batches(batch, replicas, valid):
    assert nearest_valid(batch, replicas) == valid


def test_a_batch_that_does_not_split_names_the_two_nearest():
    with pytest.raises(BatchSizeError, match="batch_size 100 is not divisible by 8 replicas: "
                                             "use 96 or 104"):
        plan_batches(100, 8)


@pytest.mark.parametrize("batch", [0, -8, True, 2.5])
def test_a_batch_must_be_a_positive_whole_number(batch):
    with pytest.raises(BatchSizeError, match="must be a positive whole number"):
        plan_batches(batch, 8)


def test_tpu_advice_is_per_replica_tiles_of_8():
    assert plan_batches(1024, 8, tpu_rules=True).warnings == ()
    advice = plan_batches(96, 8, tpu_rules=True).warnings[0]
    assert "12 samples per replica" in advice
    # the suggestion per replica and as the batch to type, never read as one another (issue 34)
    assert "Try batch_size 128 (16 per replica), or batch_size 1024 (128 per replica) " \
        "for a good start." in advice
    assert plan_batches(96, 8).warnings == ()  # no TPU, no advice


def test_a_fixed_input_batch_decides_the_global_batch():
    with pytest.raises(BatchSizeError, match="use batch_size 1024"):
        plan_batches(512, 8, static_per_replica=128)


def test_steps_and_the_linear_learning_rate_rule():
    assert (steps_for(1000, 128), steps_for(1000, 128, drop=True)) == (8, 7)
    assert scaled_learning_rate(0.001, plan_batches(1024, 8)) == pytest.approx(0.008)
