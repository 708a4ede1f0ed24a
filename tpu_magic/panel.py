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
from typing import Any, Callable

from tpu_magic.errors import TpuMagicError
from tpu_magic.lossplot import loss_svg

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


def _numbers(logs: dict[str, float]) -> str:
    return " · ".join(f"{html.escape(k)} {v:.4g}" for k, v in logs.items())


class Panel:
    """The widgets, reachable as `tpu_magic.session().panel`.

    Args:
        check: address → one line; raises `TpuMagicError` when it cannot connect.
        sync: () → a report text (copies the model trained last to the CPU).
        save: path → a report text (sync, then write the weights to path).
        address: the address field's first value.
        device: the one-line device summary.
    """

    def __init__(self, *, check: Callable[[str], str], sync: Callable[[], str],
                 save: Callable[[str], str], address: str = "", device: str = ""):
        import ipywidgets as w

        self._check, self._sync, self._save = check, sync, save
        self.state = "idle"
        self.last_error: BaseException | None = None
        self.history: dict[str, list[float]] = {}
        self.model_name: str | None = None

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

        self.check_button.on_click(self._on_check)
        self.sync_button.on_click(self._on_sync)
        self.save_button.on_click(self._on_save)
        self.widget = w.VBox([
            w.HTML("<b>tpu_magic</b>"),
            w.HBox([self.address, self.check_button]),
            self.status,
            self.device,
            w.HBox([self.progress]),
            self.metrics,
            self.plot,
            w.HBox([self.sync_button, self.save_path, self.save_button]),
            self.details,
        ], layout=w.Layout(border="1px solid #ddd", padding="6px", width="fit-content"))

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
        except TpuMagicError as exc:
            self.last_error = exc
            self.set_status("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - a button has nowhere else to show it
            self.last_error = exc
            self.set_status("error", f"{type(exc).__name__}: {exc}")
        else:
            self.last_error = None
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

    def model_trained(self, name: str | None) -> None:
        """A model was trained: Sync and Save apply to it."""
        if name and name != self.model_name and self.save_path.value in (
                "model.weights.h5", f"{self.model_name}.weights.h5"):
            self.save_path.value = f"{name}.weights.h5"
        self.model_name = name
        self.sync_button.disabled = self.save_button.disabled = False
        self.sync_button.tooltip = f"copy `{name or 'the model'}` to a CPU model"

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
