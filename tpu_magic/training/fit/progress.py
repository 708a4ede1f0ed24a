"""Live training progress and timing, as one Keras callback.

Like Keras's own ProgbarLogger, the bar's position is absolute (`batch + 1`):
with `steps_per_execution=K` Keras calls the batch hook only every K batches,
and counting one step per call (as tqdm's TqdmCallback does) falls behind.
Drawing is throttled, so the bar costs almost nothing per step.

The callback is async-safe: where the backend allows it (JAX), Keras runs the batch hooks
of async-safe callbacks on worker threads, so the host queues the next step while one
step's logs are read, as a plain `fit` with `verbose=0` does. A hook that reads logs waits
for its step, so a callback that is not async-safe makes every step wait for the one
before (the device idles while the host dispatches). The hooks may end out of order: they
take a lock, and a step older than one already counted only adds a NaN it saw.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import keras

COMPILING = "compiling…"


@dataclass
class FitTiming:
    """What one `fit` took: filled in by `FitProgress`."""

    global_batch: int
    steps_per_epoch: int = 0
    compile_seconds: float | None = None
    epoch_seconds: list[float] = field(default_factory=list)
    steps_done: int = 0
    steady_steps: int = 0
    steady_seconds: float = 0.0
    last_logs: dict[str, float] = field(default_factory=dict)
    flops_per_sample: float | None = None  # for TFLOP/s on the bar, where known
    diverged: tuple[int, int] | None = None  # (epoch, step), 1-based: the loss first NaN/Inf
    tokens_per_sample: float | None = None  # token-id inputs: real (non-padding) tokens a row

    @property
    def tokens_per_second(self) -> float | None:
        """Real tokens per second in the steady state, for token-id inputs."""
        rate = self.samples_per_second
        return rate * self.tokens_per_sample if rate and self.tokens_per_sample else None

    def diverged_text(self) -> str | None:
        """Where the loss stopped being finite, in words (None: it stayed finite)."""
        if self.diverged is None:
            return None
        epoch, step = self.diverged
        return f"the loss became NaN/Inf at epoch {epoch}, step {step}"

    @property
    def samples_per_second(self) -> float | None:
        """Steady-state throughput: the steps after the first hook (which includes compiling)."""
        if self.steady_steps <= 0 or self.steady_seconds <= 0:
            return None
        return self.steady_steps * self.global_batch / self.steady_seconds

    @property
    def tflops(self) -> float | None:
        """Achieved TFLOP/s in the steady state, where the FLOPs of a sample are known."""
        rate = self.samples_per_second
        if not rate or not self.flops_per_sample:
            return None
        return self.flops_per_sample * rate / 1e12


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True  # not a number: nothing to say


def _numbers(logs: dict | None) -> dict[str, float]:
    found = {}
    for key, value in (logs or {}).items():
        try:
            found[key] = float(value)
        except (TypeError, ValueError):
            pass
    return found


def _postfix(logs: dict[str, float], timing: FitTiming) -> dict[str, str]:
    shown = {k: f"{v:.4g}" for k, v in logs.items()}
    if timing.samples_per_second:
        shown["samples/s"] = f"{timing.samples_per_second:,.0f}"
    if timing.tokens_per_second:
        shown["tokens/s"] = f"{timing.tokens_per_second:,.0f}"
    if timing.tflops:
        shown["TFLOP/s"] = f"{timing.tflops:.3g}"
    return shown


class TrainingView(Protocol):
    """What else shows training live (the panel's training area)."""

    def training_begin(self, epochs: int, steps: int) -> None: ...

    def training_step(self, epoch: int, position: int, logs: dict[str, float],
                      samples_per_second: float | None) -> None: ...

    def training_epoch(self, epoch: int, logs: dict[str, float]) -> None: ...

    def training_end(self, interrupted: bool = False) -> None: ...


class FitProgress(keras.callbacks.Callback):
    """Times a `fit` and, when `bar` is given, draws epoch and batch bars (async-safe: see
    the module's docstring).

    Args:
        timing: where the measurements go.
        bar: a tqdm-like class (e.g. `tqdm.auto.tqdm`), or None for no bars.
        min_interval: seconds between two redraws.
        view: also shows the training (same throttle), e.g. the panel.
        batch_of: the global batch, for an input whose batch is known only once Keras
            read it (a user's dataset).
        tokens_of: real tokens a row, for an input whose rows are known only once Keras read
            them (a dataset; KerasHub tasks make one of NumPy inputs); None: not tokens.
    """

    async_safe = True  # Keras (JAX) may run the batch hooks on worker threads

    def __init__(self, timing: FitTiming, bar: Callable[..., Any] | None = None,
                 min_interval: float = 0.2, view: TrainingView | None = None,
                 batch_of: Callable[[], int] | None = None,
                 tokens_of: Callable[[], float | None] | None = None):
        super().__init__()
        self.timing = timing
        self._batch_of, self._tokens_of = batch_of, tokens_of
        self._bar_class = bar
        self._min_interval = min_interval
        self._view = view
        self._view_open = False
        self.epoch_bar = None
        self.batch_bar = None
        self._lock = threading.Lock()

    def on_train_begin(self, logs=None):
        self.timing.steps_per_epoch = self.params.get("steps") or 0
        self._epochs = self.params.get("epochs") or 1
        self._begin = self._last_draw = time.perf_counter()
        self._first_hook: float | None = None
        self._steps_at_first_hook = 0
        self._epoch_steps_before = 0
        if self._bar_class is not None:
            self.epoch_bar = self._bar_class(total=self._epochs, desc="epochs", unit="epoch",
                                             leave=True, dynamic_ncols=True)
            self.batch_bar = self._bar_class(total=self.timing.steps_per_epoch or None,
                                             desc=COMPILING, unit="step", leave=False,
                                             dynamic_ncols=True, mininterval=0)  # throttled here
        if self._view is not None:
            self._view.training_begin(self._epochs, self.timing.steps_per_epoch)
            self._view_open = True

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = time.perf_counter()
        self._epoch_steps_before = self.timing.steps_done
        if self.epoch_bar is not None and self.timing.epoch_seconds:
            self.batch_bar.set_description(f"epoch {epoch + 1}/{self._epochs}", refresh=False)
            self.batch_bar.reset(total=self.timing.steps_per_epoch or None)

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()  # after the step: Keras read its logs before the hook
        with self._lock:
            self._batch_end(batch, logs, now)

    def _batch_end(self, batch, logs, now: float) -> None:
        # Keras reports `step + K - 1` for the last execution of an epoch even when
        # fewer than K steps remained: the true position never passes the epoch's end.
        position = batch + 1
        if self.timing.steps_per_epoch:
            position = min(position, self.timing.steps_per_epoch)
        if not _finite((logs or {}).get("loss", 0.0)) and \
                (self.timing.diverged is None or (self._epoch + 1, position) < self.timing.diverged):
            self.timing.diverged = (self._epoch + 1, position)
            if self.batch_bar is not None:  # said once, and kept on the bar
                self.batch_bar.set_description(
                    f"epoch {self._epoch + 1}/{self._epochs}: loss NaN/Inf since step "
                    f"{position}", refresh=False)
        steps_done = self._epoch_steps_before + position
        if self._first_hook is not None and steps_done <= self.timing.steps_done:
            return  # a step older than one counted already (the hooks ended out of order)
        self.timing.steps_done = steps_done
        if not self.timing.global_batch and self._batch_of is not None:
            self.timing.global_batch = self._batch_of()
        if self.timing.tokens_per_sample is None and self._tokens_of is not None:
            self.timing.tokens_per_sample, self._tokens_of = self._tokens_of(), None
        if self._first_hook is None:
            self._first_hook = now
            self._steps_at_first_hook = self.timing.steps_done
            self.timing.compile_seconds = now - self._begin
        else:
            self.timing.steady_steps = self.timing.steps_done - self._steps_at_first_hook
            self.timing.steady_seconds = now - self._first_hook
        bar = self.batch_bar
        if bar is None and self._view is None:
            return
        last = position == self.timing.steps_per_epoch
        first = self.timing.steady_steps == 0
        if now - self._last_draw < self._min_interval and not last and not first:
            return
        self._last_draw = now
        numbers = _numbers(logs)
        if self._view is not None:
            self._view.training_step(self._epoch, position, numbers, self.timing.samples_per_second)
        if bar is None:
            return
        if bar.desc == COMPILING:
            bar.set_description(f"epoch {self._epoch + 1}/{self._epochs}", refresh=False)
        bar.set_postfix(_postfix(numbers, self.timing), refresh=False)
        bar.update(position - bar.n)

    def on_epoch_end(self, epoch, logs=None):
        self.timing.epoch_seconds.append(time.perf_counter() - self._epoch_start)
        self.timing.last_logs = _numbers(logs)
        if self.epoch_bar is not None:
            if self.timing.diverged is not None:
                self.epoch_bar.set_description(
                    f"epochs (loss NaN/Inf since epoch {self.timing.diverged[0]})", refresh=False)
            self.epoch_bar.set_postfix(_postfix(self.timing.last_logs, self.timing), refresh=False)
            self.epoch_bar.update(1)
        if self._view is not None:
            self._view.training_epoch(epoch, self.timing.last_logs)

    def on_train_end(self, logs=None):
        self.close(interrupted=bool(getattr(self.model, "stop_training", False)))

    def close(self, interrupted: bool = False) -> None:
        """Closes the bars and the view (also after an interruption); safe to call twice."""
        for bar in (self.batch_bar, self.epoch_bar):
            if bar is not None:
                bar.close()
        self.batch_bar = self.epoch_bar = None
        if self._view_open:
            self._view_open = False
            self._view.training_end(interrupted)
