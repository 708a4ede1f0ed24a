"""Compiles started beside the steps (the grouped program K's choice asks for, the check's
one-device step), each on a thread of its own while the steps run: XLA's compile releases
the GIL, so the fit goes on meanwhile.

Every such compile is kept in its model's record and waited for when the call ends
(`settle`): none goes on into the user's next cell, beside a compile of plain Keras's.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from tpu_magic.core import record


class Beside:
    """`work` (a compile of `model`'s) run beside the steps; `failed`: what it raised, if
    anything (the caller then compiles where it first runs the program)."""

    def __init__(self, model: Any, work: Callable[[], object]) -> None:
        self.failed: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - the caller compiles it itself
                self.failed = exc

        # not a daemon: a process that ends meanwhile waits for it, not cut it mid-write
        self._thread = threading.Thread(target=run, name="tpu_magic compile")
        record.of(model).beside.append(self)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()


def settle(model: Any) -> None:
    """Every compile started beside `model`'s steps, waited for (its call ends)."""
    kept = record.of(model)
    while kept.beside:
        kept.beside.pop().wait()
