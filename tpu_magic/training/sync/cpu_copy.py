"""A CPU copy of a trained model (`%tpu_sync`): same architecture, any batch, the trained weights.

The copy is rebuilt from the model's serialized config outside every strategy, on the
CPU, with every static batch dimension (the TPU recipe `Input(batch_shape=(128, …))`)
made variable. Weights are read per replica: variables that replicas update on their
own (non-synchronized BatchNormalization's moving statistics) differ between replicas,
and `get_weights()` would return replica 0's; the copy gets their mean. A probe batch
through both models reports the largest difference in predictions.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import keras
import numpy as np

from tpu_magic.core import random_state
from tpu_magic.core.atomic import atomic_path
from tpu_magic import backends
from tpu_magic.core.errors import SyncError
from tpu_magic.training.sync import adapters as lora
from tpu_magic.training.models.precision import float32_config
from tpu_magic.training.models.rewrap import custom_objects_from, unbuildable
from tpu_magic.core.variables import float32, replica_weights
from tpu_magic.training.sync.structure import structural_copy
from tpu_magic.training.sync.target import choose_model, copy_name

WEIGHTS_SUFFIX = ".weights.h5"  # Keras 3 refuses any other ending for weights files
PROBE_ROWS = 8
# sequence lengths tried, in turn, for inputs that leave theirs open (token ids): a model
# with fewer positions than the first (a GPT-2 of 8) takes a later one
PROBE_LENGTHS = (16, 4, 1)


@dataclass(frozen=True)
class SyncReport:
    """What `%tpu_sync` did.

    Attributes:
        name: the trained model's name in the namespace; as_name: the CPU copy's.
        parameters: the number of weights copied (scalars).
        seconds: time for the whole sync (and save).
        max_abs_diff: largest |prediction difference| on the probe batch (None: no probe).
        averaged: variables whose replicas disagreed and were averaged.
        averaged_names: their paths (e.g. `.../batch_normalization/moving_mean`).
        replicas: how many replicas the model's variables had.
        path: the `.weights.h5` written, if any.
    """

    name: str
    as_name: str
    parameters: int
    seconds: float
    max_abs_diff: float | None
    averaged: int = 0
    replicas: int = 1
    averaged_names: tuple[str, ...] = ()
    path: str | None = None
    adapters: tuple[int, int] | None = None  # --adapters: (bytes saved, bytes of the model)
    source: str | None = None  # where the weights came from, if not this process's model
    how: str | None = None  # how it was copied, where not from its config

    def summary(self) -> str:
        lines = [f"tpu_sync: `{self.name}` → `{self.as_name}` on the CPU, "
                 f"{self.parameters:,} parameters, {self.seconds:.2f} s"]
        if self.averaged:
            lines.append(f"  averaged over {self.replicas} replicas: {self.averaged} variable"
                         f"{'s' * (self.averaged != 1)} that replicas update on their own "
                         f"({_which(self.averaged_names)})")
        if self.how:
            lines.append(f"  {self.how}")
        if self.source:
            lines.append(f"  weights from {self.source}")
        elif self.max_abs_diff is None:
            lines.append("  probe: no input the model takes could be made up, predictions "
                         "not compared")
        else:
            against = " from replica 0 (before averaging)" if self.averaged else ""
            lines.append(f"  probe batch of {PROBE_ROWS}: largest prediction difference{against} "
                         f"{self.max_abs_diff:.3g}")
        if self.path and self.adapters:
            saved, whole = self.adapters
            lines.append(f"  saved the adapters alone: {self.path}, {saved / 2**20:.2f} MiB of the "
                         f"model's {whole / 2**20:.2f} MiB (load with "
                         f"`tpu_magic.load_adapters(model, path)` into the model built from "
                         "the same preset, LoRA enabled with the same rank)")
        elif self.path:
            lines.append(f"  saved: {self.path} (load with `{self.as_name}.load_weights(path)`)")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.summary())


def _which(paths: tuple[str, ...]) -> str:
    """BatchNorm moving statistics where that is what they are, else their names."""
    if paths and all(p.rsplit("/", 1)[-1] in ("moving_mean", "moving_variance") for p in paths):
        return "BatchNorm moving statistics"
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return shown or "unnamed"


def weights_path(text: str) -> Path:
    """`text` with the `.weights.h5` ending Keras requires, in a directory that exists.

    Raises:
        SyncError: the directory does not exist, or the path is a directory.
    """
    path = Path(text).expanduser()
    if path.name.endswith(WEIGHTS_SUFFIX):
        pass
    elif path.suffix == ".h5":
        path = path.with_name(path.name[: -len(".h5")] + WEIGHTS_SUFFIX)
    else:
        path = path.with_name(path.name + WEIGHTS_SUFFIX)
    if path.is_dir() or not text.strip() or text.endswith(("/", "\\")):
        raise SyncError(f"--save {text!r} is a directory: name a file in it, "
                        f"e.g. --save {Path(text) / ('model' + WEIGHTS_SUFFIX)}")
    if not path.parent.is_dir():
        raise SyncError(f"--save {text!r}: the directory {str(path.parent)!r} does not exist; "
                        "create it first or save elsewhere")
    return path


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
        new = _rebuild(serialized, compile_config, objects, label, type(model).__name__)
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


def _rebuild(serialized: Any, compile_config: Any, objects: Mapping[str, Any], label: str,
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


def probe_batch(model: Any, rows: int = PROBE_ROWS, seed: int = 0,
                length: int = PROBE_LENGTHS[0]) -> Any | None:
    """Inputs for a quick comparison, in the structure the model takes (a dict for KerasHub's
    `token_ids` and `padding_mask`): normal floats; small integers for index inputs (valid for
    any Embedding); ones for a mask; `length` where the model leaves one open (a sequence). None: the model has no inputs to read (a subclassed model never called)."""
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        return _probe_from_build(model, rows, seed, length)
    rng = np.random.default_rng(seed)
    batch = []
    for spec in inputs:
        shape = (rows, *(length if d is None else d for d in tuple(spec.shape)[1:]))
        dtype = np.dtype(getattr(spec, "dtype", "float32"))
        if "mask" in str(getattr(spec, "name", "")) or dtype == np.bool_:
            batch.append(np.ones(shape, dtype))  # every position real
        elif np.issubdtype(dtype, np.integer):
            batch.append(rng.integers(0, 2, size=shape).astype(dtype))
        else:
            batch.append(rng.standard_normal(shape).astype(dtype))
    structure = getattr(model, "_inputs_struct", None)
    if structure is not None and not isinstance(structure, (list, tuple)):
        return keras.tree.pack_sequence_as(structure, batch)  # a dict, as the model takes
    return batch[0] if len(batch) == 1 else batch


def _probe_from_build(model: Any, rows: int, seed: int, length: int) -> Any | None:
    """A subclassed model's probe, from the input shape it was built for (`build_config`):
    0s and 1s as float32, which any index input (an Embedding's) and any dense one takes;
    None where it was never built with one shape."""
    shape = (model.get_build_config() or {}).get("input_shape") if model.built else None
    if not isinstance(shape, (list, tuple)) or not shape or \
            not all(d is None or isinstance(d, int) for d in shape):
        return None
    dims = tuple(length if d is None else d for d in tuple(shape)[1:])
    return np.random.default_rng(seed).integers(0, 2, size=(rows, *dims)).astype("float32")


def _predict(model: Any, batch: Any, backend: Any) -> list[np.ndarray]:
    with backend.reading(model):
        out = model(batch, training=False)
    return [np.asarray(o) for o in keras.tree.flatten(out)]


def _compared(model: Any, copy: Any, name: str, backend: Any) -> float | None:
    """The largest prediction difference between the trained model and its copy on a probe
    batch; None where no probe can be made, or the trained model itself refuses the probe's
    made-up input at every length tried (`PROBE_LENGTHS`)."""
    for length in PROBE_LENGTHS:
        probe = probe_batch(copy, length=length)
        if probe is None:
            return None
        try:
            ours = _predict(model, probe, backend)
            break
        except Exception:  # noqa: BLE001 - the made-up input, not the copy, is wrong for it
            continue
    else:
        return None
    try:
        theirs = _predict(copy, probe, backend)
    except Exception as exc:  # noqa: BLE001 - the model takes it and its copy does not
        raise SyncError(f"the CPU copy of {name!r} fails on an input the trained model takes "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                        "its get_config() does not describe the trained model") from None
    return max(float(np.max(np.abs(a - b))) if a.size else 0.0 for a, b in zip(ours, theirs))


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
    if adapters and save is None:
        raise SyncError("--adapters saves the LoRA adapters alone: give the file too, "
                        "e.g. %tpu_sync --save gemma_lora --adapters")
    path = (None if save is None else
            lora.adapters_path(save) if adapters else weights_path(save))
    if not model.built:
        raise SyncError(f"model {name!r} has no weights yet: train it first")
    backend = backend or backends.active()
    refuse_if_too_big(model, name)
    weights, averaged, replicas = replica_weights(model, backend)  # gathered one by one
    new, how = _copy(model, weights, custom_objects, backend, name)
    diff = _compared(model, new, name, backend)
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
    if adapters and save is None:
        raise SyncError("--adapters saves the LoRA adapters alone: give the file too, "
                        "e.g. %tpu_sync --save gemma_lora --adapters")
    path = (None if save is None else
            lora.adapters_path(save) if adapters else weights_path(save))
    backend = backends.active()
    serialized = float32_config(variable_batch(dict(state["config"])))
    compile_config = serialized.pop("compile_config", None)
    with backend.on_the_cpu():
        new = _rebuild(serialized, compile_config, dict(custom_objects), name, state["class"])
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


HOST_LIMIT_VARIABLE = "TPU_MAGIC_HOST_MEMORY_BYTES"  # the host's free memory, for tests


def refuse_if_too_big(model: Any, name: str) -> None:
    """A sharded model is gathered into host memory variable by variable, and then held twice
    (the gathered arrays and the CPU copy): refused first where that cannot fit.

    Raises:
        SyncError: twice the weights' bytes exceed 80 % of the host's free memory.
    """
    needed = 2 * sum(int(np.prod(w.shape)) * 4 for w in model.weights)
    free = _host_free_bytes()
    if free is not None and needed > 0.8 * free:
        raise SyncError(
            f"the CPU copy of {name!r} needs about {needed / 2**30:.2f} GiB of host memory (its "
            f"gathered weights and the copy), and this host has {free / 2**30:.2f} GiB free: "
            "nothing was copied. Keep training state with --checkpoint (LoRA models write their "
            "adapters only), or copy on a machine with more memory.")


def _host_free_bytes() -> float | None:
    import os

    if os.environ.get(HOST_LIMIT_VARIABLE):
        return float(os.environ[HOST_LIMIT_VARIABLE])
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def save_weights(model: Any, path: Path) -> None:
    """`model.save_weights(path)` atomically: an interrupted save keeps the previous file."""
    try:
        with atomic_path(path, suffix=WEIGHTS_SUFFIX) as temporary:
            model.save_weights(str(temporary))
    except OSError as exc:
        raise SyncError(f"could not write {str(path)!r}: {exc.strerror or exc}") from None


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
