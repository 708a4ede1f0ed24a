"""Per-model settings before tpu_magic runs a model's `fit`, `evaluate` or `predict`.

Steps per execution and `jit_compile` where the connection cannot run them (or, on JAX,
where Keras declined it only for TensorFlow's sake: `Backend.compile_declined`), the
exactness overrides (see `exactness`), float32 outputs under a mixed policy (see
`precision`), a subclassed model without `call()` marked built, and a retrace where any of
these changed (or the first time tpu_magic runs the model): functions Keras traced before
would run without them. After each call, `settle_traced_state`: what Keras built in it (a
first fit's optimizer and metrics variables) is part of what its functions were traced with.
"""

from __future__ import annotations

from typing import Any

import keras

from tpu_magic.core import record
from tpu_magic.training.inputs import exactness
from tpu_magic.training.inputs import planning
from tpu_magic.training.models import precision

def prepare(model: Any, connection: Any, steps_per_execution: int | None,
            chosen: precision.Precision | None, label: str) -> list[str]:
    """Puts the settings on `model`. Returns the notes to say."""
    notes = []
    kept = record.of(model)
    retrace = kept.traced_state is None  # the first time tpu_magic runs the model
    if not connection.backend.groups_steps:  # else set for each call (`fit.steps`)
        k = steps_per_execution or model.steps_per_execution
        cannot = connection.backend.steps_per_execution_note(connection, k)
        if cannot:
            notes.append(cannot)
            k = 1
        if model.steps_per_execution != k:
            model.steps_per_execution = k
            retrace = True
    cannot_jit = connection.backend.jit_compile_note(connection, model)
    if cannot_jit:
        notes.append(cannot_jit)
        model.jit_compile = False
        retrace = True
    compiled = connection.backend.compile_declined(model, label)
    if compiled:  # steps Keras ran op by op for TensorFlow's sake, compiled
        notes.append(compiled)
        retrace = True
    _mark_built_without_call(model)
    # Only a model that may get padded batches needs the masks; elsewhere plain Keras's code.
    if planning.pads(model, connection) and \
            exactness.enable(model, connection.backend.replica_sum):
        retrace = True
    changed, said = precision.keep_outputs_float32(chosen, model, label)
    notes += said
    state = state_key(model)
    if kept.traced_state != state:  # variables frozen, unfrozen, merged or swapped
        kept.traced_state = state
        retrace = True
    if changed or retrace:
        record.invalidate(model)  # a new generation of its functions and programs
    return notes


def settle_traced_state(model: Any) -> None:
    """After a call Keras ran: what Keras builds in a model's first call (its optimizer's
    variables, its compiled metrics') joins the state the functions were just traced with,
    so the next call does not retrace for it, as plain Keras does not (a retrace compiles
    the step again, and on TensorFlow holds a second trace). Anything else that changed
    during the call (a callback unfreezing a layer) still retraces the next one."""
    kept = record.of(model)
    before = kept.traced_state
    if before is None:
        return
    after = state_key(model)
    if after != before and _built_since(before, after):
        kept.traced_state = after


def _built_since(before: tuple, after: tuple) -> bool:
    """Whether `after` is `before` with only Keras's first-call builds added: the optimizer's
    variables where there were none, and metrics' variables after those there were."""
    trainable, fixed, optimizer, metrics = before
    return (after[:2] == (trainable, fixed) and optimizer in ((), after[2])
            and after[3][:len(metrics)] == metrics)


def _mark_built_without_call(model: Any) -> None:
    """A subclassed model with its own train_step and no `call()` (keras-io's VAE) counts as
    built once its layers are.

    Under a tf.distribute strategy Keras builds an unbuilt model symbolically before `fit`
    by calling it, and fails there ("does not have a `call()` method"); on one device it
    never calls it. The model has no variables of its own, so nothing is left unbuilt.
    """
    if model.built or type(model).call is not keras.Model.call:
        return
    layers = list(model._flatten_layers(include_self=False))
    if layers and all(layer.built for layer in layers):
        model.built = True


def state_key(model: Any) -> tuple:
    """Which variables the model's steps take, in which role: a function traced for one
    key cannot run another (on JAX its output shardings are fixed for the old state, a
    pytree error), so a change (`trainable = False`, a LoRA merge, a layer swapped)
    retraces, as plain Keras without a distribution would."""
    optimizer = getattr(model, "optimizer", None)
    groups = (model.trainable_variables, model.non_trainable_variables,
              optimizer.variables if optimizer is not None and optimizer.built else (),
              model.metrics_variables)
    return tuple(tuple((id(v), v.path) for v in group) for group in groups)
