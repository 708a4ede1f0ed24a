"""Training started from the panel: the last `%%tpu_train` fit again, in a background thread.

The notebook stays responsive while it runs. `TrainJob` is a small future:
`.done()`, `.result(timeout)` → the `TrainReport`, and `.stop()`, which ends
training at the next batch boundary and keeps the weights learned so far.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Any, Callable, MutableMapping

from tpu_magic.core.errors import TrainJobError
from tpu_magic.training.report import TrainReport
from tpu_magic.core.session import Connection
from tpu_magic.training import routing
from tpu_magic.notebook.workspace import Workspace, busy_error


class TrainJob:
    """One training run in a background thread.

    Args:
        run: does the training; gets the stop event, returns the report.
        on_done: called with the job when it ends (in the job's thread).
    """

    def __init__(self, run: Callable[[threading.Event], TrainReport],
                 on_done: Callable[["TrainJob"], None] | None = None):
        self._run = run
        self._on_done = on_done
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._main, name="tpu_magic-train", daemon=True)
        self._guard = contextlib.ExitStack()  # released in the job's thread when it ends

    def start(self, guard: Any = None) -> "TrainJob":
        """Starts the thread; `guard` (a context manager) is entered now and left at the end."""
        if guard is not None:
            self._guard.enter_context(guard)
        self.thread.start()
        return self

    def _main(self) -> None:
        try:
            report = self._run(self._stop)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result
            self._guard.close()
            self._future.set_exception(exc)
        else:
            self._guard.close()
            self._future.set_result(report)
        finally:
            if self._on_done is not None:
                self._on_done(self)

    def done(self) -> bool:
        """Whether training has ended (finished, stopped or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> TrainReport:
        """The `TrainReport`; waits up to `timeout` seconds (TimeoutError after that)."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def stop(self) -> None:
        """Ends training at the next batch boundary; the weights learned so far stay."""
        self._stop.set()



def start_training(connection: Connection, workspace: Workspace,
                   namespace: MutableMapping[str, Any], *, batch_size: int, epochs: int,
                   scale_lr: bool = False, view: Any = None,
                   on_done: Callable[[TrainJob], None] | None = None) -> TrainJob:
    """Runs the workspace's last `fit` again with a new batch and epochs, in the background.

    The job becomes `workspace.job` here, on the caller's thread; from its own thread it
    only trains and hands back its `TrainReport`.

    Raises:
        TrainJobError: no `%%tpu_train` fit to repeat.
        FlagError: bad epochs; BatchSizeError: the batch does not divide over the replicas
            (`request.read_request`, as for the magic's flags).
        BusyError: a job is running already.
    """
    from tpu_magic.training.cell import FitAgain, TrainingCell
    from tpu_magic.training.request import read_request

    workspace.require_idle("Train")
    if workspace.last_fit is None:
        raise TrainJobError("no model trained by %%tpu_train yet: train one in a %%tpu_train "
                            "cell first; then Train here continues it")
    if workspace.last_fit.cannot_repeat:
        raise TrainJobError(workspace.last_fit.cannot_repeat)
    request = read_request(connection, batch_size=batch_size, epochs=epochs,
                           scale_lr=scale_lr, progress=False)
    training = TrainingCell(connection, request, namespace, say=lambda _text: None, view=view,
                            agreed=frozenset(workspace.agreed),
                            inputs_measured=dict(workspace.inputs_measured),
                            flops_counted=dict(workspace.flops_counted))
    last = workspace.last_fit
    job = TrainJob(lambda stop: training.run(FitAgain(last, stop)), on_done)
    workspace.job = job
    # Until it ends, the notebook's own calls on the model wait with the workspace's message.
    return job.start(guard=routing.guarded(last.model, busy_error, owner=job.thread))
