"""What a notebook did since it connected: one `Workspace` per IPython shell.

The connection (`session.Connection`) says what the accelerator is; the workspace holds
what changes as the notebook runs: the panel, the model trained last and its `fit`, and
the training job the panel started. The magics own it and are its only writers, on the
notebook's thread; a job hands back its report and writes nothing here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from tpu_magic.core import record
from tpu_magic.core.errors import BusyError


@dataclass
class Workspace:
    """One notebook's state.

    Attributes:
        panel: the ipywidgets panel, once shown.
        last_model / last_model_name: the model the last `%%tpu_train` cell trained, and
            the user's name for it; held weakly (None once the notebook lets it go, as
            plain Keras would: a cell run again builds its new model beside no copy of the
            old one's device memory).
        last_fit: that model's last `fit` (a `training.cell.FitCall`, kept in the model's
            record): what the panel's Train repeats.
        job: the training job the panel's Train started last (a `job.TrainJob`).
    """

    panel: Any = None
    _trained: Any = None  # a weak reference to the model trained last
    last_model_name: str | None = None
    job: Any = None
    connection: Any = None  # the connection the rest belongs to
    check: Any = None  # the last `--check` on this connection (a `check.DeviceCheck`)
    report: Any = None  # the last `%%tpu_train` cell's `TrainReport` (also when it was interrupted)
    # first-step setups that agreed with one device (`training.parity.setup.setup_key`):
    # split over the replicas, or (marked `compare.WHOLE_BATCH`) with every replica computing
    # the whole batch, as their later fits then run (`compare.Parity.remembered`)
    agreed: set = field(default_factory=set)
    # a batch's input seconds of tpu_magic's own pipelines, by key (`utilization.input_need`),
    # for this connection
    inputs_measured: dict = field(default_factory=dict)
    # training FLOPs of a sample by `utilization.flops_key`, for this connection
    flops_counted: dict = field(default_factory=dict)

    @property
    def last_model(self) -> Any:
        return self._trained() if self._trained is not None else None

    @property
    def last_fit(self) -> Any:
        model = self.last_model
        return None if model is None else record.of(model).last_fit

    @property
    def busy(self) -> bool:
        """Whether a job from the panel is training now."""
        return self.job is not None and not self.job.done()

    def require_idle(self, action: str) -> None:
        """Refuses `action` while a job trains: it would read or replace weights mid-step.

        Raises:
            BusyError: a job is running.
        """
        if self.busy:
            raise busy_error(action)

    def connected(self, connection: Any) -> None:
        """A connect: a new connection starts afresh (its panel, no model trained on it);
        the same one, reused, keeps everything."""
        if connection is not self.connection:
            self.panel = self._trained = self.last_model_name = self.job = None
            self.check = None
            self.inputs_measured, self.flops_counted = {}, {}
            self.connection = connection

    def trained(self, model: Any, name: str | None, fit: Any) -> None:
        """A `%%tpu_train` cell's last `fit`: the model Sync, Save and Train act on."""
        record.of(model).last_fit = fit
        self._trained, self.last_model_name = weakref.ref(model), name

    def cell_ended(self, training: Any) -> None:
        """A `%%tpu_train` cell ended (or failed): its report, its last `fit` and model, and
        the panel told what Train would repeat (`training`: the cell's `TrainingCell`)."""
        self.reported(training.report)
        self.flops_counted.update(training.flops.found)
        if training.last_fit is not None:
            self.trained(training.last_model, training.report.model_name, training.last_fit)
        if self.panel is not None and self.last_model is not None:
            self.panel.model_trained(self.last_model_name, training.report.global_batch,
                                     cannot_train=self.last_fit.cannot_repeat)

    def reported(self, report: Any) -> None:
        """A cell's or a job's report: kept, and a first step that agreed with one device
        (split over the replicas, or with every replica computing the whole batch) is not
        compared again for the same setup."""
        self.report = report
        remembered = getattr(getattr(report, "parity", None), "remembered", None)
        if remembered:
            self.agreed.add(remembered)
        used = getattr(report, "utilization", None)
        if used is not None and used.input_measured:
            self.inputs_measured.update([used.input_measured])


def busy_error(action: str) -> BusyError:
    """The one message for anything refused while a panel job trains."""
    return BusyError(f"{action} waits: a training job started from the panel is running. "
                     "Press Stop, or wait for it (tpu_magic.workspace().job.result()).")


_workspaces: "weakref.WeakKeyDictionary[Any, Workspace]" = weakref.WeakKeyDictionary()


def require_process_idle(action: str) -> None:
    """Refuses `action` while a job of any shell in this process trains: the connection is
    one per process, so changing it would pull it from under that job.

    Raises:
        BusyError: a job is running in some shell.
    """
    if any(w.busy for w in list(_workspaces.values())):
        raise busy_error(action)


def workspace_of(shell: Any) -> Workspace:
    """The shell's workspace (made on first use)."""
    if shell not in _workspaces:
        _workspaces[shell] = Workspace()
    return _workspaces[shell]


def workspace() -> Workspace | None:
    """The running IPython shell's workspace, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return None if shell is None else workspace_of(shell)
