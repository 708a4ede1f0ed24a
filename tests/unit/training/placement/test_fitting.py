"""The memory plan's choice of a step's form (training/placement/fitting.py): the forms ranked
by an estimate of their step time, planned cheapest first, the first that fits chosen;
against stand-in plans (no compiler)."""

import pytest

from tpu_magic.core.devices import StepMemory
from tpu_magic.core.steps import StepForm
from tpu_magic.training.placement import fitting

GIB = 2 ** 30
M, R = StepForm, lambda m: StepForm(m, True)  # m micro-batches, and with remat


def written(weights: float, flops: float | None, on: str = "tpu",
            temporaries: float = 8 * GIB) -> StepMemory:
    return StepMemory(weights=int(weights), optimizer=0, batch=0, temporaries=int(temporaries),
                      outputs=0, compiled_on=on, flops=flops)


def test_a_large_step_for_its_weights_takes_micro_batches_before_remat():
    # a 2B LLM's LoRA step on a v5e at 8 x 1024 tokens: 5 GB of bf16 weights, ~8e13 FLOPs
    step = written(5e9, 8e13)
    forms = fitting.candidates(8, blocks=True, micro_ok=True)
    assert fitting.ranked(step, forms)[:4] == [M(2), M(4), M(8), R(1)]


def test_a_small_step_on_a_chip_takes_remat_before_many_micro_batches():
    # one row of 128 tokens of the same model: a second micro-batch costs most of a step
    step = written(5e9, 1.3e12)
    assert fitting.ranked(step, fitting.candidates(8, True, True))[0] == R(1)


def test_on_the_cpu_micro_batches_cost_little_and_remat_a_third():
    step = written(30e6, 4e10, on="cpu")
    costs = {form: fitting.cost(step, form) for form in fitting.candidates(8, True, True)}
    assert costs[M(8)] < 1.15 and costs[R(1)] == pytest.approx(4 / 3)
    assert costs[R(2)] > costs[M(8)]


def test_without_a_flop_count_a_few_micro_batches_come_before_remat():
    step = written(30e6, None)
    assert fitting.ranked(step, fitting.candidates(8, True, True))[:3] == [M(2), M(4), R(1)]


def test_the_cheapest_form_that_fits_is_chosen_and_costlier_ones_are_not_compiled():
    # the benchmark's case (docs/benchmarks.md): 2 micro-batches do not fit, 4 do, 2 with
    # remat would too; the old rank chose 2 with remat, at 0.54 of the best by hand
    step = written(30e6, 4e10, on="cpu", temporaries=8 * GIB)
    peaks = {M(2): 5 * GIB, M(4): 3 * GIB, R(1): 4.5 * GIB, R(2): 2.5 * GIB, M(8): 2 * GIB}
    compiled = []

    def plan(form):
        compiled.append(form)
        return written(30e6, 4e10, on="cpu", temporaries=peaks[form])

    chosen = fitting.fit(plan, step, 4 * GIB, fitting.candidates(8, True, True))
    assert chosen.form == M(4) and compiled == [M(2), M(4)]
    assert [form for form, _ in chosen.planned] == [M(2), M(4)]


def test_without_repeated_blocks_or_with_remat_off_no_form_rematerializes():
    forms = fitting.candidates(8, blocks=False, micro_ok=True)
    assert forms == [M(2), M(4), M(8)]
    assert fitting.candidates(8, blocks=True, micro_ok=False) == [R(1)]


def test_a_plan_that_stalls_stops_compiling():
    # the memory is the weights': no form shrinks it, so after two planned forms that save
    # under 5 % each, the rest are not compiled and nothing fits
    compiled = []

    def plan(form):
        compiled.append(form)
        return StepMemory(weights=int(30e6), optimizer=10 * GIB, batch=0,
                          temporaries=int(0.99 * GIB), outputs=0, compiled_on="cpu")

    big = StepMemory(weights=int(30e6), optimizer=10 * GIB, batch=0, temporaries=GIB,
                     outputs=0, compiled_on="cpu", flops=4e10)
    chosen = fitting.fit(plan, big, 10.5 * GIB, fitting.candidates(8, True, True))
    assert chosen.form is None and len(compiled) == 2
