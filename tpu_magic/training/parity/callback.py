"""The first-step parity check as a Keras callback: the state before a fit's first step
copied, and after its first execution the same steps run on one device and compared
(`compare`). Where the split steps differ, the same steps run again from the copied state
with every replica computing the whole batch; where that agrees with one device, the fit
goes on so (`WholeBatchRun` runs a later fit of that setup so from its start).

Where nothing would be run again (no `whole`: on JAX a step sees the global batch) and the
one-device step, compiled beside, is not ready when the first execution ends, the state
after it is kept and the comparison waits for that compile at a later batch (at the
latest when the fit ends) while the fit trains on: the compile leaves the critical path.
The memory plan compiles the distributed step before the fit, so its first step is quick,
and a check that waited for its own compile there added that compile to the cell. Where
that compile is done when the first step begins (a first execution of one step), the
one-device step runs then, from the model's own state (`now`): it needs no copy of the
state on its device, which the run after the step starts from."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import keras
import numpy as np

from tpu_magic.core.arrays import batch_shapes
from tpu_magic.core.steps import StepState, Update
from tpu_magic.training.parity.compare import (AGREED, Parity, Skipped, compare,
                                               compare_inference, real_rows)
from tpu_magic.training.parity.setup import comparison_setup


@dataclass(frozen=True)
class _FirstExecution:
    """The first execution as it ended, kept to compare: its steps, its batches as fed (each
    with whether it was padded), its setup's key, the state after it, its logs over the
    whole batch (`ours`) and Keras's own `logs` (a whole-batch run writes its logs there)."""

    steps: int
    fed: list
    setup: str
    after: StepState
    ours: dict
    logs: Any


