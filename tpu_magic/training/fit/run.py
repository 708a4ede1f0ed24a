"""A planned `fit` run: Keras's own `fit` on the built inputs with tpu_magic's callbacks
(`FitHooks`), ended at a batch boundary by Ctrl-C, the panel's Stop or a failed checkpoint,
and its frozen `FitOutcome` (timing, parity, utilization, compiles, checkpoints)."""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

from tpu_magic.core import arrays
from tpu_magic.core.errors import CheckpointError
from tpu_magic.core.session import Connection
from tpu_magic.training import routing
from tpu_magic.training.fit import utilization
from tpu_magic.training.fit.agreement import ReplicasAgree
from tpu_magic.training.fit.plan import FitPlan
from tpu_magic.training.fit.progress import FitProgress, FitTiming
from tpu_magic.training.fit.steps_for import first_batch, steps_for
from tpu_magic.training.fit.stopping import StopOnEvent, stop_on_interrupt
from tpu_magic.training.inputs.build import Built, given_batch_size
from tpu_magic.training.report import FitOutcome


@dataclass(frozen=True)
class FitHooks:
    """What tpu_magic adds to a `fit`.

    Attributes:
        progress: the bar and the timing (`FitProgress`).
        saver: the checkpoint callback (`--checkpoint`), or None.
        check: the first-step parity check (`parity.callback.FirstStep`), or None.
        stop_event: the panel's Stop (set: stop at the next batch), or None.
        quiet: Keras's own progress output off (tpu_magic's bar shows instead).
        whole: runs the fit with every replica computing the whole batch from its start
            (`parity.callback.WholeBatchRun`), or None.
    """

    progress: FitProgress
    saver: Any = None
    check: Any = None
    stop_event: threading.Event | None = None
    quiet: bool = True
    whole: Any = None


@dataclass(frozen=True)
class Measures:
    """What a fit's utilization is measured against: the FLOPs of a sample and where the
    count comes from (None: unknown), `--check`'s measured TFLOP/s, and a batch's input
    seconds measured on earlier fits of the same pipelines (by `Built.measurable_key`)."""

    flops: tuple[float, str] | None = None
    measured_tflops: float | None = None
    inputs_known: Mapping[str, float] | None = None


def ready(plan: FitPlan, built: Built, requested: int | None) -> FitPlan:
    """The plan once its inputs are built: a dataset's batch told (`FitPlan.told`), and the
    steps an execution chosen (`steps_for`; `requested`: `--steps-per-execution`, None for
    auto)."""
    plan = replace(plan.told(built.batch), first=functools.cache(lambda: first_batch(built)))
    return replace(plan, steps=steps_for(plan.connection, plan.model, built, requested,
                                         "train", plan.call.get("callbacks"), plan.first))


def run_fit(plan: FitPlan, built: Built, hooks: FitHooks, measures: Measures) -> FitOutcome:
    """Runs the fit, `plan.steps.k` steps an execution. Its outcome says whether Ctrl-C
    (`ctrl_c`) or a failed checkpoint (`failure`, for the caller to raise once it has
    recorded the outcome) ended it."""
    model, connection = plan.model, plan.connection
    call = dict(built.call, callbacks=callbacks(built.call.get("callbacks"), hooks, connection))
    if hooks.quiet:
        call["verbose"] = 0
    compiled_before = connection.backend.compile_counts()
    try:
        with connection.backend.grouped_steps(model, plan.steps, built.own,
                                              plan.placement.form) as pace:
            history, ctrl_c, failure = _keras_fit(model, call, plan.named, hooks.progress,
                                                  connection.strategy)
    finally:  # Keras's `on_train_end` does not run where a fit fails or is interrupted
        for hook in (hooks.check, hooks.whole):
            if hook is not None:
                hook.ended()
    stopped = hooks.stop_event is not None and hooks.stop_event.is_set()
    timing = hooks.progress.timing
    used = utilization.of_fit(
        connection, measures.flops, timing.samples_per_second,
        timing.steady_seconds / timing.steady_steps if timing.steady_steps else None,
        built.measurable, measures.measured_tflops, key=built.measurable_key,
        known=measures.inputs_known)
    interrupted = ctrl_c or stopped or failure is not None
    try:
        return FitOutcome.of(
            plan.batch_run(given_batch_size(built.call["x"])), timing, history, interrupted,
            parity=hooks.check.outcome if hooks.check is not None else None,
            utilization=used,
            xla_compile=(connection.backend.compile_counts() - compiled_before
                         if compiled_before is not None else None),
            checkpoints=tuple(str(p) for p in hooks.saver.written) if hooks.saver else (),
            resumed_from=str(plan.resume_from.path) if plan.resume_from is not None else None,
            ctrl_c=ctrl_c, failure=failure, execution=pace.result())
    except Exception as exc:  # noqa: BLE001 - the outcome's figures add notes, never an error
        return FitOutcome.bare(history, interrupted, ctrl_c, failure,
                               f"the fit's figures were left out of the report "
                               f"({type(exc).__name__}: {exc})")


