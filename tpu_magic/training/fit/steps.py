"""How many steps a call runs an execution (one dispatch to the device): the user's own
`steps_per_execution` or `--steps-per-execution K`, else chosen (`--steps-per-execution
auto`, the default) from a step's measured device time and the host's work an execution.

A dispatch costs the host a fixed amount (Keras's loop, the callbacks' hooks, the batches'
transfer, the call into the compiled program). While the device runs K steps of d seconds
each, that host work of h seconds is either hidden behind them or, when K·d is short, what
the device waits for. K is the smallest whole number for which h is at most 5 % of K·d,
bounded by the epoch's steps (a divisor of them where one is near, so every execution is
the same program) and by at least four executions an epoch (so the bar moves and a steady
rate is measured after the first), by memory (K batches on the device at once), by the
backend's own bound (a group it runs slower a step) and by a cap; 1 where a step alone
already outlasts the host's work 19 times over (a language model's step of tens of
milliseconds). Chosen from a call's first steps (`AsTheyRun`), the K wanted is rounded up
to a power of two before it is bounded (timings a little apart choose the same K, so a
later cell runs the group an earlier one compiled), and K above one also pays for its
group's compile: the host's work it saves over the call's steps still to run, once
compiled, outweighs the compile's estimated seconds (`paid_for`), so a short fit of long
steps does not compile a group it would run a few times. Pure arithmetic: the
measurements come from the backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

HOST_SHARE = 0.05  # the host's work an execution, at most this share of its device time
MOST = 1024  # steps an execution, at most
EXECUTIONS = 4  # executions an epoch, at least (where its steps allow)
MEMORY_SHARE = 1 / 16  # K batches on a device take at most this share of its memory
CPU_BATCHES_BYTES = 2 ** 30  # where a device's memory is not known: 1 GiB of batches
# Keras's own work an execution beyond the step's dispatch and its inputs (its loop, the
# callbacks' hooks, the state's bookkeeping), in seconds; measured with the magic's
# callbacks on this project's machine (docs/benchmarks.md): an estimate, not a bound.
KERAS_LOOP_SECONDS = 2e-4


@dataclass(frozen=True)
class StepTimes:
    """One step, measured: its device seconds, and the host's seconds an execution (the
    dispatch and one batch's transfer; Keras's loop is added as `KERAS_LOOP_SECONDS`);
    `most`: the longest group the backend runs as fast a step as one step alone, and why
    (None: no bound of its own)."""

    device: float
    host: float
    most: tuple[int, str] | None = None


@dataclass(frozen=True)
class Steps:
    """Steps an execution, and why (the report's line)."""

    k: int
    why: str

    def line(self) -> str:
        return f"steps per execution: {self.k} ({self.why})"


def chosen(requested: int | None, own: int, measure: Callable[[], StepTimes | None],
           epoch_steps: int | None, batch_bytes: int, device_bytes: float | None,
           batch_hooks: list[str], divides: int | None = None,
           confirm: Callable[[int], float | None] | None = None) -> Steps:
    """The steps an execution for one call, from a step measured before it runs (a backend
    that cannot time the steps as they train: TensorFlow's).

    Args:
        requested: `--steps-per-execution` (None: not given).
        own: the model's own `steps_per_execution` (what `compile` was given).
        measure: a step's times on this setup, asked only where more than one step an
            execution could be chosen (None: not measured).
        epoch_steps: the steps of one pass over the input (None: not known).
        batch_bytes: one batch's bytes on a device.
        device_bytes: a device's memory (None: not known).
        batch_hooks: the user's callbacks that read every batch (their class names).
        divides: what K must divide (a loop that runs whole executions of K on an endless
            input, Keras's own, would read past the steps the call names; None: nothing).
        confirm: seconds a step when K steps run as one dispatch, measured (`_confirmed`).
    """
    found = decided(requested, own, epoch_steps, batch_hooks)
    if found is not None:
        return found
    measured = measure()
    if measured is None:
        return Steps(1, "one step an execution: no step was measured on this device")
    steps = from_times(measured, epoch_steps, batch_bytes, device_bytes, divides)
    if steps.k <= 1:
        return steps
    host = measured.host + KERAS_LOOP_SECONDS
    grouped = confirm(steps.k) if confirm is not None else None
    if grouped is None:
        return steps
    return confirmed(steps, grouped, max(measured.device, 1e-7) + host,
                     KERAS_LOOP_SECONDS / steps.k)


def decided(requested: int | None, own: int, epoch_steps: int | None,
            batch_hooks: list[str]) -> Steps | None:
    """The steps an execution where nothing need be measured (see `chosen`); None where
    they are chosen from a step's times."""
    if requested is not None:
        return Steps(requested, "--steps-per-execution")
    if own > 1:
        return Steps(own, "the model's own steps_per_execution")
    if batch_hooks:
        return Steps(1, f"{', '.join(batch_hooks)} reads every batch, so every step is its "
                        "own execution")
    if epoch_steps is not None and epoch_steps // EXECUTIONS <= 1:
        return Steps(1, f"the epoch's {epoch_steps} steps are too few to group")
    return None


@dataclass(frozen=True)
class AsTheyRun:
    """K chosen from the call's first steps as they train (a backend that times them:
    `Backend.times_steps_as_they_run`), with the same arithmetic as `chosen`.

    Attributes:
        epoch_steps / device_bytes / replicas / divides: as for `from_times` (one batch's
            bytes come with the times: the backend reads them off the batch).
        kind: the call's own steps, the ones timed ("train", "test", "predict").
        unmeasured: the steps of a call that ended before a step was timed.
        k: the first execution's steps (one: the steps to time).
        call_steps: the call's steps of its kind, every epoch's (None: not known).
        compile_competes: a group's compile beside the steps takes the steps' own cores
            (devices on the host's CPU, a simulated TPU's): it costs its seconds. On a TPU
            or GPU the host's spare cores compile it; it need only be ready in time.
    """

    epoch_steps: int | None
    device_bytes: float | None
    replicas: int
    divides: int | None = None
    kind: str = "train"
    k: int = 1
    unmeasured: Steps = Steps(1, "one step an execution: the call ended before a step was "
                                 "timed")
    call_steps: int | None = None
    compile_competes: bool = True

    def choose(self, device: float, host: float, bound: tuple[int, str] | None, timed: int,
               batch_bytes: int, remaining: int | None = None,
               compile_seconds: Callable[[int], float | None] | None = None) -> Steps:
        """K from `timed` steps' medians: a step's device seconds, the host's an execution
        (Keras's loop and the callbacks measured with it), the backend's bound on a group;
        kept above one where it pays for its compile (`paid_for`: the call's `remaining`
        steps, `compile_seconds(K)`)."""
        times = StepTimes(device, max(host - KERAS_LOOP_SECONDS, 0.0), bound)
        found = from_times(times, self.epoch_steps, batch_bytes // max(self.replicas, 1),
                           self.device_bytes, self.divides, steady=True)
        found = Steps(found.k, found.why.replace("auto: ", f"auto, from the first {timed} "
                                                          f"step{'s' * (timed != 1)}: ", 1))
        if found.k <= 1 or remaining is None or compile_seconds is None:
            return found
        return paid_for(found, device, host, remaining, compile_seconds(found.k),
                        self.compile_competes)

    @staticmethod
    def confirm(steps: Steps, grouped: float, alone: float) -> Steps:
        return confirmed(steps, grouped, alone)


def paid_for(steps: Steps, device: float, host: float, remaining: int,
             compile_seconds: float | None, competes: bool = True) -> Steps:
    """`steps`, where its group saves more than its compile costs: once compiled (the
    call's steps go on one a dispatch meanwhile, `device + host` seconds each), each of
    the `remaining` steps saves the host's work of the executions the group merges,
    `host` × (1 − 1/K); else one step a dispatch, said. The compile costs its seconds
    where it `competes` with the steps for their cores (devices on the host's CPU); else
    nothing, where it is ready before the call's steps end (a call waits for a compile
    still running at its end). `compile_seconds`: None where not known (then `steps` as
    chosen)."""
    if steps.k <= 1 or compile_seconds is None or compile_seconds <= 0:
        return steps
    grouped = max(remaining - compile_seconds / max(device + host, 1e-9), 0.0)
    saved = grouped * host * (1 - 1 / steps.k)
    if competes and saved > compile_seconds or not competes and grouped > 0:
        return steps
    if not competes:
        return Steps(1, f"{steps.why}, but its program's compile (about "
                        f"{compile_seconds:.2g} s) would not be ready before the call's "
                        f"{remaining} steps still to run end: one step a dispatch")
    return Steps(1, f"{steps.why}, but its program's compile (about {compile_seconds:.2g} s) "
                    f"would save less over the call's {remaining} steps still to run (about "
                    f"{saved:.2g} s of the host's work): one step a dispatch")


def from_times(measured: StepTimes, epoch_steps: int | None, batch_bytes: int,
               device_bytes: float | None, divides: int | None = None,
               steady: bool = False) -> Steps:
    """K from a step's times: the smallest for which the host's work an execution is at
    most `HOST_SHARE` of its device time, bounded (see the module's docstring). `steady`:
    that K rounded up to a power of two before it is bounded, so that timings a few
    percent apart (a first step's, timed beside other work) choose the same K, and a later
    cell's group is the program an earlier one compiled (JAX's caches key it by K)."""
    host = measured.host + KERAS_LOOP_SECONDS
    device = max(measured.device, 1e-7)
    wanted = math.ceil(host * (1 - HOST_SHARE) / HOST_SHARE / device)
    if steady and wanted > 1:
        wanted = 2 ** math.ceil(math.log2(wanted))
    said = (f"a step takes {_ms(device)} on the device and the host {_ms(host)} an "
            f"execution")
    if wanted <= 1:
        return Steps(1, f"auto: {said}, so one step a dispatch keeps the host under "
                        f"{HOST_SHARE:.0%}")
    bounds = [(MOST, "the cap")]
    if measured.most is not None:
        bounds.append(measured.most)
    if epoch_steps:  # several executions an epoch: the bar moves, a steady rate is measured
        bounds.append((max(1, epoch_steps // EXECUTIONS),
                       f"{EXECUTIONS} executions in the epoch's {epoch_steps} steps"))
    memory = device_bytes * MEMORY_SHARE if device_bytes else CPU_BATCHES_BYTES
    if batch_bytes > 0:
        bounds.append((max(1, int(memory // batch_bytes)), "memory for the batches"))
    most, bound = min(bounds)
    k = _fitting(min(wanted, most), epoch_steps)
    if divides and divides % k:
        k = max(d for d in range(1, k + 1) if divides % d == 0)
        most, bound = k, f"the call's {divides} steps a pass, which K divides"
    if k <= 1:
        return Steps(1, f"auto: {said}; one step a dispatch, bounded by {bound}")
    if most < wanted:
        return Steps(k, f"auto: {said}; {k} steps a dispatch, bounded by {bound}")
    return Steps(k, f"auto: {said}; {k} steps a dispatch keep the host under {HOST_SHARE:.0%}")


def confirmed(steps: Steps, grouped: float, alone: float, overhead: float = 0.0) -> Steps:
    """`steps`, where its group, measured, runs a step (`grouped` seconds, and `overhead`:
    host work a step not in them) faster than one step a dispatch does (`alone`: a step's
    device time and the host's work an execution); else one step a dispatch. A group's
    program is compiled and scheduled as a whole, and is not always as fast a step (an
    LSTM's on the CPU: docs/benchmarks.md)."""
    if grouped + overhead < alone:
        return steps
    return Steps(1, f"{steps.why}, but that group measured {_ms(grouped)} a step against "
                    f"{_ms(alone)} one a dispatch: one step a dispatch")


def _fitting(k: int, epoch_steps: int | None) -> int:
    """`k`, or the largest divisor of the epoch's steps not below half of it (every
    execution then runs the same program; the last, shorter one compiles its own)."""
    if not epoch_steps or epoch_steps % k == 0:
        return k
    for divisor in range(k, max(k // 2, 2) - 1, -1):
        if epoch_steps % divisor == 0:
            return divisor
    return k


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
