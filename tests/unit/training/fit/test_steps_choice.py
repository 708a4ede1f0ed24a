"""`training/fit/steps.chosen`: the steps an execution, from measured times (pure arithmetic;
the measuring itself is tested with each backend)."""

import pytest

from tpu_magic.training.fit.steps import (KERAS_LOOP_SECONDS, MOST, AsTheyRun, Steps, StepTimes,
                                         chosen, paid_for)

pytestmark = pytest.mark.quick


def choose(device=1e-5, host=4e-4, epoch=1000, batch_bytes=4096, memory=None, hooks=(),
           requested=None, own=1, divides=None, most=None, grouped=None):
    asked = []

    def measure():
        asked.append(True)
        return None if device is None else StepTimes(device, host, most)

    def confirm(k):
        asked.append(k)
        return grouped

    return chosen(requested, own, measure, epoch, batch_bytes, memory, list(hooks),
                  divides, confirm), asked


def test_a_users_k_wins_and_nothing_is_measured():
    assert choose(requested=7) == (chosen(7, 1, lambda: None, 10, 0, None, []), [])
    steps, asked = choose(own=4)
    assert (steps.k, steps.why, asked) == (4, "the model's own steps_per_execution", [])


def test_a_callback_reading_every_batch_and_a_short_epoch_keep_one_step():
    steps, asked = choose(hooks=["LambdaCallback"])
    assert steps.k == 1 and "LambdaCallback reads every batch" in steps.why and not asked
    steps, asked = choose(epoch=7)
    assert steps.k == 1 and "7 steps are too few" in steps.why and not asked


