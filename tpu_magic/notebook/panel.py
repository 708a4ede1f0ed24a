"""The ipywidgets panel under `%tpu_connect`: address check, device line, live training, sync.

The panel only lays out widgets and wires their clicks to the callables it is given
(STYLE.md, as ipyfilechooser does): it holds no TensorFlow code. A callable that
raises a `TpuMagicError` gets its message shown in the panel, not a traceback.
`%%tpu_train` drives the training area through the `training_*` methods.
"""

from __future__ import annotations

import html
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tpu_magic.core.batching import plan_batches
from tpu_magic.core.errors import TpuMagicError
from tpu_magic.notebook.lossplot import loss_svg

LIGHTS = {"idle": "#9e9e9e", "busy": "#f5a623", "ok": "#2e7d32", "error": "#c62828"}


def widgets_unavailable() -> str | None:
    """Why the panel cannot be shown (a warning naming the fix), or None when it can."""
    if importlib.util.find_spec("ipywidgets") is None:
        fix = "pip install ipywidgets"
        if "google.colab" in sys.modules:
            fix += ("; in Colab also run `from google.colab import output; "
                    "output.enable_custom_widget_manager()` for tqdm's widget bars")
        return f"ipywidgets is not installed, so the panel is shown as text ({fix})."
    return None


def _light(state: str, text: str) -> str:
    return (f'<span style="display:inline-block;width:10px;height:10px;border-radius:50%;'
            f'background:{LIGHTS[state]};margin-right:6px"></span>'
            f'<span class="tpu-magic-status" data-state="{state}">{html.escape(text)}</span>')


def _error_text(exc: BaseException) -> str:
    """A domain error's own message; anything else with its type and the notebook line it
    came through (the user's code: a callback, a generator, a loss defined in a cell)."""
    if isinstance(exc, TpuMagicError):
        return str(exc)
    text = f"{type(exc).__name__}: {exc}"
    line = _users_line(exc.__traceback__)
    return f"{text} (at {line})" if line else text


def _users_line(traceback: Any) -> str | None:
    """The innermost frame of notebook code in a traceback, as `FILE:LINE: source`.

    Notebook code is what is not a library: no site-packages, no standard library, not
    tpu_magic itself.
    """
    import linecache
    import sysconfig

    libraries = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    ours = str(Path(__file__).resolve().parent)
    found = None
    for frame, number in _frames(traceback):
        name = frame.f_code.co_filename
        if name.startswith(ours) or any(name.startswith(p) for p in libraries) or \
                "site-packages" in name or name.startswith("<frozen"):
            continue
        found = f"{name}:{number}: {linecache.getline(name, number).strip()}".rstrip(": ")
    return found


def _frames(traceback: Any):
    while traceback is not None:
        yield traceback.tb_frame, traceback.tb_lineno
        traceback = traceback.tb_next


def _numbers(logs: dict[str, float]) -> str:
    return " · ".join(f"{html.escape(k)} {v:.4g}" for k, v in logs.items())


