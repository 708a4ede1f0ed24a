"""Training throughput three ways, in one process: hand-written fit, %%tpu_train, raw step loop.

    python benchmarks/bench_train.py [--simulate N] [--quick] [--json PATH]

The model is the seeds' CIFAR-10 CNN (BatchNorm, Conv 32-32-64-64, MaxPool,
Dropout, Dense 512) on synthetic 32×32×3 images, 10 classes. Each way trains
the same number of steps after a warm-up that compiles; the ways are run in
interleaved rounds and each way's median is kept, so machine noise hits all
three alike. Prints a table and writes JSON with samples/s and the ratios
`magic_vs_handwritten` and `magic_vs_raw_loop`. With --simulate N the CPU is
split into N replicas; without it, the connected accelerator (auto) is used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build_cnn(keras):
    layers = keras.layers
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.BatchNormalization(),
        layers.Conv2D(32, 3, padding="same", activation="elu"),
        layers.Conv2D(32, 3, padding="same", activation="elu"),
        layers.MaxPooling2D(), layers.Dropout(0.25),
        layers.Conv2D(64, 3, padding="same", activation="elu"),
        layers.Conv2D(64, 3, padding="same", activation="elu"),
        layers.MaxPooling2D(), layers.Dropout(0.25),
        layers.Flatten(),
        layers.Dense(512, activation="elu"), layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, metavar="N", help="N simulated replicas on the CPU")
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke run, ~1 min)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--per-replica", type=int, default=None, help="batch per replica")
    args = parser.parse_args(argv)

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "tpu_magic")
    connect_line = f"--simulate {args.simulate} --no-panel" if args.simulate else "--no-panel"
    shell.run_line_magic("tpu_connect", connect_line)

    import keras
    import numpy as np
    import tensorflow as tf

    import tpu_magic

    session = tpu_magic.session()
    strategy, replicas = session.strategy, session.replicas
    per_replica = args.per_replica or (8 if args.quick else 128)
    batch = per_replica * replicas
    steps = 4 if args.quick else 8
    rounds = 2 if args.quick else 3
    rng = np.random.default_rng(0)
    x = rng.random((steps * batch, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, steps * batch).astype("int32")
    samples = steps * batch

    def compiled(model):
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    # 1. Hand-written: built in the scope, fit on numpy, verbose=0.
    with strategy.scope():
        hand = compiled(build_cnn(keras))
    hand.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # warm-up: compile

    def run_handwritten():
        start = time.perf_counter()
        hand.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        return samples / (time.perf_counter() - start)

    # 2. The magic, as a user runs it (progress bar on).
    shell.user_ns.update(x=x, y=y, keras=keras, build_cnn=build_cnn, compiled=compiled,
                         batch=batch)
    shell.run_cell_magic("tpu_train", "--no-progress",
                         "magic_model = compiled(build_cnn(keras))\n"
                         "magic_model.fit(x, y, batch_size=batch, epochs=1, verbose=0)")

    def run_magic():
        report = shell.run_cell_magic("tpu_train", "",
                                      "magic_model.fit(x, y, batch_size=batch, epochs=1)")
        if report is None:
            raise RuntimeError("%%tpu_train failed")
        return samples / report.seconds

    # 3. A raw compiled train step over a distributed dataset, no callbacks.
    with strategy.scope():
        raw = build_cnn(keras)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(raw.trainable_variables)
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
               .batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def train_step(it):
        def replica_step(images, labels):
            with tf.GradientTape() as tape:
                predictions = raw(images, training=True)
                per_sample = keras.losses.sparse_categorical_crossentropy(labels, predictions)
                loss = tf.reduce_sum(per_sample) / batch
            grads = tape.gradient(loss, raw.trainable_variables)
            optimizer.apply_gradients(zip(grads, raw.trainable_variables))
            return loss

        return strategy.run(replica_step, args=next(it))

    train_step(iterator)  # warm-up: compile

    def run_raw():
        start = time.perf_counter()
        for _ in range(steps):
            loss = train_step(iterator)
        strategy.reduce("SUM", loss, axis=None).numpy()
        return samples / (time.perf_counter() - start)

    ways = {"handwritten": run_handwritten, "magic": run_magic, "raw_loop": run_raw}
    measured = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            measured[name].append(run())
    median = {name: statistics.median(values) for name, values in measured.items()}
    result = {
        "device": f"{session.kind}{' (simulated)' if session.simulated else ''}",
        "replicas": replicas, "global_batch": batch, "per_replica": per_replica,
        "steps_per_round": steps, "rounds": rounds, "quick": args.quick,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "samples_per_second": median,
        "all_rounds": measured,
        "magic_vs_handwritten": median["magic"] / median["handwritten"],
        "magic_vs_raw_loop": median["magic"] / median["raw_loop"],
    }
    print(f"\nbench_train: {result['device']}, {replicas} replicas, batch {batch} "
          f"({per_replica}/replica), {steps} steps × {rounds} rounds (median)")
    print(f"{'way':<14}{'samples/s':>12}")
    for name, value in median.items():
        print(f"{name:<14}{value:>12,.0f}")
    print(f"magic_vs_handwritten {result['magic_vs_handwritten']:.3f}   "
          f"magic_vs_raw_loop {result['magic_vs_raw_loop']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
