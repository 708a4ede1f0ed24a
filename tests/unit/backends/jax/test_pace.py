"""K chosen from a call's first steps as they train (backends/jax/loop/pace.py), with the
arithmetic stood in: which times choose, and when; and what the rule is told of the call
(its steps still to run, the group's compile)."""

from tpu_magic.backends.jax.loop.pace import TIMED, Grouping, Pace
from tpu_magic.training.fit.steps import Steps


def pace(chosen, total=None):
    """A Pace whose rule records what it is given and returns K = 8 (or 1 where the device
    time given is long)."""
    def choose(device, host, bound, timed, batch_bytes, remaining, compile_seconds):
        chosen.append((device, host, timed, remaining, compile_seconds(8)))
        return Steps(1 if device > 19 * host else 8, "rule")

    return Pace(choose=choose, confirm=lambda steps, grouped, alone: steps, total=total)


def grouping(compiled):
    return Grouping(None, 1024, compiled.append, lambda k: 0.25 * k)


def test_an_early_step_slowed_by_other_work_does_not_choose_k_alone():
    # the README's MLP: a 2 ms step timed 47.6 ms once (a compile beside it); chosen from
    # it alone, the whole fit ran one step a dispatch
    chosen, compiled = [], []
    timing = pace(chosen)
    timing.timed(1, 0.0009, 0.0476, grouping(compiled))
    assert chosen == [] and timing.choosing
    for _ in range(TIMED - 1):
        timing.timed(1, 0.0009, 0.002, grouping(compiled))
    assert chosen == [(0.002, 0.0009, TIMED, None, 2.0)] and compiled == [8]


def test_long_steps_choose_one_step_a_dispatch_after_the_timed_steps():
    chosen, compiled = [], []
    timing = pace(chosen)
    for _ in range(TIMED):
        timing.timed(1, 0.001, 1.0, grouping(compiled))
    assert timing.steps == Steps(1, "rule") and compiled == [] and not timing.choosing


def test_the_rule_is_told_the_calls_steps_still_to_run():
    # 100 train steps in the call; the first (compiling) and the three timed ones ran
    chosen, compiled = [], []
    timing = pace(chosen, total=100)
    timing.ran("train", 1)
    timing.ran("test", 5)  # another kind's steps are not the call's own
    for _ in range(TIMED):
        timing.ran("train", 1)
        timing.timed(1, 0.0009, 0.002, grouping(compiled))
    assert [c[3] for c in chosen] == [96]
