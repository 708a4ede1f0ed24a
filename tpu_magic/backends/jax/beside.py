"""Compiles started beside the steps (the grouped program K's choice asks for, the check's
one-device step): on a thread of their own where the devices are a chip's, here and now
where they are the CPU's.

Why not a thread on the CPU: an XLA:CPU compile emits host code and registers its unwind
tables with the process, and a second thread compiling (or serializing an executable to the
compile cache) while the main thread compiles crashed the process: SIGSEGV in libgcc's
unwinder (`_Unwind_Find_FDE`, under a compile that raised) or inside an executable's
`serialize`, in 3 of 5 runs of the JAX tests, none with the compiles made here
(docs/limits.md). On the CPU the compile shares the cores the steps run on, so a thread hid
little of it there. A chip's compile emits no host code, and its steps leave the host's
cores free for it.

Every compile started on a thread is kept in its model's record and waited for when the
call ends (`settle`): none goes on into the user's next cell, beside a compile of plain
Keras's.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from tpu_magic.core import record
from tpu_magic.core.deps import require_jax


def on_a_thread() -> bool:
    """Whether a compile beside the steps runs on a thread: not on the CPU (see above)."""
    return require_jax().default_backend() != "cpu"


class Beside:
    """`work` (a compile of `model`'s) run beside the steps; `failed`: what it raised, if
    anything (the caller then compiles where it first runs the program)."""

    def __init__(self, model: Any, work: Callable[[], object]) -> None:
        self.failed: BaseException | None = None
        self._thread: threading.Thread | None = None

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - the caller compiles it itself
                self.failed = exc

        if not on_a_thread():
            run()
            return
        # not a daemon: a process that ends meanwhile waits for it, not cut it mid-write
        self._thread = threading.Thread(target=run, name="tpu_magic compile")
        record.of(model).beside.append(self)
        self._thread.start()

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


def settle(model: Any) -> None:
    """Every compile started beside `model`'s steps, waited for (its call ends)."""
    kept = record.of(model)
    while kept.beside:
        kept.beside.pop().wait()
