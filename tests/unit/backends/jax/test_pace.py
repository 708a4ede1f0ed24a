"""K chosen from a call's first steps as they train (backends/jax/loop/pace.py), with the
arithmetic stood in: which times choose, and when."""

from tpu_magic.backends.jax.loop.pace import TIMED, Pace
from tpu_magic.training.fit.steps import Steps


def pace(chosen):
    """A Pace whose rule records the times it is given and returns K = 8 (or 1 where the
    device time given is long)."""
    def choose(device, host, bound, timed, batch_bytes):
        chosen.append((device, host, timed))
        return Steps(1 if device > 19 * host else 8, "rule")

    return Pace(choose=choose, confirm=lambda steps, grouped, alone: steps)


def test_an_early_step_slowed_by_other_work_does_not_choose_k_alone():
    # the README's MLP: a 2 ms step timed 47.6 ms once (a compile beside it); chosen from
    # it alone, the whole fit ran one step a dispatch
    chosen, compiled = [], []
    timing = pace(chosen)
    timing.timed(1, 0.0009, 0.0476, None, 1024, compiled.append)
    assert chosen == [] and timing.choosing
    for _ in range(TIMED - 1):
        timing.timed(1, 0.0009, 0.002, None, 1024, compiled.append)
    assert chosen == [(0.002, 0.0009, TIMED)] and compiled == [8]


def test_long_steps_choose_one_step_a_dispatch_after_the_timed_steps():
    chosen, compiled = [], []
    timing = pace(chosen)
    for _ in range(TIMED):
        timing.timed(1, 0.001, 1.0, None, 1024, compiled.append)
    assert timing.steps == Steps(1, "rule") and compiled == [] and not timing.choosing
