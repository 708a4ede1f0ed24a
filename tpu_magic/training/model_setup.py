"""Per-model settings before tpu_magic runs a model's `fit`, `evaluate` or `predict`.

Steps per execution and `jit_compile` where the connection cannot run them, the
exactness overrides (see `exactness`), float32 outputs under a mixed policy (see
`precision`), a subclassed model without `call()` marked built, and a retrace where any of
these changed (or the first time tpu_magic runs the model): functions Keras traced before
would run without them.
"""

from __future__ import annotations

from typing import Any

import keras

from tpu_magic.training import exactness, planning, precision

_TRACED = "_tpu_magic_traced"  # on the model: its functions were traced with the settings
_STATE = "_tpu_magic_state"  # on the model: which variables its traced functions take


def prepare(model: Any, connection: Any, steps_per_execution: int | None,
            chosen: precision.Precision | None, label: str) -> list[str]:
    """Puts the settings on `model`. Returns the notes to say."""
    notes = []
    k = steps_per_execution or model.steps_per_execution
    retrace = not getattr(model, _TRACED, False)
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
    _mark_built_without_call(model)
    # Only a model that may get padded batches needs the masks; elsewhere plain Keras's code.
    if planning.pads(model, connection) and \
            exactness.enable(model, connection.backend.replica_sum):
        retrace = True
    changed, said = precision.keep_outputs_float32(chosen, model, label)
    notes += said
    state = state_key(model)
    if model.__dict__.get(_STATE) != state:  # variables frozen, unfrozen, merged or swapped
        object.__setattr__(model, _STATE, state)
        retrace = True
    if changed or retrace:
        model.train_function = model.test_function = model.predict_function = None
        object.__setattr__(model, _TRACED, True)
    return notes


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


def traced(model: Any) -> None:
    """After a Keras call on `model`: the functions it traced take the optimizer's and the
    metrics' variables as they are now. A model's first call builds the optimizer's slots
    and the compiled metrics after `prepare` read the key, and that growth is no change to
    retrace for (it had retraced the next cell's every function: measured on TensorFlow's
    seed CNN, a second compile and 0.3 GiB more host memory). A changed trainable or
    non-trainable set stays a change."""
    if not model.__dict__.get(_TRACED) or model.train_function is None and \
            model.test_function is None and model.predict_function is None:
        return
    before, now = model.__dict__.get(_STATE), state_key(model)
    if before is not None and before[:2] == now[:2]:
        object.__setattr__(model, _STATE, now)


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
