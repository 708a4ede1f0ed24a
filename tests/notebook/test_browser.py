"""The panel in a real browser: JupyterLab on 127.0.0.1, Debian's chromium, Playwright.

The notebook connects to a simulated 8-core TPU, trains in a `%%tpu_train` cell, and
the test clicks **Sync to CPU** in the page; a cell run afterwards proves that the
kernel now holds `model_cpu`. Then it clicks **Train** and sees the panel's progress
move and the job end. Skipped where chromium, Playwright or JupyterLab are
missing, unless TPU_MAGIC_BROWSER=required (CI), where that is a failure.
A screenshot of the page is saved on failure (path in the message), and on success
when TPU_MAGIC_SCREENSHOT names a file.
"""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from support import TESTS
from support.cells import DENSE_MODEL

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = TESTS / "artifacts"
PARAMETERS = 64 * 32 + 32 + 32 * 10 + 10  # the notebook's model, DENSE_MODEL

CELLS = [
    "%load_ext tpu_magic",
    "%tpu_connect --simulate 8",
    """%%tpu_train --epochs 3
import keras
from sklearn.datasets import load_digits
digits = load_digits()
x, y = (digits.data / 16.0).astype("float32"), digits.target
model = """ + DENSE_MODEL + """
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x, y, batch_size=128)""",
    'print("SYNCED", "model_cpu" in globals() and model_cpu.count_params())',
]


def _missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    for module in ("playwright", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[browser]')"
    return None


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 with isolated Jupyter directories; yields its URL."""
    why = _missing()
    if why:
        if os.environ.get("TPU_MAGIC_BROWSER") == "required":
            pytest.fail(why)
        pytest.skip(why)
    home = tmp_path / "jupyter"
    config = home / "config"
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    root = tmp_path / "notebooks"
    root.mkdir()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, root / "panel.ipynb")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "IPYTHONDIR": str(home / "ipython"),
           "TF_CPP_MIN_LOG_LEVEL": "2", "JUPYTER_PLATFORM_DIRS": "1"}
    log = open(tmp_path / "lab.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.open_browser=False", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
         "jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly"]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: server.poll() is not None or _answers(f"{url}/api/status?token={token}"),
                  60, "JupyterLab to start", tmp_path / "lab.log")
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited: {(tmp_path / 'lab.log').read_text()[-3000:]}")
        yield f"{url}/lab/tree/panel.ipynb?token={token}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _wait_for(ready, seconds: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}; log:\n{log.read_text()[-3000:]}")


def test_clicking_sync_in_the_browser_puts_the_cpu_copy_in_the_kernel(lab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(lab)
            # The status bar's "| Idle" appears once the kernel is connected (the toolbar's
            # indicator reads idle before that).
            expect(page.get_by_text("| Idle")).to_be_visible(timeout=90_000)
            page.get_by_text("Run", exact=True).first.click()
            page.locator('[data-command="runmenu:run-all"]').click()

            sync = page.get_by_role("button", name="Sync to CPU")
            expect(sync).to_be_visible(timeout=90_000)
            expect(page.get_by_text("SYNCED False")).to_be_visible(timeout=180_000)
            expect(sync).to_be_enabled(timeout=10_000)
            expect(page.locator(".tpu-magic-loss polyline").first).to_be_attached()
            sync.click()
            status = page.locator(".tpu-magic-status[data-state='ok']")
            expect(status).to_contain_text("model_cpu", timeout=60_000)

            last = page.locator(".jp-CodeCell").last
            last.locator(".cm-content").click()
            page.keyboard.press("Shift+Enter")
            expect(page.get_by_text(f"SYNCED {PARAMETERS}")).to_be_visible(timeout=60_000)
            # Train from the widget: the last fit again, 12 epochs, in the background.
            epochs = page.locator(".widget-text", has_text="Epochs").locator("input")
            epochs.fill("12")
            epochs.press("Enter")
            train = page.get_by_role("button", name=re.compile(r"^\W*Train$"))
            expect(train).to_be_enabled()
            train.click()
            expect(page.locator(".tpu-magic-status[data-state='busy']")).to_contain_text(
                "training `model`: batch 128, 12 epochs", timeout=30_000)
            expect(status).to_contain_text("done: 12 epochs", timeout=180_000)
            # The chart now has a point per epoch of the new run.
            expect(page.locator(".tpu-magic-loss circle")).to_have_count(12)
            if os.environ.get("TPU_MAGIC_SCREENSHOT"):  # to look at the rendered panel
                sync.scroll_into_view_if_needed()
                page.locator(".jp-OutputArea-output", has=sync).screenshot(
                    path=os.environ["TPU_MAGIC_SCREENSHOT"])
        except Exception:
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "browser-failure.png"
            page.screenshot(path=str(shot), full_page=True)
            shutil.copy(tmp_path / "lab.log", ARTIFACTS / "lab.log")
            print(f"screenshot: {shot}")
            raise
        finally:
            browser.close()
