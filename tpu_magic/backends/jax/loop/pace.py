"""How many steps a call runs an execution: fixed (the user's K, or one chosen before the
call), or chosen from the call's own first steps as they train.

Chosen so, the call starts one step an execution. Its first execution compiles; the next
few are timed as they run (each waited for: the device's seconds a step, and the host's
seconds an execution around it, Keras's loop and the callbacks included), then K is chosen
from the least device time and the median host time (`choose`, the arithmetic of
`training.fit.steps`). Where K is above 1
the group's program is compiled on a thread of its own (where the host's work it saves over
the call's remaining steps outweighs the compile's estimated seconds: `Grouping`) while the call goes on one step an
execution; once it is compiled, and at a step of the epoch K divides (every later execution
then runs that one program), the call runs K steps an execution. Its second group is timed
too (the first runs a new executable's first call, and is waited for so that the host's
time before the second is the host's alone): where it runs slower a step than a step on its
own with the host's work, the call goes back to one step an execution (`confirm`). No step runs for the choice alone, and the
state is never copied. The times are kept (`memory`, the model's record): a later call of
the same kind and batch type chooses from them at its first step, and runs the programs the
first compiled.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

TIMED = 3  # executions timed (after the first, which compiles) before K is chosen


@dataclass(frozen=True)
class Grouping:
    """What the loop offers for K above one, from the call's first execution: `bound`, the
    backend's on a group (None: none); `batch_bytes`, one batch's; `compile(K)`, the
    group's program compiled ahead (`beside.Beside`); `seconds(K)`, that compile's
    estimated seconds (0: compiled already; None: not known)."""

    bound: Any
    batch_bytes: int
    compile: Callable[[int], Any]
    seconds: Callable[[int], float | None]


class Pace:
    """One call's steps an execution (`limit`), and, once known, why (`steps`, the
    `training.fit.steps.Steps` the report says).

    Args:
        fixed: the steps, where they are known before the call (None: chosen from its
            first steps by `choose`).
        choose: (a step's device seconds, the host's seconds an execution, the backend's
            bound on a group or None, the steps timed, a batch's bytes, the call's steps
            still to run or None, the group's compile seconds by K) → the call's `Steps`.
        confirm: (the chosen `Steps`, a grouped step's seconds, a step's seconds alone) →
            the `Steps` the call keeps.
        unmeasured: the `Steps` of a call that ended before its steps were timed.
        kind: the call's own kind ("train", "test", "predict"): its steps are the ones
            timed.
        memory: times measured by earlier calls, by (kind, batch type), and kept for later
            ones (the model's record).
        total: the call's steps of its own kind (None: not known).
    """

    def __init__(self, fixed: Any = None, choose: Callable[..., Any] | None = None,
                 confirm: Callable[..., Any] | None = None, unmeasured: Any = None,
                 kind: str = "train", memory: dict | None = None,
                 total: int | None = None) -> None:
        self.steps = fixed
        self.k = fixed.k if fixed is not None else 1
        self.choose, self.confirm, self.kind = choose, confirm, kind
        self.unmeasured = unmeasured
        self.memory = {} if memory is None else memory
        self.total, self._done = total, 0  # the call's steps of its kind, and those run
        self._key: Any = None  # (kind, batch type) of the steps timed
        self._times: list[tuple[float, float]] = []  # (device, host) of the timed executions
        self._ended_at: float | None = None  # when the last execution returned
        self._wanted: Any = None  # the chosen Steps, waiting for its group's program
        self._ahead: Any = None  # that program's compile (`beside.Beside`)
        self._alone: float | None = None  # a step's seconds alone, for the confirmation
        self._groups = 0  # groups of K run since the switch, before the confirmation
        self._last_kind: str | None = None  # the kind of the execution that ended last
        self._epoch_start = False  # this execution starts an epoch (its epoch's end before)

    @property
    def choosing(self) -> bool:
        return self.steps is None or self._wanted is not None

    def limit(self, step: int) -> int:
        """The steps of the execution at `step` of its epoch (Keras's epoch iterator asks)."""
        self._epoch_start = step == 0
        wanted = self._wanted
        if wanted is not None and self._ahead is not None and self._ahead.done() and \
                step % wanted.k == 0:
            self.k = wanted.k
        return self.k

    def times(self, kind: str, fresh: bool) -> bool:
        """Whether this execution of `kind` is waited for and timed: not where it compiles a
        program first (`fresh`), nor where the host's time before it was not one execution's
        (an epoch's end, another kind's executions: a validation pass)."""
        if kind != self.kind or fresh or self._epoch_start or self._last_kind != kind:
            return False
        if self._wanted is not None:  # the chosen group's first two executions, once it runs
            if self.k != self._wanted.k:
                return False
            self._groups += 1
            return self._groups <= 2
        return self.steps is None

    def started(self) -> float:
        """An execution starts: the host's seconds since the last ended are its own."""
        now = time.perf_counter()
        return now if self._ended_at is None else self._ended_at

    def ran(self, kind: str, steps: int) -> None:
        """An execution of `steps` steps of `kind` was dispatched (counted before it is
        timed: the steps still to run are the call's after it)."""
        if kind == self.kind:
            self._done += steps

    def ended(self, kind: str) -> None:
        self._ended_at = time.perf_counter()
        self._last_kind = kind

    def recall(self, kind: str, signature: Any, grouping: Grouping) -> None:
        """The first execution of the call's kind ran on a batch of type `signature`: where
        an earlier call timed such steps, K is chosen from those times now."""
        if kind != self.kind or self.steps is not None or self._wanted is not None or \
                self._key is not None:
            return
        self._key = (kind, signature)
        earlier = self.memory.get(self._key)
        if earlier is not None:
            self._decide(*earlier, grouping)

    def timed(self, steps: int, host: float, device: float, grouping: Grouping) -> None:
        """A timed execution of `steps` steps: the host's seconds around it, the device's
        for its steps. Enough of them choose K (`grouping` compiles its program ahead); the
        first group's confirms it or goes back to one step an execution."""
        if self._wanted is not None:  # the chosen group: as fast a step as one alone?
            if self._groups < 2:  # the first: a new executable's first call (waited for, so
                return  # the host's time before the second is the host's alone)
            wanted, self._wanted = self._wanted, None
            self.steps = self.confirm(wanted, (host + device) / steps, self._alone)
            self.k = self.steps.k
            return
        self._times.append((device / steps, host))
        if len(self._times) < TIMED:
            return
        # a step's device time: the least of those timed (what else runs beside an early
        # step, a compile on a thread of its own or a collection, only adds to it, and one
        # such step alone would choose one step a dispatch for the whole call); the
        # host's: their median
        times = (min(t[0] for t in self._times),
                 statistics.median(t[1] for t in self._times), len(self._times))
        if self._key is not None:
            self.memory[self._key] = times
        self._decide(*times, grouping)

    def _decide(self, device_s: float, host_s: float, timed: int, grouping: Grouping) -> None:
        remaining = None if self.total is None else max(self.total - self._done, 0)
        chosen = self.choose(device_s, host_s, grouping.bound, timed, grouping.batch_bytes,
                             remaining, grouping.seconds)
        self._alone = device_s + host_s
        if chosen.k <= 1:
            self.steps = chosen
            return
        self._wanted, self._ahead = chosen, grouping.compile(chosen.k)

    def result(self) -> Any:
        """The steps the call ran, and why (the chosen K where its group never ran: the
        call ended first, said)."""
        if self._wanted is not None:
            return self._wanted.__class__(
                1, f"{self._wanted.why}, but the call ended before its group's program was "
                   "compiled: one step a dispatch")
        return self.steps if self.steps is not None else self.unmeasured
