"""A training process killed (SIGKILL) while it writes a checkpoint, resumed in a new one."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from cells import train
from checkpoint_run import CELL

from tpu_magic.checkpoint import read_checkpoint

RUN = Path(__file__).parent / "checkpoint_run.py"


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(RUN), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def test_killed_mid_checkpoint_resumes_after_the_last_complete_epoch(digits, tmp_path):
    train(digits, CELL)  # the uninterrupted run, in this process
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