class FirstStep(keras.callbacks.Callback):
    """Copies the state before a fit's first step, and after its first execution (K steps)
    compares it with the same steps on one device (see the module's docstring).

    Args:
        state: reads the model's `StepState` (the backend's `step_state`).
        step_logs: the metrics over the whole batch after a step, from the model and a
            callback's logs (the backend's `step_logs`).
        first_batches: the first `k` batches of the epoch as fed (None: cannot be known).
        reference: runs `k` batches on one device from a `StepState`, returning (its logs,
            its update's sizes, `Update`): the backend's `one_device_steps`.
        tolerance: the relative difference allowed.
        likely: names a cause (see `likely_cause`): (loss differs, update ratio, padded).
        random_draws: where the replicas would draw random numbers one device does not
            (Dropout on TensorFlow replicas): the training step cannot be compared, so the
            first batch is compared in inference mode (`inference`), or the check is skipped,
            saying so.
        inference: (model, the first batch as fed, its real rows) -> (the distributed logs,
            one device's) in inference mode, None where it cannot tell (the backend's
            `distributed_inference` and `one_device_inference`).
        where: the devices the model trains on, for `setup_key`.
        agreed: setups compared earlier in this notebook that agreed: not compared again.
        setup_before: the `setup_key` the first execution will have, told before the fit
            from its batches' shapes (`setup_before`; None: not known before the fit reads).
        whole: makes the means to run the fit with every replica computing the whole batch
            (the backend's `whole_batch`, or None where it cannot), tried where the split
            steps differ; None: not tried.
        ahead: (model, a batch of the first execution) makes the one-device steps ready
            while the fit goes on (the backend's `one_device_ahead`: where it was started
            before the memory plan, found again), returning whether they are ready now (a
            callable; None: ready when run); None: nothing ahead.
        first_steps: the first execution's steps.
        first_fed: the fit's first batch as fed, where it can be read before Keras reads
            it (`FitPlan.first`; None: not): `ahead`'s shapes where the input has fed
            nothing yet when the first step begins (a user's dataset, read by Keras after
            the hook), so its one-device step compiles beside the first step there too.
        now: (model, the first batch's real rows) runs `reference`'s step of one batch
            now, before the first step, from the model's own state (the backend's
            `one_device_update`), or returns None where it cannot without waiting; None:
            never (the step runs after the first execution, from the copied state).

    After fit, `outcome` is a `Parity` or `Skipped` (None: the first step never ended).
    Where the outcome is known before the fit (a setup agreed earlier, a first batch that
    cannot be read again, random draws with nothing to compare in inference mode) it is
    set at once, and the callback does nothing.

    Not async-safe otherwise (Keras then runs every batch hook of the fit it checks on the
    main thread): its hook after the first execution reads the model's state and sets
    Keras's distribution aside for the one-device step, which must not overlap what Keras
    does next on the main thread (the next step, or at an epoch of one execution, the
    state's sync and the validation pass). It checks a cell's first fit on several
    replicas only. Settled before the fit, it is async-safe: it leaves Keras's worker
    threads to a fit that compares nothing (on JAX, a cell run again on agreed setups).
    """

    async_safe = False

    def __init__(self, state: Callable[[Any], StepState],
                 first_batches: Callable[[int], list | None] | None,
                 reference: Callable[[Any, StepState, list], tuple[dict, StepState]],
                 tolerance: float, likely: Callable[..., str],
                 random_draws: str | None = None, where: str = "",
                 agreed: frozenset = frozenset(),
                 inference: Callable[[Any, Any, Any], tuple[dict, dict] | None] | None = None,
                 step_logs: Callable[[Any, dict], dict] = lambda model, logs: dict(logs or {}),
                 setup_before: str | None = None,
                 whole: Callable[[], Any] | None = None,
                 ahead: Callable[[Any, Any], Callable[[], bool] | None] | None = None,
                 first_steps: int = 1, first_fed: Callable[[], Any] | None = None,
                 now: Callable[[Any, Any], tuple[dict, Update] | None] | None = None):
        super().__init__()
        self._ahead, self._first_steps, self._first_fed = ahead, first_steps, first_fed
        self._now, self._early = now, None  # the one-device step run before the first
        self._inference, self._step_logs = inference, step_logs
        self._whole, self._kept = whole, None  # the whole-batch run, once kept
        self._state, self._first_batches, self._reference = state, first_batches, reference
        self._tolerance, self._likely, self._random_draws = tolerance, likely, random_draws
        self._where, self._agreed = where, agreed
        self._before: StepState | None = None
        self._done = False
        self._ready: Callable[[], bool] | None = None  # the one-device steps compiled?
        self._pending: _FirstExecution | None = None  # kept until they have
        self._held = 0.0  # the seconds the check held the fit
        self.outcome: Parity | Skipped | None = None
        if random_draws and inference is None:
            self._skip(random_draws)
        elif first_batches is None:
            self._skip("its input's first batch cannot be read again without changing what "
                       "Keras reads")
        elif setup_before is not None and setup_before in agreed:
            self._skip(AGREED, setup_before)
        if self._done:
            self.async_safe = True  # nothing to do: Keras may run the hooks where it likes

    def on_train_batch_begin(self, batch, logs=None):
        if self._done or self._before is not None:
            return
        if self._random_draws:  # compared after the step, in inference mode
            self._before = _INFERENCE
            return
        start = time.perf_counter()
        try:
            self._before = self._state(self.model)
        except Exception as exc:  # noqa: BLE001 - the check must never break the cell
            self._skip(_could_not("copy the state before the step", exc))
            return
        self._held = time.perf_counter() - start
        self._make_ready()
        self._run_now()

    def _make_ready(self) -> None:
        """The one-device steps readied while the first step compiles (`ahead`); where that
        fails they are made when compared, as without it."""
        if self._ahead is None:
            return
        start = time.perf_counter()
        with contextlib.suppress(Exception):
            batches = self._first_batches(self._first_steps) or []
            if len(batches) < self._first_steps and self._first_fed is not None:
                first = self._first_fed()  # the shapes, before the input has fed it
                batches = [first] if first is not None else []
            if batches:  # every batch of an execution has the first's shapes
                self._ready = self._ahead(self.model, real_rows(batches[0])[0])
        self._held += time.perf_counter() - start

    def _run_now(self) -> None:
        """Where the first execution is one step and its one-device step is compiled, that
        step run now from the model's own state (`now`); kept with its rows' shapes, to
        compare once the first step has run (with the first execution's, where they match). Where it cannot, it runs after, as without."""
        if self._now is None or self._first_steps != 1 or self._ready is None or \
                not self._ready():
            return
        start = time.perf_counter()
        with contextlib.suppress(Exception):
            batches = self._first_batches(1)
            if batches:
                real, padded = real_rows(batches[0])
                if not (padded and _draws_random_numbers(self.model)):  # skipped after
                    found = self._now(self.model, real)
                    if found is not None:
                        self._early = (batch_shapes(real), found)
        self._held += time.perf_counter() - start

    def _compiled(self) -> bool:
        """Whether the one-device steps can run without waiting for their compile."""
        return self._ready is None or self._ready()

    def on_train_batch_end(self, batch, logs=None):
        if self._pending is not None:
            if self._compiled():
                self._finish()  # says, never raises
            return
        if self._done or self._before is None:
            return
        self._done = True
        try:
            if self._before is _INFERENCE:
                self._compare_inference()
            else:
                self._compare(batch, logs)
        except Exception as exc:  # noqa: BLE001 - the check must never break the cell
            self._skip(_could_not("compare the first step", exc))

    def _compare(self, batch: int, logs: dict | None) -> None:
        """The first execution's steps against the same steps on one device: now, or where
        the one-device steps are still compiling and nothing would be run again, once they
        are (`_finish`, at a later batch or the fit's end)."""
        start = time.perf_counter()
        steps = batch + 1
        batches = self._first_batches(steps)
        if not batches or len(batches) < steps:
            self._skip("its first batches were not kept")
            return
        setup = comparison_setup(self.model, [batch_shapes(b) for b in batches], self._where,
                                 inference=False)
        if setup in self._agreed:
            self._skip(AGREED, setup)
            return
        fed = [real_rows(b) for b in batches]
        if any(padded for _, padded in fed) and self._random_draws is None and \
                _draws_random_numbers(self.model):
            self._skip("its first batch is padded and it draws random numbers (Dropout), "
                       "which a batch of another size draws differently")
            return
        after = self._state(self.model)
        if [len(g) for g in after.groups[:3]] != [len(g) for g in self._before.groups[:3]]:
            self._skip("it was built inside its first step, so there was no state before it "
                       "to start one device from")
            return
        self._held += time.perf_counter() - start
        self._pending = _FirstExecution(steps, fed, setup, after,
                                        _pythonic(self._step_logs(self.model, logs)), logs)
        if self._whole is not None or self._compiled():
            self._finish()

    def _finish(self) -> None:
        """The kept first execution compared with the same steps on one device (their
        compile waited for, where it goes on)."""
        kept, self._pending, start = self._pending, None, time.perf_counter()
        early, self._early = self._early, None
        try:
            if early is not None and [early[0]] == [batch_shapes(b) for b, _ in kept.fed]:
                their_logs, theirs = early[1]  # run before the first step
            else:
                their_logs, theirs = self._reference(self.model, self._before,
                                                     [b for b, _ in kept.fed])
        except Exception as exc:  # noqa: BLE001 - the check must never break the cell
            text = str(exc).strip().splitlines()
            self._skip(f"the one-device step could not run ({type(exc).__name__}: "
                       f"{text[0] if text else ''})")
            return
        try:
            parity = compare(self._before, kept.after, theirs, kept.ours, _pythonic(their_logs),
                             kept.steps, self._tolerance,
                             self._held + time.perf_counter() - start, self._likely,
                             kept.setup, any(padded for _, padded in kept.fed))
            if not parity.agrees and self._whole is not None:
                parity = self._run_whole(parity, kept.steps, theirs, _pythonic(their_logs),
                                         kept.logs)
        except Exception as exc:  # noqa: BLE001 - the check must never break the cell
            self._skip(_could_not("compare the first step", exc))
            return
        self.outcome = parity
        self._before = None

    def _run_whole(self, parity: Parity, steps: int, theirs: Update, their_logs: dict,
                   logs: dict | None) -> Parity:
        """The split steps differed: the same steps again from the state before them, every
        replica computing the whole batch. Where that agrees with one device, the fit goes
        on so (and the callbacks after this one see its logs); otherwise the split steps'
        state is put back."""
        start, whole = time.perf_counter(), None
        try:
            whole = self._whole()
            if whole is None:
                return parity
            ours, after = whole.rerun(self._before, steps)
            compared = compare(self._before, after, theirs, _pythonic(ours), their_logs, steps,
                               self._tolerance, time.perf_counter() - start, self._likely,
                               parity.setup)
        except Exception:  # noqa: BLE001 - the check must never break the cell
            if whole is not None:
                with contextlib.suppress(Exception):
                    whole.undo()
            return parity
        if not compared.agrees:
            whole.undo()
            return replace(parity, whole=compared)
        whole.keep()
        self._kept = whole
        if isinstance(logs, dict):
            logs.update({key: value for key, value in ours.items() if key in logs})
        return replace(parity, whole=compared)

    def on_train_end(self, logs=None):
        if self._pending is not None:  # the fit's last steps ran while it compiled
            self._finish()
        self.ended()

    def ended(self) -> None:
        """The fit ended (also by an error, which Keras's `on_train_end` misses; Ctrl-C and
        the panel's Stop end it at a batch, through `on_train_end`): a whole-batch run kept
        ends with it; a comparison still waiting for its compile is only possible where the
        fit failed, which has no outcome to compare for: it is dropped, nothing waited for."""
        if self._pending is not None:
            self._pending = None
            self._skip("the fit ended before its one-device step had compiled")
        if self._kept is not None:
            self._kept.close()
            self._kept = None

    def _compare_inference(self) -> None:
        """The first batch's logs in inference mode, from the weights after the step, on the
        replicas and on one device: a loss over the batch or padding shows here too."""
        start = time.perf_counter()
        self._before = None
        batches = self._first_batches(1)
        if not batches:
            self._skip("its first batch was not kept")
            return
        setup = comparison_setup(self.model, [batch_shapes(batches[0])], self._where,
                                 inference=True)
        if setup in self._agreed:
            self._skip(AGREED, setup)
            return
        real, padded = real_rows(batches[0])
        try:
            compared = self._inference(self.model, batches[0], real)
        except Exception as exc:  # noqa: BLE001 - the check must never break the cell
            text = str(exc).strip().splitlines()
            self._skip(f"{self._random_draws}, and its first batch could not be compared in "
                       f"inference mode ({type(exc).__name__}: {text[0] if text else ''})")
            return
        if compared is None:
            self._skip(self._random_draws)
            return
        ours, theirs = compared
        self.outcome = compare_inference(_pythonic(ours), _pythonic(theirs), self._tolerance,
                                         time.perf_counter() - start,
                                         lambda *a, **k: self._likely(*a, inference=True, **k),
                                         setup,
                                         padded)

    def _skip(self, why: str, setup: str = "") -> None:
        self._done, self._before, self._early = True, None, None
        self.outcome = Skipped(why, setup=setup)


