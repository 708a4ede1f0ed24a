"""Runs, in a process of its own on 8 simulated JAX devices, what once hung there, for
tests/jax_backend/test_rehearsal_never_hangs.py.

    python rehearsal_run.py ROUNDS SECONDS [PART]

First (PART "dispatch" or "both", the default) a jitted step with an all-reduce, dispatched on from two Python threads at once
without waiting for its results; then ROUNDS times the cells that hung: a fit whose callback
reads every batch, then a fit of another model whose step tpu_magic measured and that runs
one step a dispatch (Keras's own loop, its batch-end hooks on Keras's worker threads)
(PART "cells" or "both"). Each
part prints a line with its seconds. Past SECONDS every thread's stack is written to stderr
and the process exits (1): a hang fails the test instead of stalling the suite.
"""

import faulthandler
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # this checkout's tpu_magic; `support`

from support.cells import GROUPED_MODEL, grouped_data, train  # noqa: E402
from support.shell import testing_shell  # noqa: E402

SETUP = grouped_data(1000) + "x = np.concatenate([x] * 8); y = np.concatenate([y] * 8)\n"
READS_EVERY_BATCH = GROUPED_MODEL + (
    "seen = []\n"
    "model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=["
    "keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))])")
MEASURED = GROUPED_MODEL + "model.fit(x, y, batch_size=32, epochs=1, verbose=0)"


def dispatched_ahead(threads: int = 2, steps: int = 300) -> None:
    """A step with an all-reduce over the 8 devices, `steps` times from each of `threads`
    Python threads, none waiting for a result until the end."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    @jax.jit
    def step(w, x):
        g = jnp.mean(jnp.tanh(x @ w), axis=0)  # the batch's mean: an all-reduce
        return w - 0.01 * g[None, :], jnp.sum(g)

    def run(n: int) -> None:
        w = jax.device_put(np.ones((128, 128), np.float32), whole)
        x = jax.device_put(np.ones((64, 128), np.float32), rows)
        losses = []
        for _ in range(n):
            w, loss = step(w, x)
            losses.append(loss)
        jax.block_until_ready(losses)

    run(1)  # compiled here
    workers = [threading.Thread(target=run, args=(steps,)) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def main() -> None:
    rounds, seconds = int(sys.argv[1]), float(sys.argv[2])
    part = sys.argv[3] if len(sys.argv) > 3 else "both"
    faulthandler.dump_traceback_later(seconds, exit=True)
    ip = testing_shell()
    ip.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    if part in ("dispatch", "both"):
        start = time.perf_counter()
        dispatched_ahead()
        print(f"dispatched ahead: {time.perf_counter() - start:.1f} s", flush=True)
    if part in ("cells", "both"):
        cells(ip, rounds)


def cells(ip, rounds: int) -> None:
    """ROUNDS times: the fit that reads every batch, then the measured fit."""
    from tpu_magic.training.fit import steps

    # the steps timed as they train say one step a dispatch: the measured fit runs one
    # step a dispatch after its timed steps, as it did when it hung
    steps.from_times = lambda *args, **kwargs: steps.Steps(1, "one step a dispatch (test)")
    ip.run_cell(SETUP)
    for index in range(rounds):
        start = time.perf_counter()
        reads = train(ip, READS_EVERY_BATCH)
        measured = train(ip, MEASURED)
        assert reads.execution.k == measured.execution.k == 1, (reads.execution,
                                                                measured.execution)
        assert ip.user_ns["seen"] == list(range(250))
        print(f"round {index}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
