"""A first step's setup: what makes two first steps the same computation, so that a setup
that agreed with one device is not compared again (`setup_key`).

The key is of everything that decides what the step computes, never of the weights' values:
the model's layers (their classes, by source where a notebook defined them; their settings;
the notebook's own functions they call, by code), its variables' shapes, its compile (the
loss, by code where it is a notebook's own, the optimizer and its settings, the metrics),
the batches' shapes and the devices. Anything that cannot be told the same way twice is
keyed as the one object it is (`_identity`): that setup is compared again in a later cell,
which costs a check and never hides a difference. A key that came out equal for two
different computations would skip the check of the second, and its numbers could differ
silently: a notebook's loss function or `Lambda` edited and run again once kept the key of
the one before (they were keyed by name).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
import uuid
from typing import Any, Callable

import keras

from tpu_magic.core import record

INFERENCE_SUFFIX = " inference"  # `where`'s suffix in the setup of an inference-mode comparison
# how deep the notebook functions a function calls are followed (a loss calling a helper
# calling another): a function further down is keyed by name
CALLED_DEPTH = 3
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def setup_key(model: Any, shapes: list, where: str) -> str:
    """What makes two first steps the same computation: the model's layers (their classes,
    the source of a notebook's own, their settings and the notebook functions they call),
    variables, dtype policies and compile settings, the batches' shapes and dtypes
    (`shapes`: `arrays.batch_shapes` of each), and the devices (`where`). Weight values are
    not part of it: an unseeded model rebuilt by the same cell is the same setup."""
    layers = [(_class_key(type(layer)), layer.trainable, str(getattr(layer, "dtype_policy", "")),
               _layer_settings(layer))
              for layer in model._flatten_layers()]
    # by place, not path: Keras numbers the names of a model built again (dense_1, dense_2)
    variables = [(tuple(v.shape), str(v.dtype), v.trainable) for v in model.variables]
    optimizer = getattr(model, "optimizer", None)
    compiled = (repr(_loss_key(getattr(model, "loss", None))),
                type(optimizer).__name__ if optimizer is not None else None,
                _settings(optimizer),
                [getattr(m, "name", repr(m)) for m in getattr(model, "metrics", [])])
    text = repr((layers, variables, compiled, list(shapes), where, _class_key(type(model))))
    return hashlib.sha1(text.encode()).hexdigest()


def comparison_setup(model: Any, shapes: list, where: str, inference: bool) -> str:
    """The `setup_key` of a first-step comparison, from `batch_shapes` of the batches it
    compares (`shapes`): a training step's is of the first execution's batches; an
    inference-mode comparison's (the replicas draw random numbers) of the first batch alone,
    with `where` marked, so the same batch compared the other way is another setup. Both
    `FirstStep` (after the first execution) and `setup_before` (before the fit) use it."""
    if inference:
        return setup_key(model, shapes[:1], where + INFERENCE_SUFFIX)
    return setup_key(model, shapes, where)


def setup_before(model: Any, shapes: Callable[[int], list], where: str,
                 random_draws: str | None, steps: int = 1) -> str | None:
    """The `comparison_setup` a fit's first execution will have, told before the fit from
    the shapes of its first batches (`arrays.Pipeline.shapes`): one batch's where the
    replicas draw random numbers (an inference-mode comparison), otherwise the first
    execution's `steps`. None where it cannot be told (the check then decides after the
    first step, as ever)."""
    try:
        inference = bool(random_draws)
        return comparison_setup(model, shapes(1 if inference else steps), where, inference)
    except Exception:  # noqa: BLE001 - the check must never break the cell
        return None


def _layer_settings(layer: Any) -> Any:
    """A layer's settings as its config gives them, less the names Keras numbers afresh for
    a model built again, with the functions it holds (a `Lambda`'s, an activation) keyed by
    what they compute (`_function_key`): `Softmax(axis=0)` or a `Lambda` taking a batch
    mean is another computation than the one before it. A model (Functional, Sequential, a
    KerasHub backbone) is keyed by its class alone: its config names its layers, and its
    layers are keyed one by one. A layer without a config (KerasHub's attention and norms)
    by its public plain attributes (their sizes, an epsilon) and the functions it holds."""
    if isinstance(layer, keras.Model):
        return ()
    try:
        config = layer.get_config()
    except Exception:  # noqa: BLE001 - KerasHub's inner layers and many a notebook's have none
        config = {key: value for key, value in vars(layer).items()
                  if (not key.startswith("_") and isinstance(value, (*_SCALARS, tuple)))
                  or isinstance(value, types.FunctionType)}
    return _plain({key: _function_key(getattr(layer, key))
                   if isinstance(getattr(layer, key, None), types.FunctionType) else value
                   for key, value in config.items()})


def _plain(value: Any) -> Any:
    """A config as nested tuples, in a fixed order, without `name` entries at any level
    (a nested layer's config names it too; the dtype policy, whose config is its name, is
    keyed from the layer itself)."""
    if isinstance(value, dict):
        return tuple((str(key), _plain(item)) for key, item in
                     sorted(value.items(), key=lambda pair: str(pair[0])) if key != "name")
    if isinstance(value, (list, tuple)):
        return tuple(_plain(item) for item in value)
    return value if isinstance(value, _SCALARS) else repr(value)


def _settings(optimizer: Any) -> Any:
    """An optimizer's settings, as its config gives them; where it cannot give one (a
    learning-rate schedule of a notebook's without `get_config`, a tensor in it), the
    optimizer object itself: that setup is then compared again in a later cell."""
    if optimizer is None:
        return ()
    try:
        return sorted((k, repr(v)) for k, v in optimizer.get_config().items() if k != "name")
    except Exception:  # noqa: BLE001 - Keras's own fit never asks for it: no error here either
        return f"{type(optimizer).__qualname__} {_identity(optimizer)}"


def _loss_key(loss: Any) -> Any:
    """The compiled loss (one, or a structure of them by output): a name as it is, a Keras
    `Loss` by its class and settings (a function it wraps by code), a class by `_class_key`,
    a function by `_function_key`, another callable as the one object it is."""
    return keras.tree.map_structure(_one_loss, loss) if loss is not None else None


def _one_loss(item: Any) -> Any:
    if isinstance(item, keras.losses.Loss):
        try:
            config = item.get_config()
        except Exception:  # noqa: BLE001 - compared again rather than told apart by name
            return _identity(item)
        return (_class_key(type(item)),
                _plain({key: _function_key(getattr(item, key))
                        if callable(getattr(item, key, None)) else value
                        for key, value in config.items()}))
    if isinstance(item, type):
        return _class_key(item)
    if callable(item):
        return _function_key(item)
    return item


def _function_key(fn: Any, depth: int = CALLED_DEPTH) -> Any:
    """A function by what it computes. A library's (Keras's own activations and losses) by
    its name; a notebook's by its code, its defaults and the plain values it closes over
    (an `axis`), and the notebook functions it calls, followed `depth` deep: a loss edited
    and defined again, or the helper it calls, is another computation under the same name.
    A `functools.partial` by its function and arguments; any other callable as the one
    object it is."""
    if isinstance(fn, functools.partial):
        return ("partial", _function_key(fn.func, depth), _plain(list(fn.args)),
                _plain(dict(fn.keywords)))
    if not isinstance(fn, types.FunctionType):
        return f"{type(fn).__qualname__} {_identity(fn)}"
    name = f"{fn.__module__}.{fn.__qualname__}"
    if not _notebooks(fn.__module__):
        return name
    closed = tuple(_closed_value(cell, depth) for cell in fn.__closure__ or ())
    called = []
    if depth > 0:
        for global_name in sorted(_names(fn.__code__)):
            value = fn.__globals__.get(global_name)
            if isinstance(value, types.FunctionType) and value is not fn:
                called.append((global_name, _function_key(value, depth - 1)))
    return (name, _code_text(fn.__code__), _plain(list(fn.__defaults__ or ())),
            _plain(dict(fn.__kwdefaults__ or {})), closed, tuple(called))


def _closed_value(cell: Any, depth: int) -> Any:
    try:
        value = cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None
    if isinstance(value, types.FunctionType):
        return _function_key(value, depth - 1) if depth > 0 else value.__qualname__
    return _plain(value) if isinstance(value, (*_SCALARS, list, tuple, dict)) \
        else type(value).__qualname__


def _names(code: Any) -> set:
    """The global names a code object and the code nested in it (a lambda, a comprehension)
    refer to."""
    found = set(code.co_names)
    for constant in code.co_consts:
        if inspect.iscode(constant):
            found |= _names(constant)
    return found


def _notebooks(module: str) -> bool:
    """Whether code of `module` is a notebook's own (its cells, or code run without a file)."""
    return module in ("__main__", "builtins") or module.startswith("<")


def _class_key(cls: type) -> str:
    """A class by its name, and by its source where a notebook defined it (a cell run again
    defines a new class object with the same source)."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _notebooks(cls.__module__):
        try:
            return name + ":" + hashlib.sha1(inspect.getsource(cls).encode()).hexdigest()
        except (OSError, TypeError):
            return f"{name}:{_code_key(cls)}"
    return name


def _code_key(cls: type) -> str:
    """A notebook class's key where its source cannot be read (Python before 3.13 finds
    no source of a class a cell defined): its own methods' compiled code and its bases, the
    same for a cell run again, another for a class edited; a class with no code of its own
    is this one class object alone (`_identity`)."""
    parts = []
    for name, value in sorted(vars(cls).items(), key=lambda item: item[0]):
        functions = [value.fget, value.fset, value.fdel] if isinstance(value, property) \
            else [getattr(value, "__func__", value)]
        parts += [(name, _code_text(f.__code__)) for f in functions if hasattr(f, "__code__")]
    if not parts:
        return _identity(cls)
    bases = [f"{base.__module__}.{base.__qualname__}" for base in cls.__bases__]
    return hashlib.sha1(repr((bases, parts)).encode()).hexdigest()


def _code_text(code: Any) -> tuple:
    """What a code object computes: its bytecode, constants (nested code too) and names."""
    constants = tuple(_code_text(c) if inspect.iscode(c) else repr(c) for c in code.co_consts)
    return code.co_code.hex(), constants, code.co_names, code.co_varnames


def _identity(obj: Any) -> str:
    """A name for this one object, never another's (`id()` is reused once an object is
    collected: a notebook's class edited and defined again took the key of the collected
    one before it, and its first step went unchecked, as agreed)."""
    found = record.kept(obj, "identity")
    if found is None:
        found = uuid.uuid4().hex
        record.keep(obj, "identity", found)
    return found
