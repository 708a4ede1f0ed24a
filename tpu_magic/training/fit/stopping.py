"""Stopping `fit` at a batch boundary: Ctrl-C in the notebook, Stop in the panel.

Either way the step under way finishes and the model keeps the weights learned so far;
a second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

import keras


class StopRequest:
    """Whether Ctrl-C asked `fit` to stop."""

    requested = False


class StopOnEvent(keras.callbacks.Callback):
    """Ends `fit` at the next batch boundary once the event is set (the panel's Stop)."""

    async_safe = True  # only sets a flag Keras reads between steps

    def __init__(self, event: threading.Event):
        super().__init__()
        self.event = event

    def on_train_batch_end(self, batch, logs=None):
        if self.event.is_set():
            self.model.stop_training = True


@contextlib.contextmanager
def stop_on_interrupt(model: Any) -> Iterator[StopRequest]:
    """Ctrl-C stops `fit` at the next batch boundary; a second Ctrl-C interrupts at once.

    Off the main thread (a panel job) signals cannot be caught, and nothing changes.
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if stop.requested:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        stop.requested = True
        model.stop_training = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
