"""Training throughput three ways, in one process: hand-written fit, %%tpu_train, raw step loop.

    python benchmarks/bench_train.py [--model cnn|lstm] [--backend tf|jax]
        [--precision fp32|mixed_bf16|bf16|fp16|auto] [--simulate N] [--per-replica B]
        [--quick] [--json PATH]

Models: the seeds' CIFAR-10 CNN (BatchNorm, Conv 32-32-64-64, MaxPool, Dropout, Dense
512) on synthetic 32×32×3 images, or the seeds' IMDB LSTM (Embedding(15000, 32),
LSTM(100), Dense(1, sigmoid)) on synthetic reviews of 250 words. Each way trains the
same steps after a warm-up that compiles; the ways run in interleaved rounds and each
way's median is kept, so machine noise hits all three alike.

- hand-written: the model built in the strategy's scope (TF) or under the distribution
  (JAX), `fit` on NumPy arrays, `verbose=0`;
- magic: the same through `%%tpu_train` with its progress bar on, the whole cell timed;
- raw loop: a compiled train step with no callbacks: `strategy.run` over per-replica
  tf.data pipelines (TF), or a `jax.jit` step on batches sharded over the devices (JAX).

A backend is chosen before Keras is imported, so each backend is its own run. The
precision is the dtype policy of all three ways (`--precision`; the magic gets the flag).
Utilization: the magic's report counts the FLOPs of a sample (XLA on JAX, the layers on
TF); every way's TFLOP/s is that count × its samples/s, and its share of the peak
`--check` measured. Prints a table; writes JSON with samples/s, TFLOP/s, the ratios
`magic_vs_handwritten` and `magic_vs_raw_loop`, and the process's peak memory.

Reliability: on this project's 2-core machine, with 8 simulated replicas, 2 of 6 runs of
the CNN at the seeds' batch died of a segmentation fault, each time at the start of a
*hand-written* `fit`: Keras drops the previous fit's iterator (`EpochIterator.reset`) and
TensorFlow's MultiDeviceIterator, which Keras's own distribution of NumPy inputs uses,
crashes while it is freed (a Python stack from `-X faulthandler`; peak memory 3.8 GiB of
24, so not memory). The measurement therefore runs in a child process, and a run killed
by a signal is run again (`--attempts`, default 3); the JSON says how many were.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WORDS, LENGTH = 15000, 250


def build(keras, model: str):
    layers = keras.layers
    if model == "lstm":
        return keras.Sequential([
            keras.Input((LENGTH,), dtype="int32"),
            layers.Embedding(WORDS, 32),
            layers.LSTM(100),
            layers.Dense(1, activation="sigmoid"),
        ])
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


def data(np, model: str, samples: int):
    rng = np.random.default_rng(0)
    if model == "lstm":
        x = rng.integers(1, WORDS, (samples, LENGTH)).astype("int32")
        return x, rng.integers(0, 2, samples).astype("float32")
    return (rng.random((samples, 32, 32, 3), dtype=np.float32),
            rng.integers(0, 10, samples).astype("int32"))


def loss_name(model: str) -> str:
    return "binary_crossentropy" if model == "lstm" else "sparse_categorical_crossentropy"


def tf_raw_loop(keras, model, connection, x, y, batch, steps, precision_policy):
    """A compiled `strategy.run` step over one tf.data pipeline per replica."""
    import tensorflow as tf

    strategy, replicas = connection.strategy, connection.replicas
    with strategy.scope():
        raw = build(keras, model)
        optimizer = keras.optimizers.Adam(1e-3)
        if precision_policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(raw.trainable_variables)
    loss_fn = keras.losses.get(loss_name(model))
    per_replica = batch // replicas

    def replica_pipeline(context):
        shard = (tf.data.Dataset.from_tensor_slices((x, y))
                 .shard(context.num_input_pipelines, context.input_pipeline_id))
        return shard.repeat().batch(per_replica, drop_remainder=True).prefetch(2)

    dataset = (strategy.distribute_datasets_from_function(replica_pipeline)
               if replicas > 1 else replica_pipeline(tf.distribute.InputContext()))
    iterator = iter(dataset)

    @tf.function
    def train_step(it):
        def replica_step(inputs, labels):
            with tf.GradientTape() as tape:
                predictions = raw(inputs, training=True)
                loss = tf.reduce_sum(loss_fn(labels, predictions)) / batch
            grads = tape.gradient(loss, raw.trainable_variables)
            optimizer.apply_gradients(zip(grads, raw.trainable_variables))
            return loss

        return strategy.run(replica_step, args=next(it))

    train_step(iterator)  # warm-up: compile

    def run():
        start = time.perf_counter()
        for _ in range(steps):
            loss = train_step(iterator)
        strategy.reduce("SUM", loss, axis=None).numpy()
        return steps * batch / (time.perf_counter() - start)

    return run


def jax_raw_loop(keras, model, connection, x, y, batch, steps, precision_policy):
    """A `jax.jit` train step (stateless Keras calls) on batches sharded over the devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = connection.strategy.device_mesh.devices.flatten()
    mesh = Mesh(np.array(devices), ("batch",))
    replicated, sharded = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("batch"))
    with connection.strategy.scope():
        raw = build(keras, model)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(raw.trainable_variables)
    loss_fn = keras.losses.get(loss_name(model))
    state = jax.device_put(([v.value for v in raw.trainable_variables],
                            [v.value for v in raw.non_trainable_variables],
                            [v.value for v in optimizer.variables]), replicated)

    def step(state, inputs, labels):
        trainable, fixed, slots = state

        def compute(trainable):
            predictions, fixed_after = raw.stateless_call(trainable, fixed, inputs, training=True)
            return keras.ops.mean(loss_fn(labels, predictions)), fixed_after

        (loss, fixed_after), grads = jax.value_and_grad(compute, has_aux=True)(trainable)
        trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
        return (trainable, fixed_after, slots), loss

    step = jax.jit(step, donate_argnums=0)
    batches = [(jax.device_put(x[i * batch:(i + 1) * batch], sharded),
                jax.device_put(y[i * batch:(i + 1) * batch], sharded)) for i in range(steps)]
    holder = {"state": state}
    holder["state"], loss = step(holder["state"], *batches[0])  # warm-up: compile
    loss.block_until_ready()

    def run():
        start = time.perf_counter()
        for inputs, labels in batches:
            holder["state"], loss = step(holder["state"], inputs, labels)
        loss.block_until_ready()
        return steps * batch / (time.perf_counter() - start)

    return run


