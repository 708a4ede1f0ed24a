"""Steps an execution on TensorFlow: one step measured (so `training.fit.steps` can choose
K), and Keras's own `steps_per_execution` put in force for one call.

Keras's TensorFlow trainer already runs K steps an execution on the device (a
`tf.while_loop` inside one `tf.function`), so nothing of the step is rebuilt here: the
model's K is set for the call and put back after it, and the functions Keras traced at each
K are kept on the model, so a later call at the same K traces nothing. Under
MirroredStrategy with several replicas K > 1 fails in Keras 3 (keras-team/keras#19246):
nothing is measured there, and one step an execution runs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from tpu_magic.core import record
from tpu_magic.core.deps import require_tensorflow
from tpu_magic.core.steps import batch_signature, state_groups

_NAMES = ("train_function", "test_function", "predict_function")
LONG = 4  # steps of the longer of the two timed executions
SLOW = 0.05  # seconds: a step this long is timed twice, not five times


def several_mirrored(strategy: Any) -> bool:
    """A MirroredStrategy of several replicas: Keras 3 runs one step an execution there."""
    return type(strategy).__name__ == "MirroredStrategy" and \
        strategy.num_replicas_in_sync > 1


def measured(model: Any, kind: str, batch: Any) -> tuple[float, float] | None:
    """One `kind` step of the model on `batch` (NumPy, one global batch): its device
    seconds, and the host's seconds an execution (the call into the traced function and
    back). Timed in a loop of its own, run for 1 and for `LONG` steps (their difference is
    the device's steps), on the model's own variables, which are put back afterwards, so
    the model is left as it was; measured once a model, step and batch type. The loop is a
    `tf.function` of its own: the first measurement of a model traces (and, under XLA,
    compiles) its step once more than Keras would. None where nothing is measured:
    several mirrored replicas, a model run eagerly or not ready for the step, or a step
    that failed here (Keras's own call then says what is wrong)."""
    strategy = model.distribute_strategy
    if several_mirrored(strategy) or model.run_eagerly:
        return None
    if (kind == "predict" and not model.built) or (kind != "predict" and not model.compiled):
        return None
    kept = record.of(model)  # measured once a generation of its functions (a retrace drops it)
    key = (kind, batch_signature(batch))
    if key not in kept.measured:
        try:
            times = _timed(model, kind, batch, strategy)
        except Exception:  # noqa: BLE001 - not measured: one step an execution, as Keras
            times = None
        kept.measured = {**kept.measured, key: times}
    return kept.measured[key]


def _timed(model: Any, kind: str, batch: Any, strategy: Any) -> tuple[float, float]:
    tf = require_tensorflow()
    if kind != "predict":
        model._maybe_symbolic_build(data_batch=batch)  # what Keras's fit does first
    loop = _loop(model, kind, strategy)
    data = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(batch))))
    float(loop(data, tf.constant(0)))  # traces: a step built lazily builds its variables
    with _kept_state(model):
        float(loop(data, tf.constant(1)))  # the first run of a traced function pays more
        short = _median(loop, data, 1, 5)
        repeats = 2 if short > SLOW else 5
        long = _median(loop, data, LONG, repeats)
    device = max((long - short) / (LONG - 1), 1e-7)
    return device, max(short - device, 0.0)


def _loop(model: Any, kind: str, strategy: Any) -> Any:
    """A traced loop of `n` `kind` steps on one batch, each run as Keras runs it (under
    the strategy, compiled by XLA where the model is), returning a sum of the steps'
    outputs (reading it waits for the device)."""
    tf = require_tensorflow()
    step = {"train": model.train_step, "test": model.test_step,
            "predict": model.predict_step}[kind]
    one = tf.function(tf.autograph.experimental.do_not_convert(step),
                      jit_compile=bool(model.jit_compile), reduce_retracing=True)

    def summed(out: Any) -> Any:
        parts = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in
                 tf.nest.flatten(strategy.experimental_local_results(out))
                 if t is not None and t.dtype.is_floating]
        return tf.add_n(parts) if parts else tf.constant(0.0)

    def loop(data: Any, n: Any) -> Any:
        def body(i: Any, total: Any) -> tuple:
            return i + 1, total + summed(strategy.run(one, args=(data,)))
        return tf.while_loop(lambda i, total: i < n, body,
                             (tf.constant(0), tf.constant(0.0)))[1]

    return tf.function(tf.autograph.experimental.do_not_convert(loop))


def _median(loop: Any, data: Any, n: int, repeats: int) -> float:
    tf = require_tensorflow()
    steps = tf.constant(n)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        float(loop(data, steps))
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


@contextlib.contextmanager
def _kept_state(model: Any) -> Iterator[None]:
    """The model's variables (weights, random seeds, optimizer, metrics) put back as they
    were once the block ends."""
    seen, kept = set(), []
    for variable in [v for group in state_groups(model) for v in group] + \
            list(model.variables):
        if id(variable) not in seen:
            seen.add(id(variable))
            kept.append((variable, variable.numpy()))
    try:
        yield
    finally:
        for variable, value in kept:
            variable.assign(value)


@contextlib.contextmanager
def keras_steps(model: Any, chosen: Any) -> Iterator[Any]:
    """While a call runs: Keras's own `steps_per_execution` at `chosen.k` (a
    `training.fit.steps.Steps`), with the functions Keras traced at that K for this
    generation of the model's settings (none: Keras traces them); afterwards the model's
    own K and functions again, the new ones kept. Yields what the call ran (`result()`)."""
    ran = _Ran(chosen)
    own, steps = model.steps_per_execution, chosen.k
    if steps == own:
        yield ran
        return
    own_record = record.of(model)  # kept for this generation (a retrace drops them)
    kept = own_record.functions
    theirs = {name: getattr(model, name, None) for name in _NAMES}
    for name in _NAMES:
        setattr(model, name, kept.get((steps, name)))
    model.steps_per_execution = steps
    try:
        yield ran
    finally:
        made = {(steps, name): getattr(model, name) for name in _NAMES
                if getattr(model, name, None) is not None}
        if own_record.functions is kept:  # no retrace while the call ran
            own_record.functions = {**kept, **made}
        model.steps_per_execution = own
        for name, function in theirs.items():
            setattr(model, name, function)


class _Ran:
    """What a call ran: the steps it was given (Keras's own loop runs them as they are)."""

    def __init__(self, steps: Any) -> None:
        self._steps = steps

    def result(self) -> Any:
        return self._steps
