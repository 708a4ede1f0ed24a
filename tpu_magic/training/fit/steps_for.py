"""The steps an execution of a call, from what the rule (`steps`, pure arithmetic) is given:
the backend's bounds and measurements, the built inputs' steps, the user's callbacks that
read every batch (`batch_hooks`), the call's first batch (`first_batch`). Where K is
chosen: here, by `steps.chosen` (or, on JAX, from the call's first steps as they train:
`steps.AsTheyRun`, read by `backends/jax/loop/pace.py`)."""

from __future__ import annotations

import math
from typing import Any, Callable

from tpu_magic.backends.keras_inputs import first_batch_safely
from tpu_magic.training.fit import steps
from tpu_magic.training.inputs.build import Built


def steps_for(connection: Any, model: Any, built: Built, requested: int | None, kind: str,
              given_callbacks: Any = None, first: Callable[[], Any] | None = None
              ) -> steps.Steps | steps.AsTheyRun:
    """The steps an execution of a call (`steps.chosen`): decided before it runs where
    nothing need be measured; else, on a backend that times a call's steps as they train,
    chosen from its first steps (`steps.AsTheyRun`); else from its `kind` ("train",
    "test", "predict") step measured on its first batch. On a backend that runs Keras's
    own `steps_per_execution`, a user's K is the model's (`models.setup.prepare` set it),
    and an auto K divides the steps the call names (Keras runs whole executions of K on an
    endless input)."""
    backend = connection.backend
    cannot = backend.steps_per_execution_note(connection, 2)
    if cannot:
        return steps.Steps(1, cannot)
    divides = None
    if not backend.groups_steps:
        if requested is not None or model.steps_per_execution > 1:
            return steps.Steps(model.steps_per_execution, "--steps-per-execution" if requested
                               else "the model's own steps_per_execution")
        divides = _whole_executions(built)
    hooks = batch_hooks(given_callbacks)
    decided = steps.decided(requested, model.steps_per_execution, built.epoch_steps, hooks)
    if decided is not None:
        return decided
    if model.run_eagerly:
        return steps.Steps(1, "one step an execution: the model runs eagerly (run_eagerly)")
    if backend.groups_steps and not getattr(model, "jit_compile", True):
        # a group of steps is one XLA program; TensorFlow's tf.function runs K without XLA
        return steps.Steps(1, "one step an execution: the model's steps run without XLA "
                              "(jit_compile=False)")
    several = backend.auto_steps_note()
    if several:
        return steps.Steps(1, several)
    memory = backend.device_view(connection, {}).memory
    known = memory is not None and memory.total_gib and memory.total_from != "host"
    device_bytes = memory.total_gib * 2 ** 30 if known else None
    if backend.times_steps_as_they_run:
        return steps.AsTheyRun(built.epoch_steps, device_bytes, connection.replicas, kind=kind,
                               call_steps=_call_steps(built, kind),
                               compile_competes=connection.kind == "cpu" or connection.simulated)
    batch = first() if first is not None else None
    batch = batch if batch is not None else first_batch(built, read=True)

    def measure() -> steps.StepTimes | None:
        if batch is None:
            return None
        with connection.strategy.scope():
            times = backend.step_times(model, kind, batch)
        return None if times is None else steps.StepTimes(*times)

    def confirm(k: int) -> float | None:
        with connection.strategy.scope():
            return backend.group_seconds(model, kind, batch, k)

    return steps.chosen(requested, model.steps_per_execution, measure, built.epoch_steps,
                        _bytes(batch) // max(connection.replicas, 1), device_bytes, hooks,
                        divides, confirm)


def _call_steps(built: Built, kind: str) -> int | None:
    """The steps a call runs of its own kind: fit's every epoch's (from `initial_epoch`),
    an evaluation's or prediction's one pass (None: the epoch's steps not known)."""
    if not built.epoch_steps:
        return None
    if kind != "train":
        return built.epoch_steps
    epochs = int(built.call.get("epochs", 1) or 1) - int(built.call.get("initial_epoch", 0) or 0)
    return built.epoch_steps * max(epochs, 1)


def _whole_executions(built: Built) -> int | None:
    """What an auto K must divide where Keras's own loop runs it: the steps a call names
    for an input that may not end there (Keras runs ceil(n/K) whole executions of K on it,
    reading past n): fit's `steps_per_epoch` (tpu_magic's own pipeline repeats), and the
    validation's or evaluation's steps of an input that is not tpu_magic's own (its own
    ends with its pass)."""
    call = built.call
    named = [call.get("steps_per_epoch")]
    if "test" not in built.own:
        named.append(call.get("validation_steps"))
    if not {"test", "predict"} & set(built.own):
        named.append(call.get("steps"))
    return math.gcd(*[n for n in named if n]) or None


def first_batch(built: Built, read: bool = False) -> Any:
    """A call's first batch as fed, where it can be read without changing what Keras reads
    (tpu_magic's own pipeline; a user's input that can show it: `peek`), else None. `read`:
    also by reading a dataset again from its start where that changes nothing Keras reads
    (`first_batch_safely`: it costs a batch's read)."""
    first = built.first(1) if built.first is not None else None
    if first:
        return first[0]
    own = next(iter(built.own.values()), None) if "train" not in built.own else None
    if hasattr(own, "__getitem__") and len(own):  # JAX's own batches, indexed
        return own[0]
    peek = getattr(built.call["x"], "peek", None)
    if callable(peek):
        return peek()
    return first_batch_safely(own if own is not None else built.call["x"]) if read else None


def _bytes(batch: Any) -> int:
    import keras
    import numpy as np

    return 0 if batch is None else sum(int(np.asarray(a).nbytes)
                                       for a in keras.tree.flatten(batch) if a is not None)


# Keras's callbacks whose batch hooks see an execution's last step as they would any step
# (with `steps_per_execution` Keras calls them once an execution), at these settings.
_EXECUTION_AWARE = {"ProgbarLogger": None, "History": None, "TerminateOnNaN": None,
                    "ModelCheckpoint": ("save_freq", "epoch"),
                    "BackupAndRestore": ("save_freq", "epoch"),
                    "TensorBoard": ("update_freq", "epoch")}


def batch_hooks(given: Any) -> list[str]:
    """The user's callbacks that read every batch (their classes): a fit with one runs a
    step an execution, so each of its hooks sees each step, as in plain Keras."""
    import keras

    found = []
    default = keras.callbacks.Callback
    for callback in list(given or []):
        kind = type(callback)
        if kind.__name__ in _EXECUTION_AWARE and kind.__module__.startswith("keras."):
            setting = _EXECUTION_AWARE[kind.__name__]
            if setting is None or getattr(callback, setting[0], setting[1]) == setting[1]:
                continue
        hooks = ("on_batch_begin", "on_batch_end", "on_train_batch_begin",
                 "on_train_batch_end")
        # a class's own hook, or one set on the instance (LambdaCallback's)
        if any(getattr(getattr(callback, hook), "__func__", None) is not getattr(default, hook)
               for hook in hooks):
            found.append(kind.__name__)
    return found
