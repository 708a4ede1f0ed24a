"""A training step that does not fit a device made to fit it, with the full batch's numbers:
the forms it may take (micro-batches inside the step, its repeated blocks rematerialized:
`core.steps.StepForm`), each planned from the compiler before anything runs, the fastest
that fits chosen. Where nothing exact fits, what would change the numbers (a smaller batch,
a shorter sequence, bfloat16 variables, model columns, LoRA) is listed with its saving,
planned the same way.

The candidates are ranked by an estimate of their step's time against the step as written,
from the compiler's plan of that step (its FLOPs, its weights' bytes):
- rematerialized blocks compute each block's forward pass again in the backward pass: about
  a third more compute (`REMAT_COST`), at any micro-batch count;
- each micro-batch beyond the first reads the weights again (forward and backward), at the
  device's ratio of compute to memory bandwidth (`BALANCE`, FLOP a byte): nearly free where
  a micro-batch has many rows for its weights, a second step's time where it has few.
So an LLM's step at a few thousand tokens takes 2, 4, 8 micro-batches before its blocks
rematerialized; a small batch on a chip takes remat before many micro-batches (how the
choice compares with the best form by hand: docs/benchmarks.md). Ties keep fewer
micro-batches first.
They are planned cheapest first; a candidate the plan as written already shows will not fit
(its activations shrink by at most its micro-batches) is not compiled; the first that fits
with headroom wins, and its program, compiled for the plan, is the one the fit runs. Where
two planned in a row each save under 5 % more, the rest are not compiled either: the
step's memory is not in what the forms shrink (the weights, the optimizer's state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from tpu_magic.core.devices import StepMemory
from tpu_magic.core.steps import StepForm

Plan = Callable[[StepForm], StepMemory]  # a form's memory, compiled from abstract inputs
MARGIN = 1.15  # a candidate whose estimate exceeds the budget by more is not compiled
GAIN, STALLED = 0.05, 2  # after this many planned forms each under 5 % smaller: stop
REMAT_COST = 1 / 3  # rematerialized blocks: their forward pass again, a third of a step
# Peak compute over memory bandwidth, FLOP a byte, by the platform a plan was compiled on
# (datasheets: TPU v5e 197 TFLOP/s / 819 GB/s = 240, v6e 560, H100 295, A100 153; a CPU
# core's vector units over its share of DRAM: about 10).
BALANCE = {"tpu": 250.0, "gpu": 250.0, "cpu": 10.0}
WEIGHT_READS = 2  # a micro-batch reads the weights in its forward pass and its backward
UNKNOWN_MICRO_COST = 0.05  # a micro-batch's cost where the plan counted no FLOPs


@dataclass(frozen=True)
class Fitted:
    """The form chosen (None: nothing exact fits), its memory, the forms planned as
    (form, peak bytes), the plan's own seconds (the candidates' compiles), and why
    micro-batches were left out (None: they were tried)."""

    form: StepForm | None
    memory: StepMemory | None
    planned: tuple
    seconds: float
    not_micro: str | None = None


def candidates(rows_per_data_row: int, blocks: bool, micro_ok: bool) -> list[StepForm]:
    """The forms to try (unranked: `cost` ranks them): remat alone (where the model has
    repeated blocks and remat is allowed), then each count of micro-batches that divides a
    data row's rows, without remat, then with it."""
    found = [StepForm(1, True)] if blocks else []
    if micro_ok:
        for m in range(2, rows_per_data_row + 1):
            if rows_per_data_row % m == 0:
                found.append(StepForm(m, False))
                if blocks:
                    found.append(StepForm(m, True))
    return found


def cost(written: StepMemory, form: StepForm) -> float:
    """A form's step time as a multiple of the step as written (see the module's
    docstring): (1 + `REMAT_COST` where remat) × (1 + each further micro-batch's weight
    reads in FLOPs' time over the step's FLOPs)."""
    if written.flops:
        balance = BALANCE.get(written.compiled_on, BALANCE["tpu"])
        per_micro = WEIGHT_READS * written.weights * balance / written.flops
    else:
        per_micro = UNKNOWN_MICRO_COST
    return (1 + REMAT_COST * form.remat) * (1 + per_micro * (form.micro - 1))


def ranked(written: StepMemory, forms: list[StepForm]) -> list[StepForm]:
    """`forms`, cheapest first by `cost` (ties: fewer micro-batches, then no remat)."""
    return sorted(forms, key=lambda f: (cost(written, f), f.micro, f.remat))


def estimate(written: StepMemory, form: StepForm) -> float:
    """A form's peak at best, from the plan as written: its activations shrink by at most
    its micro-batches (remat: at most all but a block's)."""
    shrink = form.micro * (4 if form.remat else 1)
    return written.peak - written.temporaries + written.temporaries / shrink


def fit(plan: Plan, written: StepMemory, budget: float, forms: list[StepForm],
        not_micro: str | None = None) -> Fitted:
    """The cheapest of `forms` (`ranked`) whose planned peak is within `budget` (`plan`
    compiles it from abstract inputs); those the estimate rules out are not compiled."""
    start, planned, best, stalled = time.perf_counter(), [], written.peak, 0
    for form in ranked(written, forms):
        if estimate(written, form) > MARGIN * budget or stalled >= STALLED:
            continue
        memory = plan(form)
        planned.append((form, memory.peak))
        if memory.peak <= budget:
            return Fitted(form, memory, tuple(planned), time.perf_counter() - start, not_micro)
        stalled = stalled + 1 if memory.peak > (1 - GAIN) * best else 0
        best = min(best, memory.peak)
    return Fitted(None, None, tuple(planned), time.perf_counter() - start, not_micro)


@dataclass(frozen=True)
class Saving:
    """What would change the numbers, and the bytes its plan saves (None: not planned)."""

    what: str
    saved: float | None


def savings(written: StepMemory, plans: dict[str, Callable[[], StepMemory | None]],
            lora: bool) -> list[Saving]:
    """Each change's saving, planned (`plans`: the change's memory, compiled from abstract
    inputs; a change that cannot be planned is left out), largest first; LoRA's from the
    plan's optimizer term (it trains the adapters alone, so their state is most of it)."""
    found = []
    for what, planned in plans.items():
        try:
            memory = planned()
        except Exception:  # noqa: BLE001 - a change this model cannot take: not listed
            continue
        if memory is not None and memory.peak < written.peak:
            found.append(Saving(what, written.peak - memory.peak))
    if lora and written.optimizer > 0.01 * written.peak:
        found.append(Saving("LoRA (`backbone.enable_lora(4)`): the adapters train alone, so "
                            "the optimizer's state is theirs", 0.95 * written.optimizer))
    return sorted(found, key=lambda s: -(s.saved or 0))
