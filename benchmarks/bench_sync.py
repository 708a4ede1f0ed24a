"""Copying trained weights out: `%tpu_sync` (with and without --save) and a checkpoint
(`%%tpu_train --checkpoint`: write one, read it back and restore it), for the seeds'
CIFAR-10 CNN and a ~25M-parameter model.

    python benchmarks/bench_sync.py [--simulate N] [--repeats R] [--json PATH]

Each model is built and trained for one step in a `%%tpu_train` cell (so its
variables are distributed, as after real training), then `%tpu_sync` runs R times
and `%tpu_sync --save` R times, then a checkpoint is written and restored R times; the
median of each is kept. Prints a table and writes JSON: parameters, sync seconds,
sync+save seconds, file MB, max_abs_diff, checkpoint write / restore seconds and MB
(a checkpoint holds the optimizer state too: Adam's two slots triple its size).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train import build_cnn  # noqa: E402 - the same seed CNN as the training benchmark

MODELS = {
    "seed CIFAR-10 CNN": ("build_cnn(keras)", (32, 32, 3)),
    "dense 25M": ("keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096, activation='relu'),"
                  " keras.layers.Dense(2048, activation='relu'), keras.layers.Dense(10, activation='softmax')])",
                  (4096,)),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, metavar="N", default=None,
                        help="N simulated replicas on the CPU (default: the accelerator found)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "tpu_magic")
    shell.run_line_magic("tpu_connect", f"--simulate {args.simulate} --no-panel"
                         if args.simulate else "--no-panel")
    import keras
    import numpy as np

    import tpu_magic
    from tpu_magic.training.checkpoints.one_file import read_checkpoint
    from tpu_magic.training.checkpoints.state import restore
    from tpu_magic.training.checkpoints.store import CheckpointStore

    replicas = tpu_magic.session().replicas
    shell.user_ns.update(build_cnn=build_cnn, np=np, keras=keras)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for label, (builder, shape) in MODELS.items():
            batch = 8 * replicas
            shell.user_ns["x"] = np.random.default_rng(0).standard_normal(
                (batch, *shape)).astype("float32")
            shell.user_ns["y"] = np.arange(batch) % 10
            shell.run_cell_magic("tpu_train", "--no-progress", f"""
m = {builder}
m.compile("adam", "sparse_categorical_crossentropy")
m.fit(x, y, batch_size={batch}, epochs=1, verbose=0)
""")
            path = os.path.join(directory, "m.weights.h5")
            sync, save, report = [], [], None
            for _ in range(args.repeats):
                start = time.perf_counter()
                report = shell.run_line_magic("tpu_sync", "m")
                sync.append(time.perf_counter() - start)
                start = time.perf_counter()
                shell.run_line_magic("tpu_sync", f"m --save {path}")
                save.append(time.perf_counter() - start)
            model, strategy = shell.user_ns["m"], tpu_magic.session().strategy
            store = CheckpointStore(os.path.join(directory, f"ckpt-{len(rows)}"), keep=1)
            store.prepare()
            write, resume = [], []
            for epoch in range(1, args.repeats + 1):
                start = time.perf_counter()
                written = store.save(model, epoch, seed=0, backend=tpu_magic.session().backend)
                write.append(time.perf_counter() - start)
                start = time.perf_counter()
                restore(model, read_checkpoint(written), strategy)
                resume.append(time.perf_counter() - start)
            rows.append({
                "model": label, "parameters": report.parameters,
                "sync_seconds": statistics.median(sync),
                "sync_and_save_seconds": statistics.median(save),
                "file_mb": os.path.getsize(path) / 2**20,
                "max_abs_diff": report.max_abs_diff, "averaged": report.averaged,
                "checkpoint_write_seconds": statistics.median(write),
                "checkpoint_restore_seconds": statistics.median(resume),
                "checkpoint_mb": os.path.getsize(written) / 2**20,
            })
    result = {"replicas": replicas, "device": tpu_magic.session().kind,
              "simulated": tpu_magic.session().simulated, "repeats": args.repeats,
              "python": platform.python_version(), "keras": keras.__version__,
              "cpu_count": os.cpu_count(), "rows": rows}
    print(f"%tpu_sync on {replicas} replicas ({result['device']}"
          f"{', simulated' if result['simulated'] else ''}), median of {args.repeats}")
    print(f"{'model':<20} {'params':>12} {'sync s':>8} {'+save s':>8} {'file MB':>8} {'max diff':>9}"
          f" {'ckpt s':>7} {'restore s':>9} {'ckpt MB':>8}")
    for r in rows:
        print(f"{r['model']:<20} {r['parameters']:>12,} {r['sync_seconds']:>8.2f} "
              f"{r['sync_and_save_seconds']:>8.2f} {r['file_mb']:>8.1f} {r['max_abs_diff']:>9.2g}"
              f" {r['checkpoint_write_seconds']:>7.2f} {r['checkpoint_restore_seconds']:>9.2f}"
              f" {r['checkpoint_mb']:>8.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return result


if __name__ == "__main__":
    main()
