"""The panel, clicked in-process (ipywidgets runs `on_click` handlers without a frontend)."""

import html
import importlib.util

import ipywidgets
import numpy as np
import pytest

import keras
import tpu_magic
from tpu_magic.notebook.lossplot import loss_svg
from tpu_magic.notebook.panel import Panel
from tpu_magic.training.fit.progress import FitProgress, FitTiming

from support.cells import DENSE, dense_model, train
from support.data import SETUP


@pytest.fixture
def panel_ip(fresh):
    """A simulated 8-core TPU with its panel, and the digits data."""
    fresh.run_line_magic("tpu_connect", "--simulate 8")
    fresh.run_cell(SETUP)
    return fresh


def test_connect_builds_the_panel_with_sync_disabled_until_training(panel_ip):
    panel = tpu_magic.workspace().panel
    assert isinstance(panel, Panel) and isinstance(panel.widget, ipywidgets.VBox)
    assert isinstance(panel.address, ipywidgets.Text)
    assert all(isinstance(b, ipywidgets.Button)
               for b in (panel.check_button, panel.sync_button, panel.save_button))
    assert panel.sync_button.disabled and panel.save_button.disabled
    assert "simulated 8-core TPU" in panel.device.value and "8 replicas" in panel.device.value
    assert "host RAM" in panel.device.value


@pytest.mark.parametrize("address, state, words", [
    ("grpc://127.0.0.1:{port}", "error", "refused the connection"),
    ("http://10.0.0.1:8470", "error", "scheme 'http'"),
    ("local", "error", "No TPU is attached"),
    ("cpu", "ok", "%tpu_connect cpu"),
])
def test_check_shows_the_result_in_the_panel_not_a_traceback(panel_ip, closed_port,
                                                             address, state, words):
    panel = tpu_magic.workspace().panel
    panel.address.value = address.format(port=closed_port)
    panel.check_button.click()
    assert panel.state == state and words in html.unescape(panel.status.value)
    assert tpu_magic.session().simulated  # Check connects nothing