def peak_memory_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(argv=None):
    """Runs the measurement in a child process, again where a signal killed it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" in argv:
        return measure([a for a in argv if a != "--child"])
    attempts = 3
    if "--attempts" in argv:
        at = argv.index("--attempts")
        attempts = int(argv[at + 1])
        del argv[at:at + 2]
    crashed = []
    for _ in range(attempts):
        run = subprocess.run([sys.executable, "-X", "faulthandler", __file__, *argv, "--child"])
        if run.returncode >= 0:
            break
        crashed.append(-run.returncode)
        print(f"bench_train: the run was killed by signal {-run.returncode}; running it again",
              flush=True)
    else:
        return 1
    if "--json" in argv and run.returncode == 0:
        path = argv[argv.index("--json") + 1]
        with open(path) as f:
            result = json.load(f)
        result["killed_runs"] = crashed  # the signals of the runs that died first
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return run.returncode


def measure(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("cnn", "lstm"), default="cnn")
    parser.add_argument("--backend", choices=("tf", "jax"), default="tf")
    parser.add_argument("--precision", default="fp32",
                        help="fp32, mixed_bf16, bf16, fp16 or auto (all three ways)")
    parser.add_argument("--simulate", type=int, metavar="N", help="N simulated replicas on the CPU")
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke run)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--per-replica", type=int, default=None, help="batch per replica")
    parser.add_argument("--steps", type=int, default=None, help="steps a round (default 8)")
    # (--attempts N, default 3: how often a run killed by a signal is tried; see the top)
    args = parser.parse_args(argv)

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "tpu_magic")
    connect_line = (f"--simulate {args.simulate} " if args.simulate else "") + \
        f"--backend {args.backend} --check --no-panel"
    connected = shell.run_line_magic("tpu_connect", connect_line)

    import keras
    import numpy as np

    import tpu_magic
    from tpu_magic.precision import choose

    connection = tpu_magic.session()
    replicas = connection.replicas
    chip = connected.check.chip
    policy = choose(args.precision, connection.kind, chip.bf16 if chip else None).policy
    per_replica = args.per_replica or (8 if args.quick else (16 if args.model == "lstm" else 128))
    batch = per_replica * replicas
    steps = args.steps or (4 if args.quick else 8)
    rounds = 2 if args.quick else 3
    x, y = data(np, args.model, steps * batch)
    samples = steps * batch

    def compiled(model):
        model.compile(keras.optimizers.Adam(1e-3), loss_name(args.model), metrics=["accuracy"])
        return model

    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    # 1. Hand-written: built for the distribution, fit on numpy, verbose=0.
    with connection.strategy.scope():
        hand = compiled(build(keras, args.model))
    hand.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # warm-up: compile

    def run_handwritten():
        start = time.perf_counter()
        hand.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        return samples / (time.perf_counter() - start)

    raw_loop = jax_raw_loop if args.backend == "jax" else tf_raw_loop
    run_raw = raw_loop(keras, args.model, connection, x, y, batch, steps, policy)
    keras.config.set_dtype_policy(previous_policy)

    # 2. The magic, as a user runs it (progress bar on); its report counts the FLOPs.
    shell.user_ns.update(x=x, y=y, keras=keras, build=build, compiled=compiled, batch=batch,
                         model_name=args.model)
    precision_flag = f"--precision {args.precision}"
    shell.run_cell_magic("tpu_train", f"--no-progress {precision_flag}",
                         "magic_model = compiled(build(keras, model_name))\n"
                         "magic_model.fit(x, y, batch_size=batch, epochs=1, verbose=0)")
    reports = []

    def run_magic():
        report = shell.run_cell_magic("tpu_train", precision_flag,
                                      "magic_model.fit(x, y, batch_size=batch, epochs=1)")
        if report is None:
            raise RuntimeError("%%tpu_train failed")
        reports.append(report)
        return samples / report.seconds

    ways = {"handwritten": run_handwritten, "magic": run_magic, "raw_loop": run_raw}
    measured = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            measured[name].append(run())
            gc.collect()
    median = {name: statistics.median(values) for name, values in measured.items()}
    used = reports[-1].utilization
    flops = used.flops_per_sample if used is not None else None
    measured_peak = connected.check.measured_tflops * (1 if connection.simulated else replicas)
    nominal_peak = chip.device_peak_tflops * replicas if chip else None
    tflops = {name: (flops * value / 1e12 if flops else None) for name, value in median.items()}
    versions = {"keras": keras.__version__}
    if args.backend == "jax":
        import jax

        versions["jax"] = jax.__version__
    else:
        import tensorflow as tf

        versions["tensorflow"] = tf.__version__
    result = {
        "model": args.model, "backend": args.backend, "precision": policy,
        "device": connected.check.device_type,
        "replicas": replicas, "global_batch": batch, "per_replica": per_replica,
        "steps_per_round": steps, "rounds": rounds, "quick": args.quick,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": versions,
        "samples_per_second": median, "all_rounds": measured,
        "flops_per_sample": flops, "flops_source": used.source if used is not None else None,
        "tflops": tflops, "measured_peak_tflops": measured_peak,
        "nominal_peak_tflops": nominal_peak,
        "input_share": used.input_share if used is not None else None,
        "magic_vs_handwritten": median["magic"] / median["handwritten"],
        "magic_vs_raw_loop": median["magic"] / median["raw_loop"],
        "peak_memory_mib": peak_memory_mib(),
    }
    print(f"\nbench_train: {args.model} on {args.backend}, {policy}, {result['device']}, "
          f"{replicas} replicas, batch {batch} ({per_replica}/replica), "
          f"{steps} steps × {rounds} rounds (median)")
    print(f"{'way':<14}{'samples/s':>12}{'TFLOP/s':>10}{'of measured peak':>18}")
    for name, value in median.items():
        rate = tflops[name]
        print(f"{name:<14}{value:>12,.0f}{rate if rate is not None else float('nan'):>10.4f}"
              f"{100 * rate / measured_peak if rate else float('nan'):>17.1f}%")
    print(f"magic_vs_handwritten {result['magic_vs_handwritten']:.3f}   "
          f"magic_vs_raw_loop {result['magic_vs_raw_loop']:.3f}   "
          f"peak memory {result['peak_memory_mib']:,.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
