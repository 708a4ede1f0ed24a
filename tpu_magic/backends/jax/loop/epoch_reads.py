"""Keras's epoch iterator on JAX, counting the batches each execution reads: with K steps an
execution, every step reads the batch it reads at one step an execution.

Keras's `EpochIterator` counts K steps for every execution, read or not, and starts a finite
input over from its start once that count reaches the input's batches. An execution the
epoch's end cuts short (29 steps an epoch at K = 25: 25, then 4) is counted as 25 all the
same, so a later epoch starts the input over early and trains on other batches than plain
Keras does. Here each execution is told its steps before it runs (`Reads.limit`: the call's
K at that step, `pace.Pace.limit`, or fewer where the epoch or the input's pass ends first,
as one step an execution would stop) and the batches it read are counted (`Reads.count`).
Keras makes its epoch iterators by name (`trainer.JAXEpochIterator`): while a grouped call
runs they are this module's, each asking the pace of the call on whose thread it was made.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

from tpu_magic.core.overrides import ProcessSwap

_local = threading.local()  # the pace of the grouped call running on this thread


class Reads:
    """One pass of an input as the executions read it: an iterator that gives at most
    `limit` batches an execution (then StopIteration), counting them (`count`: this
    execution's, `done`: the pass's). A loop that reads the pass from elsewhere (tpu_magic's
    own pipeline, `reading.Reader`) says what it took (`took`)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches = batches
        self.limit, self.count, self.done = 0, 0, 0

    def allow(self, steps: int) -> None:
        self.limit, self.count = steps, 0

    def __iter__(self) -> "Reads":
        return self

    def __next__(self) -> Any:
        if self.count >= self.limit:
            raise StopIteration
        batch = next(self.batches)
        self.took(1)
        return batch

    def took(self, steps: int) -> None:
        self.count += steps
        self.done += steps


@functools.cache
def _counting_class(keras_own: type) -> type:
    class CountingEpochIterator(keras_own):
        """Keras's `EpochIterator._enumerate_iterator`, each execution's steps counted as
        they are read (see the module's docstring)."""

        _reads: Reads | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pace = getattr(_local, "pace", None)

        def _steps(self, step: int) -> int:
            return self.steps_per_execution if self._pace is None else self._pace.limit(step)

        def _new_pass(self) -> None:
            self._current_iterator = iter(self._get_iterator())
            self._reads = Reads(self._current_iterator)
            self._steps_seen = 0

        def _enumerate_iterator(self) -> Iterator[tuple]:
            self.data_adapter.on_epoch_begin()
            per_epoch = self.steps_per_epoch or self._num_batches or -1
            if per_epoch > 0:
                if self._current_iterator is None or self.steps_per_epoch is None:
                    self._new_pass()
                step = 0
                while step < per_epoch:
                    if self._num_batches and self._steps_seen >= self._num_batches:
                        if self.steps_per_epoch:
                            self._interrupted_warning()
                        break
                    steps = min(self._steps(step), per_epoch - step)
                    if self._num_batches:
                        steps = min(steps, self._num_batches - self._steps_seen)
                    read = yield from self._execution(step, steps)
                    step += read
                if self._num_batches and self._steps_seen >= self._num_batches:
                    self._new_pass()
            else:  # an input of unknown length, read until it ends
                self._new_pass()
                step = 0
                while True:
                    step += yield from self._execution(step, self._steps(step))
            self.data_adapter.on_epoch_end()

        def _execution(self, step: int, steps: int) -> Iterator[tuple]:
            """One execution of at most `steps` steps from `step`; returns how many it read.
            Its first step is counted before it reads, as one step an execution counts it
            (an input that ends there ends the epoch with that count, in Keras's
            `catch_stop_iteration`)."""
            reads = self._reads
            reads.allow(steps)
            self._steps_seen += 1
            yield step, step + steps - 1, reads
            read = max(reads.count, 1)
            self._steps_seen += read - 1
            return read

    return CountingEpochIterator


def _trainer() -> Any:
    from keras.src.backend.jax import trainer

    return trainer


# Keras's JAX trainer makes its epoch iterators by this name (fit, its validation, evaluate,
# predict): while a grouped call runs, they count what each execution reads
_COUNTED = ProcessSwap(_trainer, "JAXEpochIterator", _counting_class)


@contextlib.contextmanager
def counted(pace: Any) -> Iterator[None]:
    """While inside, Keras's epoch iterators made on this thread count their reads and run
    `pace`'s steps an execution."""
    before = getattr(_local, "pace", None)
    _local.pace = pace
    try:
        with _COUNTED.during():
            yield
    finally:
        _local.pace = before
