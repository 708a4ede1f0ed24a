"""Keras's train, test and predict functions swapped for the loop's while a call runs
(`grouped`), and what they do an execution: read its batches (`reading`), run them through
the model's programs (`programs`), and, where K is chosen from the call's first steps, time
those steps as they train (`pace`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from tpu_magic.backends.jax import beside
from tpu_magic.backends.jax.loop import epoch_reads
from tpu_magic.backends.jax.loop.pace import Grouping, Pace
from tpu_magic.backends.jax.loop.programs import Programs, programs_of
from tpu_magic.backends.jax.loop.reading import Reader, joined, unstacked
from tpu_magic.core.deps import require_jax
from tpu_magic.core.overrides import overridden
from tpu_magic.core.steps import StepForm


@contextlib.contextmanager
def grouped(model: Any, pace: Pace, sources: dict[str, Any] | None = None,
            form: StepForm | None = None) -> Iterator[Pace]:
    """While a call runs: the model's train, test and predict functions are the loop's, K
    steps an execution as `pace` says (see the package's docstring), its train step in
    `form` (micro-batches, rematerialized blocks: `step_forms`; None: as written).
    `sources`: tpu_magic's own pipelines by role ("train", "test", "predict"), read a group
    at a time where Keras would read a batch (`PaddedBatches.group`). A model Keras runs
    eagerly or without XLA: Keras's own functions, untouched, one step an execution."""
    if model.run_eagerly or not model.jit_compile:
        yield pace
        return
    programs = programs_of(model)
    programs.use(form)
    # several processes read a batch at a time, each its own rows (Keras's iterator)
    one_process = require_jax().process_count() == 1
    calls = Executions(programs, pace, Reader(dict(sources or {}) if one_process else {}))
    with contextlib.ExitStack() as stack:
        stack.enter_context(epoch_reads.counted(pace))
        for kind in ("train", "test", "predict"):
            stack.enter_context(overridden(model, f"make_{kind}_function", calls.maker(kind)))
        saved = (model.train_function, model.test_function, model.predict_function,
                 model.steps_per_execution)
        model.train_function = model.test_function = model.predict_function = None
        try:
            yield pace
        finally:
            calls.reader.finished()
            programs.finished()
            beside.settle(model)
            (model.train_function, model.test_function, model.predict_function,
             model.steps_per_execution) = saved


class Executions:
    """The three functions Keras calls, one an execution, for one call."""

    def __init__(self, programs: Programs, pace: Pace, reader: Reader) -> None:
        self.programs, self.pace, self.reader = programs, pace, reader
        self.model = programs.model

    def maker(self, kind: str) -> Callable[..., Any]:
        function = {"train": self.train, "test": self.test, "predict": self.predict}[kind]

        def make(force: bool = False) -> Any:
            setattr(self.model, f"{kind}_function", function)
            return function

        return make

    def train(self, state: Any, iterator: Any) -> Any:
        return self._run("train", state, iterator)

    def test(self, state: Any, iterator: Any) -> Any:
        return self._run("test", state, iterator)

    def predict(self, state: Any, iterator: Any) -> Any:
        return self._run("predict", state, iterator)

    def _run(self, kind: str, state: Any, iterator: Any) -> Any:
        """One execution: its batches read, run group by group, the next staged; timed
        where `pace` chooses K from it."""
        jax = require_jax()
        pace, programs = self.pace, self.programs
        since = pace.started()
        limit = iterator.limit if isinstance(iterator, epoch_reads.Reads) else pace.k
        groups = self.reader.groups(kind, iterator, limit)
        state = programs.laid_out(kind, state)
        fresh = False
        outputs, logs = [], None
        for group in groups:
            fresh = programs.first_run(kind, group, state) or fresh
            out, state = programs.program(kind, group)(state, group.data)
            if kind == "predict":
                outputs.append(out if group.single else unstacked(out))
            logs = out
        first, steps = groups[0], sum(len(group) for group in groups)
        pace.ran(kind, steps)
        if pace.choosing:
            grouping = Grouping(programs.bound(first.signature), _bytes(first) // len(first),
                                lambda k: programs.ahead(kind, first, k, state),
                                lambda k: programs.ahead_seconds(kind, first, k))
            pace.recall(kind, first.signature, grouping)
            if pace.times(kind, fresh):
                dispatched = time.perf_counter()
                jax.block_until_ready(state)
                device = time.perf_counter() - dispatched
                pace.timed(steps, dispatched - since, device, grouping)
        self.reader.stage(kind, iterator, pace.k)
        programs.returned(kind, state)
        pace.ended(kind)
        return (joined(outputs) if kind == "predict" else logs), state


def _bytes(group: Any) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for a in require_jax().tree_util.tree_leaves(
        group.data))