def test_training_drives_the_panel_then_sync_and_save_work_by_click(panel_ip, tmp_path):
    panel = tpu_magic.workspace().panel
    train(panel_ip, DENSE + "model.fit(x[:256], y[:256], batch_size=64, epochs=3)")
    assert panel.progress.value == panel.progress.max == 12 and panel.progress.description == "done"
    assert panel.history["loss"] and len(panel.history["loss"]) == 3
    assert "<svg" in panel.plot.value and "polyline" in panel.plot.value
    assert "samples/s" in panel.metrics.value and "loss" in panel.metrics.value
    assert not panel.sync_button.disabled and panel.save_path.value == "model.weights.h5"

    panel.sync_button.click()
    assert panel.state == "ok" and "`model` → `model_cpu`" in panel.status.value
    copy = panel_ip.user_ns["model_cpu"]
    x = panel_ip.user_ns["x"]
    np.testing.assert_allclose(copy.predict(x[:5], verbose=0),
                               panel_ip.user_ns["model"](x[:5]).numpy(), atol=1e-6)

    panel.save_path.value = str(tmp_path / "digits")
    panel.save_button.click()
    saved = tmp_path / "digits.weights.h5"
    assert panel.state == "ok" and saved.exists() and str(saved) in panel.details.value
    reloaded = dense_model()
    reloaded.load_weights(saved)
    for got, want in zip(reloaded.get_weights(), copy.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_a_failing_save_shows_its_error_in_the_panel(panel_ip):
    train(panel_ip, DENSE + "model.fit(x[:64], y[:64], batch_size=64, epochs=1)")
    panel = tpu_magic.workspace().panel
    panel.save_path.value = "/no/such/dir/m"
    panel.save_button.click()
    assert panel.state == "error" and "does not exist" in panel.status.value


def test_without_ipywidgets_the_panel_falls_back_to_text(fresh, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ipywidgets" else real(name, *a))
    fresh.run_line_magic("tpu_connect", "--simulate 8")
    assert tpu_magic.workspace().panel is None
    assert "ipywidgets is not installed" in capsys.readouterr().out


def test_no_panel_flag(fresh):
    fresh.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    assert tpu_magic.workspace().panel is None


class RecordingView:
    def __init__(self):
        self.calls = []

    def training_begin(self, epochs, steps):
        self.calls.append(("begin", epochs, steps))

    def training_step(self, epoch, position, logs, samples_per_second):
        self.calls.append(("step", epoch, position))

    def training_epoch(self, epoch, logs):
        self.calls.append(("epoch", epoch, logs["loss"]))

    def training_end(self, interrupted=False):
        self.calls.append(("end", interrupted))


def test_fit_progress_drives_a_view_through_keras_callbacks():
    view = RecordingView()
    progress = FitProgress(FitTiming(global_batch=8), view=view, min_interval=0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    callbacks = keras.callbacks.CallbackList([progress], model=model, epochs=2, steps=3)
    callbacks.on_train_begin()
    for epoch in range(2):
        callbacks.on_epoch_begin(epoch)
        for batch in range(3):
            callbacks.on_train_batch_end(batch, {"loss": 1.0})
        callbacks.on_epoch_end(epoch, {"loss": 0.5 - epoch / 10})
    callbacks.on_train_end()
    progress.close()  # a second close does not end the view twice
    assert view.calls[0] == ("begin", 2, 3) and view.calls[-1] == ("end", False)
    assert [c for c in view.calls if c[0] == "epoch"] == [("epoch", 0, 0.5), ("epoch", 1, 0.4)]
    assert [c[2] for c in view.calls if c[0] == "step"] == [1, 2, 3, 1, 2, 3]


def test_loss_svg_draws_each_series():
    svg = loss_svg({"loss": [1.0, 0.6, 0.4], "val_loss": [1.1, float("nan"), 0.5]})
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and "val_loss" in svg
    assert loss_svg({}) == "" and loss_svg({"loss": [float("inf")]}) == ""
    assert "<polyline" in loss_svg({"loss": [0.3]})  # one epoch, one point


# -- training from the panel ---------------------------------------------------------------

def test_train_row_waits_for_a_model_and_checks_the_batch_live(panel_ip):
    panel = tpu_magic.workspace().panel
    assert panel.train_button.disabled and "train one in a %%tpu_train cell" in panel.batch_note.value
    panel.train_button.click()  # a click anyway says what to do
    assert panel.state == "error" and "no model trained by %%tpu_train" in panel.status.value
    train(panel_ip, DENSE + "model.fit(x[:256], y[:256], batch_size=64, epochs=1)")
    assert panel.batch_size.value == 64 and not panel.train_button.disabled
    panel.batch_size.value = 100
    assert panel.train_button.disabled and "use 96 or 104" in panel.batch_note.value
    panel.batch_size.value = 96  # 12 per replica: valid, with the TPU tile advice
    assert not panel.train_button.disabled and "12 per replica" in panel.batch_note.value
    assert "not a multiple of 8" in panel.batch_note.value
    panel.epochs.value = 0
    assert panel.train_button.disabled


def test_train_continues_from_the_weights_in_the_background(panel_ip):
    panel = tpu_magic.workspace().panel
    train(panel_ip, DENSE + """
val = (x[1500:], y[1500:])
model.fit(x[:256], y[:256], batch_size=64, epochs=1, validation_data=val)
""")
    before = [w.copy() for w in panel_ip.user_ns["model"].get_weights()]
    panel.batch_size.value, panel.epochs.value = 128, 2
    panel.train_button.click()
    job = tpu_magic.workspace().job
    assert job is panel.job and panel.train_button.disabled
    report = job.result(timeout=240)
    assert (report.epochs, report.global_batch, report.interrupted) == (2, 128, False)
    assert "val_loss" in report.metrics  # the validation data of the last fit came along
    after = panel_ip.user_ns["model"].get_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    assert panel.state == "ok" and "done: 2 epochs" in panel.status.value
    assert not panel.train_button.disabled and panel.stop_button.disabled
    assert len(panel.history["loss"]) == 2 and "<svg" in panel.plot.value


def test_stop_ends_training_early_and_the_session_stays_usable(panel_ip):
    import time

    panel = tpu_magic.workspace().panel
    train(panel_ip, DENSE + "model.fit(x[:256], y[:256], batch_size=64, epochs=1)")
    panel.epochs.value = 500
    panel.train_button.click()
    job = panel.job
    deadline = time.monotonic() + 120
    while not panel.history.get("loss") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not panel.stop_button.disabled
    panel.train_button.click()  # a second Train while one runs is refused
    assert panel.state == "error" and "running" in panel.status.value and panel.job is job
    with pytest.raises(Exception, match="training job started from the panel is running"):
        train(panel_ip, "model.fit(x[:64], y[:64], batch_size=64)")
    panel.stop_button.click()
    report = job.result(timeout=120)
    assert report.interrupted and 1 <= report.epochs < 500
    assert "stopped, weights kept" in panel.status.value
    sync = panel_ip.run_line_magic("tpu_sync", "")
    assert sync.max_abs_diff < 1e-6
    again = train(panel_ip, "model.fit(x[:64], y[:64], batch_size=64, epochs=1)")
    assert again.epochs == 1


def test_sync_save_and_connect_wait_while_a_job_trains(panel_ip):
    from IPython.core.error import UsageError

    panel = tpu_magic.workspace().panel
    connection = tpu_magic.session()
    panel_ip.user_ns.pop("model_cpu", None)
    train(panel_ip, DENSE + "model.fit(x[:256], y[:256], batch_size=64, epochs=1)")
    panel.epochs.value = 500
    panel.train_button.click()
    job = tpu_magic.workspace().job
    try:
        for magic, line, action in (("tpu_sync", "", "%tpu_sync"),
                                    ("tpu_sync", "model --save w", "%tpu_sync"),
                                    ("tpu_connect", "--simulate 8 --no-panel", "%tpu_connect"),
                                    ("tpu_connect", "cpu --no-panel", "%tpu_connect")):
            with pytest.raises(UsageError, match=f"{action} waits: a training job started from "
                                                 "the panel is running. Press Stop"):
                panel_ip.run_line_magic(magic, line)
        for button, action in ((panel.sync_button, "Sync"), (panel.save_button, "Save")):
            button.click()
            assert panel.state == "error" and f"{action} waits" in html.unescape(panel.status.value)
        assert "model_cpu" not in panel_ip.user_ns and tpu_magic.session() is connection
        assert not job.done()  # nothing above touched the running job
    finally:
        job.stop()
        job.result(timeout=120)
    panel.sync_button.click()  # after the job: as usual
    assert panel.state == "ok" and "model_cpu" in panel_ip.user_ns


# -- a running job's model and connection are guarded ----------------------------------------

def _train_for_long(ip):
    """A model trained by a cell, then a long panel job on it."""
    panel = tpu_magic.workspace().panel
    train(ip, DENSE + "model.fit(x[:256], y[:256], batch_size=64, epochs=1)")
    panel.epochs.value = 500
    panel.train_button.click()
    return tpu_magic.workspace().job


@pytest.mark.parametrize("line", [
    "model.fit(x[:64], y[:64], batch_size=64, verbose=0)",
    "model.evaluate(x[:64], y[:64], verbose=0)",
    "model.predict(x[:8], verbose=0)",
    "model.compile('adam', 'sparse_categorical_crossentropy')",
    "model.train_on_batch(x[:64], y[:64])",
    "model.set_weights(model.get_weights())",
])
def test_a_plain_cell_cannot_touch_the_model_a_panel_job_trains(panel_ip, line):
    from tpu_magic.core.errors import BusyError

    job = _train_for_long(panel_ip)
    model = panel_ip.user_ns["model"]
    try:
        name = line.split("(")[0]
        with pytest.raises(BusyError, match=f"{name} waits: a training job started from the "
                                            "panel is running"):
            panel_ip.run_cell(line)
        assert not job.done()  # the job trains on, untouched
    finally:
        job.stop()
        report = job.result(timeout=120)
    assert report.interrupted and report.epochs >= 1
    assert tpu_magic.workspace().panel.state == "ok"
    # afterwards the model is the notebook's again, routed as before
    out = panel_ip.run_cell("model.predict(x[:6], verbose=0)").result
    assert out.shape == (6, 10)
    assert all(name not in model.__dict__ for name in ("compile", "set_weights"))


def test_another_shell_cannot_change_the_connection_while_a_job_trains(panel_ip):
    from IPython.core.error import UsageError
    from support.shell import TestingShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    other = TestingShell(config=config)  # a second notebook in the same process
    other.run_line_magic("load_ext", "tpu_magic")
    connection = tpu_magic.session()
    job = _train_for_long(panel_ip)
    try:
        with pytest.raises(UsageError, match="%tpu_connect waits: a training job"):
            other.run_line_magic("tpu_connect", "cpu --no-panel")
        assert tpu_magic.session() is connection and not job.done()
    finally:
        job.stop()
        job.result(timeout=120)
    other.run_line_magic("tpu_connect", "--simulate 8 --no-panel")  # free again


def test_train_is_off_after_a_fit_that_read_a_generator(panel_ip):
    from tpu_magic.core.errors import TrainJobError

    panel = tpu_magic.workspace().panel
    train(panel_ip, DENSE + """
def batches():
    for i in range(0, 256, 64):
        yield x[i:i + 64], y[i:i + 64]
model.fit(batches(), epochs=1, verbose=0)
""")
    assert panel.train_button.disabled
    assert "Train is off: this fit read a generator (x)" in html.unescape(panel.batch_note.value)
    panel.train_button.click()
    assert panel.job is None
    from tpu_magic.notebook.job import start_training

    with pytest.raises(TrainJobError, match="train from a cell"):
        start_training(tpu_magic.session(), tpu_magic.workspace(), panel_ip.user_ns,
                       batch_size=64, epochs=1)


def test_an_error_in_a_panel_job_shows_the_users_line(panel_ip):
    panel = tpu_magic.workspace().panel
    panel_ip.run_cell("""
class Fussy(keras.callbacks.Callback):
    calls = 0
    def on_epoch_end(self, epoch, logs=None):
        Fussy.calls += 1
        if Fussy.calls > 1:
            raise ValueError("the callback's own complaint")
""")
    train(panel_ip, DENSE + "model.fit(x[:128], y[:128], batch_size=64, callbacks=[Fussy()])")
    panel.train_button.click()
    assert panel.job.exception(timeout=120) is not None
    panel.job.thread.join(60)  # the panel hears of the end in the job's thread, just after
    status = html.unescape(panel.status.value)
    assert "ValueError: the callback's own complaint" in status
    assert 'raise ValueError("the callback\'s own complaint")' in status


def test_training_leaves_a_static_loss_chart_in_the_cells_output(panel_ip, monkeypatch):
    """A saved or exported notebook shows widgets as `VBox(children=…)`; the chart stays."""
    from IPython.utils.capture import capture_output

    monkeypatch.setattr(panel_ip, "kernel", object(), raising=False)  # a frontend is there
    with capture_output() as shown:
        train(panel_ip, DENSE + "model.fit(x[:256], y[:256], batch_size=64, epochs=3, "
                                "validation_split=0.25)")
    charts = [o.data["image/svg+xml"] for o in shown.outputs if "image/svg+xml" in o.data]
    assert len(charts) == 1 and "polyline" in charts[0]
    assert "loss" in charts[0] and "val_loss" in charts[0]
