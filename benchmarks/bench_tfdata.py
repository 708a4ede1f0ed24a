"""A user's tf.data dataset under MirroredStrategy: how long `fit` waits after its last step.

    python benchmarks/bench_tfdata.py [--simulate N] [--fits K] [--json PATH]

The workload is the TensorFlow TPU guide's Keras pattern, small: a Conv2D model, a
`tf.data` training dataset (seeded shuffle, repeat, batch 200) and a test dataset (batch
200), `fit(train, epochs=2, steps_per_epoch=10, validation_data=test, validation_steps=5)`
with a callback that has a batch hook (as a progress bar has). Two ways, each in a
process of its own (an iterator of one way can hold up freeing the other's):

- `keras`: the model built in `strategy.scope()`, the datasets passed to Keras, which
  distributes them (a MultiDeviceIterator with per-device prefetching);
- `tpu_magic`: the same datasets through `pipeline.whole_batches`, what `%%tpu_train`
  does with them (whole, masked batches, one host pipeline whose batches are cut into the
  replicas' parts, autotuning off).

Each fit is timed whole and from `on_train_end` to its return: that tail is the time
spent freeing the input iterators, the known wait. Prints a table and writes JSON with
every fit's times, medians and maxima.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
WAYS = ("keras", "tpu_magic")


def run_way(way: str, replicas: int, fits: int) -> list[tuple[float, float]]:
    """K fits one way, in this process; returns (fit seconds, wait seconds) per fit."""
    from tpu_magic.backends.tf.connect import configure_logical_cpus

    configure_logical_cpus(replicas)
    import keras
    import numpy as np
    import tensorflow as tf

    from tpu_magic.backends.tf import datasets as pipeline
    from tpu_magic.training.inputs.exactness import enable

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    images = np.random.rand(2000, 28, 28, 1).astype("float32")
    labels = np.random.randint(0, 10, 2000)

    def get_dataset(batch_size, is_training=True):
        dataset = tf.data.Dataset.from_tensor_slices((images, labels))
        if is_training:
            dataset = dataset.shuffle(2000, seed=1).repeat()
        return dataset.batch(batch_size)

    class Tail(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.last_step = time.perf_counter()

        def on_train_end(self, logs=None):
            self.end = time.perf_counter()

    with strategy.scope():
        model = keras.Sequential([keras.Input((28, 28, 1)),
                                  keras.layers.Conv2D(32, 3, activation="relu"),
                                  keras.layers.Flatten(), keras.layers.Dense(10)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["sparse_categorical_accuracy"])
    train, test = get_dataset(200), get_dataset(200, is_training=False)
    if way == "tpu_magic":
        enable(model)  # the masks `whole_batches` adds go to the loss and metrics
        train = pipeline.whole_batches(train, 200, strategy)
        test = pipeline.whole_batches(test, 200, strategy)
    times = []
    for _ in range(fits):
        tail = Tail()
        start = time.perf_counter()
        model.fit(train, epochs=2, steps_per_epoch=10, validation_data=test,
                  validation_steps=5, verbose=0, callbacks=[tail])
        stop = time.perf_counter()
        times.append((stop - start, stop - tail.end))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, default=8, metavar="N",
                        help="N simulated replicas on the CPU (default 8)")
    parser.add_argument("--fits", type=int, default=5, help="fits per way (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, for a child
    args = parser.parse_args(argv)
    if args.way:
        print(json.dumps(run_way(args.way, args.simulate, args.fits)))
        return None

    result = {"device": f"CPU, simulated {args.simulate}-core TPU", "machine": platform.machine(),
              "cores": os.cpu_count(), "fits": args.fits, "ways": {}}
    print(f"{'way':<10} {'fit median':>11} {'wait median':>12} {'wait max':>9}   every wait (s)")
    for way in WAYS:
        child = subprocess.run([sys.executable, __file__, "--way", way, "--fits", str(args.fits),
                                "--simulate", str(args.simulate)],
                               capture_output=True, text=True, check=True)
        runs = json.loads(child.stdout.strip().splitlines()[-1])
        fits, waits = [f for f, _ in runs], [w for _, w in runs]
        result["ways"][way] = {"fit_seconds": fits, "wait_seconds": waits,
                               "fit_median": statistics.median(fits),
                               "wait_median": statistics.median(waits), "wait_max": max(waits)}
        print(f"{way:<10} {statistics.median(fits):>10.2f}s {statistics.median(waits):>11.2f}s "
              f"{max(waits):>8.2f}s   " + ", ".join(f"{w:.1f}" for w in waits), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
