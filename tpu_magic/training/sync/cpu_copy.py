"""A CPU copy of a trained model (`%tpu_sync`): same architecture, any batch, the trained weights.

The copy is rebuilt from the model's serialized config (`rebuild`), or copied object by
object where the config does not describe the model (`structure`). Weights are read per
replica: variables that replicas update on their own (non-synchronized
BatchNormalization's moving statistics) differ between replicas, and `get_weights()` would
return replica 0's; the copy gets their mean. A probe batch through both models reports
the largest difference in predictions (`probes`); the host's memory is checked first
(`host_memory`), the file written last (`saving`, `adapters`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tpu_magic import backends
from tpu_magic.core.errors import SyncError
from tpu_magic.core.variables import float32, replica_weights
from tpu_magic.training.models.precision import float32_config
from tpu_magic.training.models.rewrap import custom_objects_from
from tpu_magic.training.sync import adapters as lora
from tpu_magic.training.sync.host_memory import refuse_if_too_big
from tpu_magic.training.sync.probes import compared
from tpu_magic.training.sync.rebuild import compiled_like, cpu_copy, rebuild, variable_batch
from tpu_magic.training.sync.report import SyncReport
from tpu_magic.training.sync.saving import save_weights, weights_path
from tpu_magic.training.sync.structure import structural_copy
from tpu_magic.training.sync.target import choose_model, copy_name


def _save_path(save: str | None, adapters: bool) -> Path | None:
    """Where `--save` writes (None: nowhere): the adapters file, or the weights file.

    Raises:
        SyncError: `--adapters` without a file, or an unusable path.
    """
    if adapters and save is None:
        raise SyncError("--adapters saves the LoRA adapters alone: give the file too, "
                        "e.g. %tpu_sync --save gemma_lora --adapters")
    return None if save is None else lora.adapters_path(save) if adapters else weights_path(save)


def sync_to_cpu(model: Any, *, name: str, as_name: str,
                custom_objects: Mapping[str, Any] = {},
                save: str | None = None, backend: Any = None,
                adapters: bool = False) -> tuple[Any, SyncReport]:
    """Copies a trained model to the CPU; optionally writes its weights atomically.

    Args:
        model: the trained (possibly distributed) model.
        name / as_name: the names of the model and of its copy, for the report.
        custom_objects: classes and functions its config refers to.
        save: a path for `.weights.h5` (the ending is added when missing).
        backend: the model's `backends.Backend` (default: the imported keras's).
        adapters: save the trainable variables alone (LoRA adapters; see `adapters`).

    Returns:
        (the CPU model, a `SyncReport`).

    Raises:
        SyncError: the model cannot be copied, or the save path is unusable.
    """
    start = time.perf_counter()
    path = _save_path(save, adapters)
    if not model.built:
        raise SyncError(f"model {name!r} has no weights yet: train it first")
    backend = backend or backends.active()
    refuse_if_too_big(model, name)
    weights, averaged, replicas = replica_weights(model, backend)  # gathered one by one
    new, how = _copy(model, weights, custom_objects, backend, name)
    diff = compared(model, new, name, backend)
    saved = None
    if path is not None and adapters:
        saved = lora.save_adapters(model, path, name)  # its own trainable variables
    elif path is not None:
        save_weights(new, path)
    report = SyncReport(name=name, as_name=as_name,
                        parameters=int(sum(w.size for w in weights)),
                        seconds=time.perf_counter() - start, max_abs_diff=diff,
                        averaged=len(averaged), averaged_names=tuple(averaged),
                        replicas=replicas,
                        path=str(path) if path is not None else None, adapters=saved,
                        how=how)
    return new, report


def _copy(model: Any, weights: list, custom_objects: Mapping[str, Any], backend: Any,
          name: str) -> tuple[Any, str | None]:
    """The CPU copy: rebuilt from the model's config where that describes the model (any
    batch size), else copied object by object (`structure`): a model whose layers were
    swapped by attribute, whose own layers leave an argument out of their config, or whose
    arguments Keras cannot serialize. Returns (the copy, how it was made where not from its
    config)."""
    try:
        new = cpu_copy(model, custom_objects, backend, label=name)
        new.set_weights(weights)
        return new, None
    except (SyncError, ValueError) as exc:
        why = str(exc).split(": ", 1)[-1] if isinstance(exc, SyncError) else str(exc)
    values = {id(w): value for w, value in zip(model.weights, weights)}
    with backend.reading(model):  # the rest (seeds' states): as they are
        for variable in model.variables:
            if id(variable) not in values:
                values[id(variable)] = float32(np.asarray(variable.value))
    with backend.on_the_cpu():
        new = compiled_like(structural_copy(model, lambda v: values[id(v)]), model)
    return new, ("copied as it is, layer by layer (its config does not describe it: "
                 f"{why.splitlines()[0][:160] if why else 'not rebuilt'})")


def copy_from_state(state: Mapping[str, Any], *, name: str, as_name: str,
                    custom_objects: Mapping[str, Any] = {}, save: str | None = None,
                    source: str = "the hosts", adapters: bool = False
                    ) -> tuple[Any, SyncReport]:
    """A CPU model from a model's config and weights read elsewhere (process 0 of several
    hosts: `hosts.run.model_state`), built and filled here; optionally saved (`adapters`:
    the variables the state marks as changing alone, as `sync_to_cpu` saves them).

    Raises:
        SyncError: the config cannot be rebuilt here, or does not take the weights; or
            `adapters` without `save`, or on a model with no adapters.
    """
    start = time.perf_counter()
    path = _save_path(save, adapters)
    backend = backends.active()
    serialized = float32_config(variable_batch(dict(state["config"])))
    compile_config = serialized.pop("compile_config", None)
    with backend.on_the_cpu():
        new = rebuild(serialized, compile_config, dict(custom_objects), name, state["class"])
        try:
            new.set_weights(state["weights"])
        except ValueError as exc:
            raise SyncError(f"the CPU copy of {name!r} does not take the weights from {source} "
                            f"({exc})") from None
    saved = None
    if path is not None and adapters:
        weights = state["weights"]
        saved = lora.write_adapters(
            path, [(state["paths"][i], weights[i]) for i in state["changing"]],
            int(sum(np.asarray(w).nbytes for w in weights)), name)
    elif path is not None:
        save_weights(new, path)
    return new, SyncReport(name=name, as_name=as_name,
                           parameters=int(sum(w.size for w in state["weights"])),
                           seconds=time.perf_counter() - start, max_abs_diff=None,
                           path=str(path) if path is not None else None, source=source,
                           adapters=saved)


def sync_copy(namespace: Mapping[str, Any], name: str | None, as_name: str | None,
              save: str | None, last_model: Any = None,
              last_name: str | None = None, backend: Any = None,
              adapters: bool = False) -> tuple[Any, SyncReport]:
    """`%tpu_sync`: picks the model and copies it. Returns (the copy, its report, which names
    the copy's name); the magic binds it."""
    name, model = choose_model(namespace, name, last_model, last_name)
    target = copy_name(name, as_name)
    return sync_to_cpu(model, name=name, as_name=target,
                       custom_objects=custom_objects_from(namespace, model), save=save,
                       backend=backend, adapters=adapters)