class Panel:
    """The widgets, reachable as `tpu_magic.workspace().panel`.

    Args:
        check: address → one line; raises `TpuMagicError` when it cannot connect.
        sync: () → a report text (copies the model trained last to the CPU).
        save: path → a report text (sync, then write the weights to path).
        train: (batch, epochs, scale_lr, on_done) → a running job with `.stop()`,
            and `.result()`; raises `TpuMagicError` when it cannot start.
        address: the address field's first value.
        device: the one-line device summary.
        replicas / tpu_rules: for the live batch check (the magic's own rule).
    """

    def __init__(self, *, check: Callable[[str], str], sync: Callable[[], str],
                 save: Callable[[str], str], train: Callable[..., Any] | None = None,
                 address: str = "", device: str = "", replicas: int = 1,
                 tpu_rules: bool = False):
        import ipywidgets as w

        self._check, self._sync, self._save, self._train = check, sync, save, train
        self.replicas, self.tpu_rules = replicas, tpu_rules
        self.job: Any = None
        self.state = "idle"
        self.history: dict[str, list[float]] = {}
        self.model_name: str | None = None
        self.trained = False  # a %%tpu_train cell has trained a model
        self.cannot_train: str | None = None  # why Train cannot repeat the last fit

        self._make_widgets(w, address, device, replicas)

        self.check_button.on_click(self._on_check)
        self.sync_button.on_click(self._on_sync)
        self.save_button.on_click(self._on_save)
        self.train_button.on_click(self._on_train)
        self.stop_button.on_click(self._on_stop)
        self.batch_size.observe(self._validate, names="value")
        self.epochs.observe(self._validate, names="value")
        self.widget = w.VBox([
            w.HTML("<b>tpu_magic</b>"),
            w.HBox([self.address, self.check_button]),
            self.status,
            self.device,
            w.HBox([self.batch_size, self.epochs, self.scale_lr, self.train_button,
                    self.stop_button]),
            self.batch_note,
            w.HBox([self.progress]),
            self.metrics,
            self.plot,
            w.HBox([self.sync_button, self.save_path, self.save_button]),
            self.details,
        ], layout=w.Layout(border="1px solid #ddd", padding="6px", width="fit-content"))
        self._validate()

    def _make_widgets(self, w: Any, address: str, device: str, replicas: int) -> None:
        """The panel's widgets, each an attribute (its rows are laid out in `__init__`)."""
        self.address = w.Text(value=address, description="Address",
                              placeholder="auto, local, grpc://HOST:8470, gpu or cpu",
                              layout=w.Layout(width="340px"))
        self.check_button = w.Button(description="Check", icon="plug",
                                     tooltip="check that this address answers (connects nothing)")
        self.status = w.HTML(_light("idle", "ready"))
        self.device = w.HTML(html.escape(device))
        self.progress = w.IntProgress(value=0, min=0, max=1, description="training",
                                      bar_style="", layout=w.Layout(width="340px"))
        self.metrics = w.HTML("no training yet: run a %%tpu_train cell")
        self.plot = w.HTML("")
        self.sync_button = w.Button(description="Sync to CPU", icon="download", disabled=True,
                                    tooltip="copy the model trained last to a CPU model")
        self.save_path = w.Text(value="model.weights.h5", description="Save to",
                                layout=w.Layout(width="340px"))
        self.save_button = w.Button(description="Save weights", icon="save", disabled=True,
                                    tooltip="sync, then write the weights (.weights.h5)")
        self.details = w.HTML("")
        self.batch_size = w.IntText(value=128 * replicas, description="Batch",
                                    layout=w.Layout(width="170px"))
        self.epochs = w.IntText(value=1, description="Epochs", layout=w.Layout(width="150px"))
        self.scale_lr = w.Checkbox(value=False, description="scale LR", indent=False,
                                   layout=w.Layout(width="90px"))
        self.train_button = w.Button(description="Train", icon="play", disabled=True,
                                     tooltip="fit the model trained last again, from its weights")
        self.stop_button = w.Button(description="Stop", icon="stop", disabled=True,
                                    tooltip="stop at the next batch, keeping the weights")
        self.batch_note = w.HTML("")

    def _ipython_display_(self) -> None:  # `display(panel)` shows the widgets
        from IPython.display import display

        display(self.widget)

    # -- status --------------------------------------------------------------------------

    def set_status(self, state: str, text: str, details: str = "") -> None:
        self.state = state
        self.status.value = _light(state, text)
        self.details.value = (f"<pre style='margin:0;white-space:pre-wrap'>"
                              f"{html.escape(details)}</pre>" if details else "")

    def _run(self, busy: str, action: Callable[[], str]) -> None:
        """Runs a button's action; its result or error goes to the status line."""
        self.set_status("busy", busy)
        try:
            text = action()
        except Exception as exc:  # noqa: BLE001 - a button has nowhere else to show it
            self.set_status("error", _error_text(exc))
        else:
            head, _, rest = text.partition("\n")
            self.set_status("ok", head, rest)

    def _on_check(self, _button: Any = None) -> None:
        address = self.address.value
        self._run(f"checking {address or 'auto'}…", lambda: self._check(address))

    def _on_sync(self, _button: Any = None) -> None:
        self._run("copying to the CPU…", self._sync)

    def _on_save(self, _button: Any = None) -> None:
        path = self.save_path.value
        self._run(f"saving {path}…", lambda: self._save(path))

    def model_trained(self, name: str | None, global_batch: int | None = None,
                      cannot_train: str | None = None) -> None:
        """A model was trained: Sync, Save and Train apply to it (Train unless
        `cannot_train` says why its fit cannot be repeated)."""
        self.cannot_train = cannot_train
        if name and name != self.model_name and self.save_path.value in (
                "model.weights.h5", f"{self.model_name}.weights.h5"):
            self.save_path.value = f"{name}.weights.h5"
        self.model_name = name
        self.trained = True
        self.sync_button.disabled = self.save_button.disabled = False
        self.sync_button.tooltip = f"copy `{name or 'the model'}` to a CPU model"
        if global_batch:
            self.batch_size.value = global_batch
        self._validate()

    # -- the training row ----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.job is not None and not self.job.done()

    def batch_ok(self) -> bool:
        """Checks the typed batch with the magic's rule; shows the verdict under the row."""
        try:
            plan = plan_batches(self.batch_size.value, self.replicas, tpu_rules=self.tpu_rules)
        except TpuMagicError as exc:
            self.batch_note.value = f'<span style="color:#c62828">{html.escape(str(exc))}</span>'
            return False
        note = f"{plan.per_replica} per replica × {self.replicas} replicas"
        if plan.warnings:
            note += f' <span style="color:#b26a00">— {html.escape(plan.warnings[0])}</span>'
        self.batch_note.value = note
        return True

    def _validate(self, _change: Any = None) -> None:
        valid = self.batch_ok() and self.epochs.value >= 1
        if self.epochs.value < 1:
            self.batch_note.value += (' <span style="color:#c62828">epochs must be 1 or '
                                      'more</span>')
        if not self.trained:
            self.batch_note.value = ("no model yet: train one in a %%tpu_train cell, then "
                                     "train it more from here")
            valid = False
        elif self.cannot_train:
            self.batch_note.value = html.escape(f"Train is off: {self.cannot_train}")
            valid = False
        self.train_button.disabled = not valid or self.running or self._train is None
        self.stop_button.disabled = not self.running

    def _on_train(self, _button: Any = None) -> None:
        if self.running:
            self.set_status("error", "a training job is running: press Stop first")
            return
        if self._train is None or not self.trained:
            self.set_status("error", "no model trained by %%tpu_train yet: train one in a "
                                     "%%tpu_train cell first")
            return
        batch, epochs = self.batch_size.value, self.epochs.value
        self.set_status("busy", f"training `{self.model_name}`: batch {batch}, "
                                f"{epochs} epoch{'s' * (epochs != 1)}…")
        try:
            self.job = self._train(batch, epochs, self.scale_lr.value, self._job_ended)
        except TpuMagicError as exc:
            self.set_status("error", str(exc))
        self._validate()

    def _on_stop(self, _button: Any = None) -> None:
        if self.running:
            self.job.stop()
            self.stop_button.disabled = True
            self.set_status("busy", "stopping at the next batch…")

    def _job_ended(self, job: Any) -> None:
        """Runs in the job's thread when training ends."""
        error = job.exception()
        if error is not None:
            self.set_status("error", _error_text(error))
        else:
            report = job.result()
            head, _, rest = report.summary().partition("\n")
            verdict = "stopped, weights kept" if report.interrupted else "done"
            self.set_status("ok", f"{verdict}: {report.epochs} epoch"
                                  f"{'s' * (report.epochs != 1)} — {head}", rest)
        self._validate()

    # -- the training area (driven by `%%tpu_train`) ----------------------------------------

    def training_begin(self, epochs: int, steps: int) -> None:
        self._epochs, self._steps = epochs, steps
        self._started = time.perf_counter()
        self.history = {}
        self.plot.value = ""
        self.progress.max = max(epochs * max(steps, 1), 1)
        self.progress.value = 0
        self.progress.bar_style = "info"
        self.progress.description = "compiling…"
        self.metrics.value = f"{epochs} epoch{'s' * (epochs != 1)} × {steps or '?'} steps"

    def training_step(self, epoch: int, position: int, logs: dict[str, float],
                      samples_per_second: float | None) -> None:
        self.progress.description = f"epoch {epoch + 1}/{self._epochs}"
        self.progress.value = min(epoch * max(self._steps, 1) + position, self.progress.max)
        speed = f" · {samples_per_second:,.0f} samples/s" if samples_per_second else ""
        self.metrics.value = _numbers(logs) + speed

    def training_epoch(self, epoch: int, logs: dict[str, float]) -> None:
        for key, value in logs.items():
            if "loss" in key:
                self.history.setdefault(key, []).append(value)
        self.progress.value = min((epoch + 1) * max(self._steps, 1), self.progress.max)
        self.plot.value = loss_svg(self.history)

    def training_end(self, interrupted: bool = False) -> None:
        self.progress.bar_style = "warning" if interrupted else "success"
        self.progress.description = "stopped" if interrupted else "done"
        seconds = time.perf_counter() - getattr(self, "_started", time.perf_counter())
        end = "stopped, weights kept" if interrupted else "done"
        self.metrics.value = (self.metrics.value + f" · {end} in {seconds:.1f} s").lstrip(" ·")