_INFERENCE = object()  # `_before` where the first batch is compared in inference mode


class WholeBatchRun(keras.callbacks.Callback):
    """Runs a fit with every replica computing the whole batch from its first step: a
    setup whose split steps differed from one device earlier in the notebook, and whose
    whole-batch steps agreed (`WHOLE_EARLIER`).

    Args:
        whole: the backend's `whole_batch` for the fit.
    """

    def __init__(self, whole: Any):
        super().__init__()
        self._whole, self._started = whole, False

    def on_train_begin(self, logs=None):
        self._whole.start()
        self._started = True

    def on_train_end(self, logs=None):
        self.ended()

    def ended(self) -> None:
        """The fit ended (also by an error or Ctrl-C)."""
        if self._started:
            self._whole.close()
            self._started = False


def _pythonic(logs: Any) -> dict:
    return {key: value for key, value in dict(logs or {}).items()
            if np.ndim(np.asarray(value)) == 0}


def _draws_random_numbers(model: Any) -> bool:
    return any(getattr(layer, "_seed_generators", None) for layer in model._flatten_layers())


def _could_not(what: str, exc: BaseException) -> str:
    """Why the check was skipped, where its own work failed."""
    text = str(exc).strip().splitlines()
    return f"it could not {what} ({type(exc).__name__}: {text[0] if text else ''})"
