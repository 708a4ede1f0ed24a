"""A model rebuilt from its serialized config outside every strategy, on the CPU: every static
batch dimension (the TPU recipe `Input(batch_shape=(128, ...))`) made variable, float32
for any 16-bit policy, LoRA and frozen layers as the model has them, compiled as it was.
`%tpu_sync`'s copy, and the first-step check's reference model."""

from __future__ import annotations

import copy
from typing import Any, Mapping

import keras

from tpu_magic.core import random_state
from tpu_magic.core.errors import SyncError
from tpu_magic.training.models.precision import float32_config
from tpu_magic.training.models.rewrap import unbuildable


def variable_batch(config: Any) -> Any:
    """A deep copy of a serialized model with every Input's batch dimension set to None."""
    config = copy.deepcopy(config)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            inner = node.get("config")
            if node.get("class_name") == "InputLayer" and isinstance(inner, dict):
                shape = inner.get("batch_shape")
                if shape:
                    inner["batch_shape"] = (None, *tuple(shape)[1:])
            for key in ("build_input_shape", "input_shape"):
                shape = node.get(key)
                if isinstance(shape, (list, tuple)) and shape and \
                        all(d is None or isinstance(d, int) for d in shape):
                    node[key] = (None, *tuple(shape)[1:])
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(config)
    return config


def cpu_copy(model: Any, custom_objects: Mapping[str, Any], backend: Any,
             label: str | None = None) -> Any:
    """The same architecture built outside every strategy on the CPU, compiled if the model was.

    Args:
        label: the user's name for the model (messages name it), else Keras's name.

    Raises:
        SyncError: the model cannot be rebuilt from its config.
    """
    label = label or getattr(model, "name", type(model).__name__)
    with backend.reading(model):
        try:
            serialized = keras.saving.serialize_keras_object(model)
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot serialize"
            raise SyncError(f"model {label!r} cannot be serialized to build a CPU copy ({exc}); "
                            "give its class a get_config()") from None
    objects = {**custom_objects, type(model).__name__: type(model)}
    serialized = float32_config(variable_batch(serialized))  # float32 for any 16-bit policy
    compile_config = serialized.pop("compile_config", None)
    with backend.on_the_cpu(), random_state.kept():  # the notebook's draws stay its own
        new = rebuild(serialized, compile_config, objects, label, type(model).__name__)
        _same_lora(model, new)
        return new


def compiled_like(copy: Any, model: Any) -> Any:
    """`copy` compiled as `model` is, where its compile config could not be rebuilt (a loss
    class of the notebook's whose config its constructor does not take): the model's own
    loss objects (stateless) and a new optimizer from its optimizer's config; metrics from
    the config where they rebuild, else none (the loss is still compared)."""
    if copy.compiled or not model.compiled or getattr(model, "optimizer", None) is None:
        return copy
    optimizer = model.optimizer
    fresh = type(optimizer).from_config(optimizer.get_config())
    metrics: dict = {}
    try:
        config = keras.saving.deserialize_keras_object(model.get_compile_config())
        metrics = {k: config[k] for k in ("metrics", "weighted_metrics") if config.get(k)}
    except Exception:  # noqa: BLE001 - the loss alone is compared then
        pass
    compiled_loss = getattr(model, "_compile_loss", None)
    copy.compile(optimizer=fresh, loss=model.loss,
                 loss_weights=getattr(compiled_loss, "_user_loss_weights", None), **metrics)
    return copy


def _same_lora(model: Any, new: Any) -> None:
    """LoRA enabled on the copy's layers where the model has it, and the same layers frozen: a
    config need not say so (KerasHub's backbones rebuild without their adapters)."""
    for theirs, ours in zip(model._flatten_layers(), new._flatten_layers()):
        if getattr(theirs, "lora_enabled", False) and not getattr(ours, "lora_enabled", True):
            alpha = getattr(theirs, "lora_alpha", None)
            ours.enable_lora(theirs.lora_rank, **({"lora_alpha": alpha} if alpha else {}))
        if ours.trainable != theirs.trainable:
            ours.trainable = theirs.trainable


def rebuild(serialized: Any, compile_config: Any, objects: Mapping[str, Any], label: str,
             class_name: str) -> Any:
    try:
        with keras.saving.custom_object_scope(objects):
            new = keras.saving.deserialize_keras_object(serialized)
            if compile_config:
                # `compile`, not `compile_from_config`: the latter builds the optimizer, whose
                # slots would double or triple the copy's memory and its weights file.
                try:
                    new.compile(**keras.saving.deserialize_keras_object(compile_config))
                except Exception:  # noqa: BLE001 - predicting needs no compile
                    pass
    except Exception as exc:  # noqa: BLE001
        raise SyncError(f"model {label!r} ({class_name}) cannot be rebuilt from its "
                        f"config for the CPU: {unbuildable(exc)}") from None
    return new