def test_k_keeps_the_host_under_five_percent_of_the_device():
    # host 0.4 ms + Keras's loop a dispatch against 0.1 ms a step: 19 x 0.6 / 0.1 = 114
    steps, _ = choose(device=1e-4, host=4e-4, epoch=None)
    wanted = -(-(4e-4 + KERAS_LOOP_SECONDS) * 19 // 1e-4)
    assert steps.k == wanted == 114 and "keep the host under 5%" in steps.why
    steps, _ = choose(device=1e-4, host=4e-4, epoch=10_000)
    assert steps.k == 100  # a divisor of the epoch's steps near it: one program throughout


def test_a_long_step_runs_alone():
    steps, _ = choose(device=0.05, host=4e-4)
    assert steps.k == 1 and "one step a dispatch keeps the host under 5%" in steps.why


@pytest.mark.parametrize("epoch, k", [(1000, 250), (998, 249), (996, 249), (10**6, 1000), (2**20, MOST)])
def test_bounded_by_four_executions_an_epoch_preferring_a_divisor(epoch, k):
    steps, _ = choose(device=1e-7, epoch=epoch)
    assert steps.k == k, steps


def test_bounded_by_memory_for_the_batches():
    steps, _ = choose(device=1e-7, epoch=10**6, batch_bytes=2**20, memory=2**30)
    assert steps.k == 64 and "memory for the batches" in steps.why  # 1/16 of 1 GiB / 1 MiB


def test_k_divides_the_steps_keras_runs_whole_executions_of():
    steps, _ = choose(device=1e-7, epoch=100, divides=9)
    assert steps.k == 9 and "the call's 9 steps a pass, which K divides" in steps.why
    steps, _ = choose(device=1e-7, epoch=100, divides=7 * 11)
    assert steps.k == 11


def test_not_measured_is_one_step_said():
    steps, asked = choose(device=None)
    assert steps.k == 1 and "no step was measured" in steps.why and asked


def test_the_backends_own_bound_on_a_group_is_kept_and_said():
    steps, _ = choose(device=1e-4, host=4e-4, epoch=None, most=(8, "slow loops here"))
    assert steps.k == 8 and steps.why.endswith("8 steps a dispatch, bounded by slow loops here")
    steps, _ = choose(device=1e-4, host=4e-4, epoch=None, most=(512, "slow loops here"))
    assert steps.k == 114  # a bound above the wanted K changes nothing


def test_a_group_measured_slower_a_step_than_one_step_a_dispatch_is_not_run():
    # 0.1 ms a step and 0.6 ms of host work: one a dispatch costs 0.7 ms a step
    steps, asked = choose(device=1e-4, host=4e-4, epoch=None, grouped=8e-4)
    assert (steps.k, asked[-1]) == (1, 114)
    assert steps.why.endswith("114 steps a dispatch keep the host under 5%, but that group "
                              "measured 0.8 ms a step against 0.7 ms one a dispatch: one step "
                              "a dispatch")
    steps, _ = choose(device=1e-4, host=4e-4, epoch=None, grouped=1.05e-4)
    assert steps.k == 114  # faster a step: kept
    steps, _ = choose(device=1e-4, host=4e-4, epoch=None, grouped=None)
    assert steps.k == 114  # not measured: the step's own times decide


def test_a_group_that_saves_less_than_its_compile_is_not_compiled():
    # the tutorials' CNN on 8 simulated devices: 29 ms steps, 15.5 ms of host work an
    # execution, 125 steps left, a group of 8 unrolled compiling in ~10 s: it would save
    # ~1.7 s at most, and its compile ran beside the steps until the call ended
    rule = AsTheyRun(64, None, 8, call_steps=128)
    kept = rule.choose(0.029, 0.0155, (8, "a bound"), 3, 8 * 128 * 768, remaining=125,
                       compile_seconds=lambda k: 1.3 * k)
    assert kept.k == 1 and "would save less over the call's 125 steps" in kept.why


def test_a_group_that_pays_for_its_compile_is_kept():
    # the CPU proxy: 0.04 ms steps, 0.57 ms of host work, 4,093 steps left, a loop
    # compiling in ~0.4 s: it saves ~2 s
    rule = AsTheyRun(4096, None, 1, call_steps=4096)
    kept = rule.choose(4e-5, 5.7e-4, None, 3, 32 * 64 * 4, remaining=4093,
                       compile_seconds=lambda k: 0.4)
    assert kept.k > 1 and "compile" not in kept.why


def test_a_group_compiled_already_or_of_unknown_cost_is_kept_as_chosen():
    rule = AsTheyRun(64, None, 8, call_steps=128)
    for seconds in (0.0, None):
        kept = rule.choose(0.029, 0.0155, (8, "a bound"), 3, 1024, remaining=10,
                           compile_seconds=lambda k, s=seconds: s)
        assert kept.k == 8


def test_paid_for_counts_only_the_steps_after_the_compile():
    # 100 steps left of 1 ms each: a 0.09 s compile leaves 10 steps grouped, saving
    # 10 x 0.9 ms x 7/8 ~ 0.008 s: not worth it, though 100 steps would save 0.079 s
    steps = Steps(8, "chosen")
    assert paid_for(steps, 0.0001, 0.0009, 100, 0.09).k == 1
    assert paid_for(steps, 0.0001, 0.0009, 1000, 0.09) == steps


@pytest.mark.parametrize("host", [1.67e-3, 1.88e-3, 2.21e-3])
def test_timings_a_little_apart_choose_the_same_k_from_the_first_steps(host):
    # the README's MLP on 8 simulated devices, three cells: 9, 12 and 13 steps wanted,
    # each a group compiled again; rounded up to 16, then the epoch's divisor below it
    rule = AsTheyRun(468, None, 8)
    assert rule.choose(3e-3, host, None, 3, 128 * 784 * 4).k == 13


def test_on_a_chip_a_group_compiled_by_the_hosts_spare_cores_need_only_be_ready_in_time():
    # the same CNN's numbers on a TPU or GPU: the compile costs the steps nothing, so the
    # group runs where it is ready before the call's steps end, and not where it is not
    on_a_chip = AsTheyRun(64, None, 8, call_steps=128, compile_competes=False)
    kept = on_a_chip.choose(0.029, 0.0155, None, 3, 1024, remaining=125,
                            compile_seconds=lambda k: 2.0)
    assert kept.k > 1 and "compile" not in kept.why
    late = on_a_chip.choose(0.029, 0.0155, None, 3, 1024, remaining=125,
                            compile_seconds=lambda k: 11.0)
    assert late.k == 1 and "would not be ready before the call's 125 steps" in late.why