def progress_for(built: Built, given: Any, flops_per_sample: float | None, bar: Any,
                 view: Any) -> FitProgress:
    """The fit's bar and live view (`bar` None: none), measuring into a new `FitTiming`;
    `given`: the user's x (token ids are counted from it, or from the first batch read)."""
    first = built.first
    timing = FitTiming(global_batch=built.batch, flops_per_sample=flops_per_sample,
                       tokens_per_sample=utilization.tokens_per_sample(given))
    return FitProgress(
        timing, bar=bar, view=view, batch_of=lambda: given_batch_size(built.call["x"]),
        tokens_of=None if arrays.is_array_input(given)
        else lambda: utilization.first_batch_tokens(first))


def notes_of(hooks: FitHooks, checkpoints: Any) -> list[tuple[str, str]]:
    """What the parity check and the checkpoints of a fit tell the user: (text, prefix)."""
    found = []
    check = hooks.check
    warning = check.outcome.warning() if check is not None and check.outcome else None
    if warning:
        found.append((warning, "warning: "))
    note = check.outcome.note() if check is not None and check.outcome else None
    if note:
        found.append((note, "note: "))
    if hooks.saver is not None:
        warnings_, notes = checkpoints.outcome(hooks.saver)
        found += [(text, "warning: ") for text in warnings_]
        found += [(text, "note: ") for text in notes]
    return found


def callbacks(given: Any, hooks: FitHooks, connection: Connection) -> list:
    """A `fit`'s callbacks: the checkpoint saver first (every other callback sees restored
    weights), the parity check (before any callback of the user's touches the weights or
    reads a step's logs, which a whole-batch rerun replaces), the whole-batch run, the
    user's, the bar, the replicas' agreement, the panel's Stop."""
    found = ([hooks.saver] if hooks.saver is not None else []) + \
        ([hooks.check] if hooks.check is not None else []) + \
        ([hooks.whole] if hooks.whole is not None else []) + list(given or []) + \
        [hooks.progress]
    if connection.replicas > 1:  # one set of BatchNorm statistics, as its copy has
        found.append(ReplicasAgree(connection.backend))
    if hooks.stop_event is not None:
        found.append(StopOnEvent(hooks.stop_event))
    return found


def interrupted_line(steps: int, ctrl_c: bool) -> str:
    return (f"Interrupted after {steps} steps: the model keeps the weights learned so far"
            + (", and the rest of the cell does not run." if ctrl_c else "."))


@contextlib.contextmanager
def _default_shuffle_unsaid(default: bool) -> Iterator[None]:
    """Keras's "`shuffle=True` was passed, but will be ignored" about a dataset, left out
    where the user passed no `shuffle` (Keras's default; a KerasHub task makes a dataset of
    the user's arrays itself): noise the user did not cause. Said where they passed it."""
    with warnings.catch_warnings():
        if default:
            warnings.filterwarnings("ignore", message=r"`shuffle=True` was passed, but will be "
                                    "ignored", category=UserWarning)
        yield


def _keras_fit(model: Any, call: dict, named: frozenset, progress: FitProgress, strategy: Any
               ) -> tuple[Any, bool, CheckpointError | None]:
    """Keras's own `fit` under `strategy` (the placement's, settled for this fit), with
    Ctrl-C and a failed checkpoint ending it at a batch boundary.

    Returns:
        (its history, whether Ctrl-C ended it, the checkpoint error that did).
    """
    interrupted, failure = False, None
    with stop_on_interrupt(model) as stop, strategy.scope(), \
            _default_shuffle_unsaid("shuffle" not in named):
        try:
            history = routing.keras_method("fit")(model, **call)
        except KeyboardInterrupt:
            interrupted, history = True, getattr(model, "history", None)
        except CheckpointError as exc:  # e.g. a full disk: stop, keep what was learned
            failure, history = exc, getattr(model, "history", None)
        finally:
            progress.close(interrupted=interrupted or stop.requested)
    return history, interrupted or stop.requested, failure
