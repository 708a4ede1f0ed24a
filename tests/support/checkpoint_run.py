"""Trains a small model with `--checkpoint` in a process of its own, for test_faults.py.

    python checkpoint_run.py DIR WEIGHTS.npz [--resume] [--hang-at-epoch N --marker PATH]

With --hang-at-epoch, the checkpoint of epoch N is left half written (its temporary
file truncated), PATH is created, and the process waits to be killed.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

from support.cells import SIX_EPOCHS  # noqa: E402
from support.data import SETUP  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from traitlets.config import Config  # noqa: E402

from tpu_magic.backends.tf import connect as tf_connect  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("weights")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hang-at-epoch", type=int)
    parser.add_argument("--marker")
    args = parser.parse_args()

    tf_connect.configure_logical_cpus(8)
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    shell.run_line_magic("load_ext", "tpu_magic")
    shell.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    if args.hang_at_epoch:
        hang_while_writing(args.hang_at_epoch, Path(args.marker))
    shell.run_cell(SETUP)
    line = f"--no-progress --checkpoint {args.directory}" + (" --resume" if args.resume else "")
    report = shell.run_cell_magic("tpu_train", line, SIX_EPOCHS)
    import numpy as np

    np.savez(args.weights, *shell.user_ns["model"].get_weights())
    print(report.summary(), flush=True)


def hang_while_writing(epoch: int, marker: Path) -> None:
    from tpu_magic.training.checkpoints import store as checkpoint

    real_write = checkpoint.write_file

    def write(path, at_epoch, *rest):
        real_write(path, at_epoch, *rest)
        if at_epoch == epoch:
            with open(path, "r+b") as handle:
                handle.truncate(os.path.getsize(path) // 2)
            marker.write_text(str(path))
            time.sleep(600)

    checkpoint.write_file = write


if __name__ == "__main__":
    main()
