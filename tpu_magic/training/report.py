"""What a `%%tpu_train` cell did, as data (`TrainReport`) with a text rendering.

The last step of a cell's one way through (request → placement → run → report): while
the cell runs, its `CellRecord` keeps each step's outcome as the step returns it (a `fit`'s
is a frozen `FitOutcome`); when the cell ends, `CellRecord.report()` builds the frozen
`TrainReport` once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class FitOutcome:
    """One `fit`'s outcome: its batch, timing, logs, and what was measured around it.

    Attributes: as `TrainReport`'s of the same names (the report shows the last fit's).
    """

    global_batch: int | None
    per_replica: int | None
    epochs: int
    steps: int
    compile_seconds: float | None
    samples_per_second: float | None
    tokens_per_second: float | None
    epoch_seconds: tuple[float, ...]
    metrics: dict[str, float]
    history: Any
    interrupted: bool
    diverged: str | None
    parity: Any = None
    utilization: Any = None
    xla_compile: Any = None
    checkpoints: tuple[str, ...] = ()
    resumed_from: str | None = None
    execution: Any = None  # steps an execution, and why (`fit.steps.Steps`)
    ctrl_c: bool = False  # Ctrl-C ended it (the rest of the cell does not run)
    failure: Any = None  # the error that ended it early (a failed checkpoint), to raise
    notes: tuple = ()  # (text, prefix) for the cell to say: what was left out, and why

    @classmethod
    def bare(cls, history: Any, interrupted: bool, ctrl_c: bool, failure: Any,
             why: str) -> "FitOutcome":
        """A fit whose figures could not be read: its history and how it ended alone."""
        return cls(None, None, 0, 0, None, None, None, (), {}, history, interrupted, None,
                   ctrl_c=ctrl_c, failure=failure, notes=((why, "note: "),))

    @classmethod
    def of(cls, plan: Any, timing: Any, history: Any, interrupted: bool,
           **measured: Any) -> "FitOutcome":
        """A `fit` ended: its batch (`BatchPlan`), timing (`progress.FitTiming`) and logs;
        `measured`: parity, utilization, xla_compile, checkpoints, resumed_from, ctrl_c,
        failure."""
        return cls(plan.global_batch, plan.per_replica, len(timing.epoch_seconds),
                   timing.steps_done, timing.compile_seconds, timing.samples_per_second,
                   timing.tokens_per_second, tuple(timing.epoch_seconds),
                   dict(timing.last_logs), history, interrupted, timing.diverged_text(),
                   **measured)


@dataclass(frozen=True)
class TrainReport:
    """The outcome of a `%%tpu_train` cell (the last `fit` for timings and metrics).

    Attributes:
        model_name: the namespace name of the model trained last, if known.
        strategy: the strategy's class name; replicas: how many.
        global_batch / per_replica: the batch of the last `fit`.
        epochs / steps: epochs and steps completed by the last `fit`.
        compile_seconds: time to the first step's end (tracing, compiling, first step).
        samples_per_second: steady-state throughput after the first step.
        epoch_seconds: wall time of each epoch.
        metrics: the last `fit`'s final logs.
        evaluations: the results of `evaluate` calls, in order.
        predictions: rows returned by each `predict` call.
        history: the last `fit`'s `keras.callbacks.History`.
        interrupted: whether Ctrl-C (or Stop) ended the last `fit` early.
        diverged: where the last `fit`'s loss first became NaN or infinite, in words.
        fits: how many `fit` calls the cell made.
        rewrapped / notes: what tpu_magic changed or advises.
        checkpoints: the checkpoint files written (--checkpoint), oldest first.
        resumed_from: the checkpoint training continued from (--resume).
        precision: the dtype policy `--precision` put in force, and why.
        sharding: under `--shard model`, the mesh and where the largest variables live.
        memory_plan: the memory plan's line: one device's planned memory, the step's form.
        tokens_per_second: token-id inputs: real tokens in the steady state.
        utilization: the last `fit`'s FLOPs, achieved TFLOP/s against the peaks, and the
            input's share of a step.
        xla_compile: on the JAX backend, the last `fit`'s XLA compilations: programs from
            JAX's persistent cache and programs compiled, and the seconds they took.
        left_out: samples left out of a pass ("fit" per epoch, "validation", "evaluate") for
            a model whose loss cannot skip padding (it gets whole batches of real samples).
        parity: the cell's first `fit`'s first step against the same step on one device
            (`training.parity`).
        seconds: the cell's wall time.
    """

    strategy: str
    replicas: int
    model_name: str | None = None
    global_batch: int | None = None
    per_replica: int | None = None
    epochs: int = 0
    steps: int = 0
    compile_seconds: float | None = None
    samples_per_second: float | None = None
    epoch_seconds: tuple[float, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    evaluations: tuple[dict[str, float], ...] = ()
    predictions: tuple[int, ...] = ()
    history: Any = None
    interrupted: bool = False
    diverged: str | None = None
    fits: int = 0
    rewrapped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    checkpoints: tuple[str, ...] = ()
    resumed_from: str | None = None
    left_out: dict[str, int] = field(default_factory=dict)
    xla_compile: Any = None  # a `compile_cache.CompileCounts`
    precision: str | None = None
    sharding: tuple[str, ...] = ()
    memory_plan: str | None = None
    tokens_per_second: float | None = None
    utilization: Any = None  # a `utilization.Utilization` of the last fit
    parity: Any = None  # the first-step parity check: a `parity.Parity` or `parity.Skipped`
    execution: Any = None  # the last fit's steps an execution, and why (`fit.steps.Steps`)
    seconds: float = 0.0

    def summary(self, notes_said: bool = False) -> str:
        """The report in lines; `notes_said`: the notes as a count, where the cell printed
        them as they came (its output shows the report under them)."""
        lines = [f"tpu_train: {self.strategy}, {self.replicas} replica{'s' * (self.replicas != 1)}"
                 + (f", model `{self.model_name}`" if self.model_name else "")
                 + f", {self.seconds:.1f} s"]
        if self.precision:
            lines.append(f"  precision: {self.precision}")
        lines += [f"  {line}" for line in self.sharding]
        if self.memory_plan:
            lines.append(f"  {self.memory_plan}")
        if self.fits:
            lines.append(f"  batch {self.global_batch} ({self.per_replica} per replica), "
                         f"{self.epochs} epoch{'s' * (self.epochs != 1)}"
                         + (" — interrupted, weights kept" if self.interrupted else ""))
            if self.execution is not None and self.execution.k > 1:
                lines.append(f"  {self.execution.line()}")
            if self.compile_seconds is not None:
                lines.append(f"  first step (tracing, compiling, running it): "
                             f"{self.compile_seconds:.2f} s")
            if self.parity is not None:
                lines.append(f"  {self.parity.line()}")
            xla = self.xla_compile.describe() if self.xla_compile is not None else None
            if xla:  # over the whole fit: validation's and the last batch's programs too
                lines.append(f"  {xla}, over the whole fit")
            if self.samples_per_second:
                lines.append(f"  steady state: {self.samples_per_second:,.0f} samples/s"
                             + (f", {self.tokens_per_second:,.0f} tokens/s (real tokens, "
                                "padding left out)" if self.tokens_per_second else ""))
            if self.utilization is not None:
                lines += [f"  {line}" for line in self.utilization.lines()]
            if self.epoch_seconds:
                per = ", ".join(f"{s:.2f}" for s in self.epoch_seconds[-5:])
                lines.append(f"  time per epoch (s): {per}")
            if self.metrics:
                lines.append("  final: " + _fmt(self.metrics))
            if self.diverged:
                lines.append(f"  warning: {self.diverged}")
        if self.resumed_from:
            lines.append(f"  resumed from {self.resumed_from}")
        if self.checkpoints:
            lines.append(f"  checkpoints: {len(self.checkpoints)} written, the newest "
                         f"{self.checkpoints[-1]}")
        for result in self.evaluations:
            lines.append("  evaluate: " + _fmt(result))
        for rows in self.predictions:
            lines.append(f"  predict: {rows} rows")
        for what, left in self.left_out.items():
            lines.append(f"  {what}: {left} sample{'s' * (left != 1)} left out (whole batches "
                         "of real samples only, see the note)")
        if notes_said and self.notes:
            lines.append(f"  notes: {len(self.notes)}, shown above")
        else:
            lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.summary(notes_said=True))  # under the cell's output, which said them


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in values.items())


@dataclass
class CellRecord:
    """What a running cell has done so far, kept by the cell alone (its own thread) and
    turned into the frozen `TrainReport` once, when the cell ends (`report`)."""

    strategy: str
    replicas: int
    model_name: str | None = None
    fits: list[FitOutcome] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)
    predictions: list[int] = field(default_factory=list)
    rewrapped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    left_out: dict[str, int] = field(default_factory=dict)
    precision: str | None = None
    sharding: tuple[str, ...] = ()
    memory_plan: str | None = None
    seconds: float = 0.0

    def evaluated(self, numbers: dict[str, float], left_out: Mapping[str, int]) -> None:
        """An `evaluate` ended: its numbers, and the samples it left out (its own count
        replaces an earlier evaluate's)."""
        self.evaluations.append(numbers)
        self.left_out.pop("evaluate", None)
        self.left_out.update(left_out)

    def report(self) -> TrainReport:
        """The frozen report: the cell's own record, the last fit's outcome, every fit's
        checkpoints, and where the first resumed."""
        last = self.fits[-1] if self.fits else None
        of_fit = {} if last is None else {
            f.name: getattr(last, f.name) for f in fields(FitOutcome)
            if f.name not in ("checkpoints", "resumed_from", "ctrl_c", "failure", "notes")}
        if last is not None and last.parity is None:  # the first fit's check stays reported
            of_fit["parity"] = next((f.parity for f in self.fits if f.parity is not None), None)
        return TrainReport(
            strategy=self.strategy, replicas=self.replicas, model_name=self.model_name,
            evaluations=tuple(self.evaluations), predictions=tuple(self.predictions),
            fits=len(self.fits), rewrapped=tuple(self.rewrapped), notes=tuple(self.notes),
            checkpoints=tuple(p for f in self.fits for p in f.checkpoints),
            resumed_from=next((f.resumed_from for f in self.fits if f.resumed_from), None),
            left_out=dict(self.left_out), precision=self.precision, sharding=self.sharding,
            memory_plan=self.memory_plan, seconds=self.seconds,
            **{**of_fit, "history": _without_model(of_fit.get("history"))})


def _without_model(history: Any) -> Any:
    """A fit's `History` as the report keeps it: its logs and epochs, not its model.
    IPython keeps a cell's returned report (`Out`, `_`), and a `History` refers to its
    model: a cell run again would hold the old model's device memory beside the new one,
    where plain Keras lets it go when `model` is assigned again. The user's own `History`
    (what `fit` returned in the cell) keeps its model, as in plain Keras."""
    if history is None or getattr(history, "_model", None) is None:
        return history
    kept = copy.copy(history)
    kept._model = None
    return kept
