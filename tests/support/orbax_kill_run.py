"""A model split over 8 simulated devices trained with `--checkpoint` (orbax, one directory per
epoch) in a process of its own, for test_sharding_jax.py's killed-write test.

    python orbax_kill_run.py DIR [--kill-at-epoch N] [--resume]

Run with `PYTHONPATH=tests/without_tensorflow`. Every epoch's loss is printed as it ends
(`loss E VALUE`). With --kill-at-epoch N the process SIGKILLs itself while orbax commits
epoch N's checkpoint: every shard written, the temporary directory not yet renamed (a
notebook runtime that dies mid-save). Otherwise the report's lines are printed last.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for `support`

from support.cells import SHARDED  # noqa: E402
from support.shell import testing_shell  # noqa: E402

SAID = """
import numpy as np, keras
said = keras.callbacks.LambdaCallback(
    on_epoch_end=lambda epoch, logs: print("loss", epoch + 1, repr(logs["loss"]), flush=True))
"""
CELL = SAID + SHARDED.replace("epochs=2,", "epochs=3, callbacks=[said],")


def kill_while_committing(epoch: int) -> None:
    """SIGKILL this process inside orbax's commit of epoch `epoch`'s checkpoint (its shards
    written, the rename into place not done), after the epoch's loss is printed."""
    from orbax.checkpoint._src.path import atomicity

    commit = atomicity.on_commit_callback
    mark = f"-epoch-{epoch:04d}.orbax"

    async def killed(tmpdir, *args, **kwargs):
        if mark in str(tmpdir.get()):
            time.sleep(2)  # the epoch's loss printed, in the training thread
            os.kill(os.getpid(), signal.SIGKILL)
        return await commit(tmpdir, *args, **kwargs)

    atomicity.on_commit_callback = killed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--kill-at-epoch", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    shell = testing_shell()
    shell.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    if args.kill_at_epoch:
        kill_while_committing(args.kill_at_epoch)
    line = (f"--no-progress --verify off --shard model --mesh 2x4 --checkpoint {args.directory}"
            + (" --resume" if args.resume else ""))
    report = shell.run_cell_magic("tpu_train", line, CELL)
    print("resumed_from", report.resumed_from, flush=True)
    for path in report.checkpoints:
        print("checkpoint", os.path.basename(path), flush=True)


if __name__ == "__main__":
    main()
