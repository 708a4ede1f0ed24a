"""A training process killed (SIGKILL) while it writes a checkpoint, resumed in a new one."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support import RUNS
from support.cells import ADAM, SIX_EPOCHS, train

from tpu_magic.training.checkpoints.one_file import read_checkpoint

RUN = RUNS / "checkpoint_run.py"


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(RUN), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def test_killed_mid_checkpoint_resumes_after_the_last_complete_epoch(digits, tmp_path):
    train(digits, SIX_EPOCHS)  # the uninterrupted run, in this process
    straight = digits.user_ns["model"].get_weights()

    directory, marker = tmp_path / "ckpt", tmp_path / "writing"
    victim = subprocess.Popen([sys.executable, str(RUN), directory, tmp_path / "never.npz",
                               "--hang-at-epoch", "4", "--marker", marker],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert victim.poll() is None, victim.stdout.read()
            assert time.monotonic() < deadline, "the training process never reached epoch 4"
            time.sleep(0.1)
    finally:
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
    left = sorted(os.listdir(directory))
    half_written = f".ckpt-000004-epoch-0004.h5.{victim.pid}.tmp"
    assert left == [half_written, "ckpt-000002-epoch-0002.h5", "ckpt-000003-epoch-0003.h5"]
    assert read_checkpoint(directory / "ckpt-000003-epoch-0003.h5").epoch == 3

    resumed = run(directory, tmp_path / "resumed.npz", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "3 epochs done, continuing at epoch 4 of 6" in resumed.stdout
    final = np.load(tmp_path / "resumed.npz")
    weights = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(weights, straight)) < 1e-5
    assert sorted(os.listdir(directory)) == ["ckpt-000005-epoch-0005.h5", "ckpt-000006-epoch-0006.h5"]


# -- nothing lost: damaged and non-finite checkpoints, Ctrl-C --------------------------------


def test_a_damaged_newest_checkpoint_is_moved_aside_and_never_costs_a_good_one(digits, tmp_path,
                                                                                 capsys):
    flags = f"--no-progress --checkpoint {tmp_path} --keep 2"
    train(digits, ADAM + "model.fit(x[:600], y[:600], batch_size=64, epochs=2, verbose=0)", flags)
    newest = tmp_path / "ckpt-000002-epoch-0002.h5"
    newest.write_bytes(np.random.default_rng(0).bytes(newest.stat().st_size))
    report = train(digits, "model.fit(x[:600], y[:600], batch_size=64, epochs=2, verbose=0)",
                   flags + " --resume")
    assert report.resumed_from.endswith("ckpt-000001-epoch-0001.h5")
    # the good one is kept, the damaged one is beside it under another name, counted by nothing
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001-epoch-0001.h5",
                                            "ckpt-000002-epoch-0002.h5.damaged",
                                            "ckpt-000003-epoch-0002.h5"]
    out = capsys.readouterr().out
    assert out.count("moved aside to ckpt-000002-epoch-0002.h5.damaged") == 1  # said once
    # and it stays out of the count after more epochs too
    train(digits, "model.fit(x[:600], y[:600], batch_size=64, epochs=3, verbose=0)",
          flags + " --resume")
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".h5")) == [
        "ckpt-000003-epoch-0002.h5", "ckpt-000004-epoch-0003.h5"]


def test_nan_weights_never_replace_the_finite_checkpoints(digits, tmp_path, capsys):
    flags = f"--checkpoint {tmp_path} --keep 1"
    train(digits, ADAM + "model.fit(x[:600], y[:600], batch_size=64, epochs=1, verbose=0)",
          "--no-progress " + flags)
    # A NaN sample weight: TensorFlow's crossentropy clips a NaN probability to a finite loss
    # (plain Keras logs 2.29 for a NaN input while its weights turn NaN); a weight reaches
    # the loss itself.
    digits.run_cell("bad = np.ones(600, 'float32'); bad[5] = np.nan")
    report = train(digits, "model.fit(x[:600], y[:600], sample_weight=bad, batch_size=64, "
                           "epochs=3)", flags + " --resume")
    assert os.listdir(tmp_path) == ["ckpt-000001-epoch-0001.h5"]  # the finite one survives
    assert read_checkpoint(tmp_path / "ckpt-000001-epoch-0001.h5").epoch == 1
    assert report.diverged.startswith("the loss became NaN/Inf at epoch 2, step ")
    assert f"warning: {report.diverged}" in report.summary()
    assert any("NaN or infinite after epochs 2, 3, so no checkpoint was written" in n and
               "ckpt-000001-epoch-0001.h5, is kept" in n for n in report.notes)
    assert "loss NaN/Inf since" in capsys.readouterr().err  # on the bar too
    # resuming again starts from the finite checkpoint
    again = train(digits, "model.fit(x[:600], y[:600], batch_size=64, epochs=2, verbose=0)",
                  "--no-progress " + flags + " --resume")
    assert again.resumed_from.endswith("ckpt-000001-epoch-0001.h5") and again.diverged is None


def test_ctrl_c_ends_the_cell_so_its_next_line_never_overwrites_a_file(digits, tmp_path):
    import tpu_magic
    from IPython.utils.capture import capture_output

    target = tmp_path / "mine.weights.h5"
    digits.run_cell(f"""
import os, signal
class PressCtrlCTwice(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch in (2, 3):
            os.kill(os.getpid(), signal.SIGINT)
target = {str(target)!r}
""")
    train(digits, ADAM + "model.save_weights(target)")
    before = target.read_bytes()
    cell = ("%%tpu_train --no-progress\n"
            "model.fit(x[:1024], y[:1024], batch_size=32, epochs=20, callbacks=[PressCtrlCTwice()])\n"
            "model.save_weights(target)\n")
    with capture_output() as shown, pytest.raises(KeyboardInterrupt):
        digits.run_cell(cell)
    assert target.read_bytes() == before  # the line after fit did not run
    report = tpu_magic.workspace().report
    assert report.interrupted and report.steps >= 3
    assert "the rest of the cell does not run" in plain(shown.stdout)
    # IPython shows the interrupt at the user's line, with no tpu_magic frame
    assert "KeyboardInterrupt" in plain(shown.stdout) and "model.fit(x[:1024]" in plain(shown.stdout)
    assert "tpu_magic/" not in plain(shown.stdout)


def plain(text):
    """Terminal output without its colour codes."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)
