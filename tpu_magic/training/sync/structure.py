"""A trained model copied object by object, for the CPU copy of a model its config does not
describe: layers swapped by attribute (LoRA wrappers set on a KerasHub model), layers of a
notebook's own whose `get_config` leaves out an argument, a subclassed model built from
objects Keras cannot serialize.

Every layer of the model becomes a new object of its class holding copies of its
attributes; every variable a new one, outside every distribution, holding the trained
value; what only training needs (the optimizer, the compiled functions and losses, the
history) is left out, so the copy predicts and can be compiled again. Nothing of the
trained model is shared with the copy.
"""

from __future__ import annotations

import copy
import types
from typing import Any, Callable

import keras
import numpy as np

from tpu_magic.core import record

# What a copy for predicting leaves out of a model (set to None on the copy).
TRAINING_ONLY = ("optimizer", "train_function", "test_function", "predict_function",
                 "_jax_state", "history", "_compile_loss", "_compile_metrics", "loss",
                 "_loss_tracker", "_eval_epoch_iterator", "stop_training",
                 "_distribute_strategy")  # Keras on TensorFlow: the strategy it was built in


def structural_copy(model: Any, values: Callable[[Any], np.ndarray]) -> Any:
    """`model` copied object by object (see the module's docstring); `values(variable)` is a
    variable's trained value as a host array (the mean of its replicas where they differ).
    Call it where the copy's variables are to live (outside every distribution)."""
    memo: dict[int, Any] = {}
    layers = list(model._flatten_layers(include_self=True))
    for layer in layers:
        memo[id(layer)] = object.__new__(type(layer))
    for variable in _variables(layers):
        memo[id(variable)] = keras.Variable(values(variable), dtype=variable.dtype,
                                            trainable=variable.trainable,
                                            name=variable.name)
    for name in TRAINING_ONLY:
        held = model.__dict__.get(name)
        if held is not None and not isinstance(held, (bool, int, float, str)):
            memo[id(held)] = None
    for layer in layers:
        shell = memo[id(layer)]
        # item by item: a temporary dict's id could be one `memo` already holds
        shell.__dict__.update({key: _copied(value, memo)
                               for key, value in _keras_own(layer).items()})
    copied = memo[id(model)]
    for name in TRAINING_ONLY:
        if name in copied.__dict__ and not isinstance(copied.__dict__[name], bool):
            copied.__dict__[name] = None
    copied.__dict__["compiled"] = False
    return copied


def _keras_own(layer: Any) -> dict:
    """A layer's attributes less the methods tpu_magic installed on it (`core.record`: an
    adopted model's routed methods, the exactness override of `compute_loss`, which closes
    over the trained model). The copy is a plain Keras model; nothing of the cell is
    reached through it."""
    ours = {**record.installed(layer), **dict.fromkeys(record.ATTRIBUTES)}
    return {key: value for key, value in layer.__dict__.items() if key not in ours}


def _variables(layers: list) -> list:
    """Every variable the layers hold (weights, the random generators' seeds), once each."""
    found, seen = [], set()
    for layer in layers:
        for variable in layer.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found


def _copied(value: Any, memo: dict[int, Any]) -> Any:
    """A deep copy in which what is shared stays shared (`memo`), modules, functions and
    classes are kept as they are, and arrays become host copies."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                          types.MethodType, type, str, bytes, int, float, bool, complex,
                          type(None))):
        return value
    if isinstance(value, dict):
        found = memo[id(value)] = type(value)() if type(value) is dict else {}
        for key, item in value.items():
            found[key] = _copied(item, memo)
        if type(value) is not dict:
            found = memo[id(value)] = _rebuilt(value, found)
        return found
    if isinstance(value, list):
        found = memo[id(value)] = []
        found.extend(_copied(item, memo) for item in value)
        if type(value) is not list:
            found = memo[id(value)] = _rebuilt(value, found)
        return found
    if isinstance(value, tuple):
        items = [_copied(item, memo) for item in value]
        found = type(value)(*items) if hasattr(value, "_fields") else \
            (tuple(items) if type(value) is tuple else _rebuilt(value, items))
        memo[id(value)] = found
        return found
    if isinstance(value, (set, frozenset)):
        found = type(value)(_copied(item, memo) for item in value)
        memo[id(value)] = found
        return found
    if isinstance(value, np.ndarray):
        memo[id(value)] = value.copy()
        return memo[id(value)]
    if hasattr(value, "__array__") and hasattr(value, "shape") and \
            not isinstance(value, keras.KerasTensor):
        try:
            memo[id(value)] = np.asarray(value).copy()  # a framework's array: a host copy
        except Exception:  # noqa: BLE001 - a framework's handle (a resource): shared
            memo[id(value)] = value
        return memo[id(value)]
    if hasattr(value, "__dict__") and not isinstance(value, keras.Variable):
        try:
            shell = object.__new__(type(value))  # its own kind (no __reduce__: no config)
        except TypeError:  # a framework's own object (a sharding, a device): shared
            memo[id(value)] = value
            return value
        memo[id(value)] = shell
        shell.__dict__.update({key: _copied(item, memo)
                               for key, item in value.__dict__.items()
                               if key not in record.ATTRIBUTES})
        return shell
    try:  # with the same memo: what it holds of the model maps to the copy's
        found = copy.deepcopy(value, memo)
    except Exception:  # noqa: BLE001 - what cannot be copied (a lock, a handle) is shared
        found = value
    memo[id(value)] = found
    return found


def _rebuilt(value: Any, items: Any) -> Any:
    """A container of a class of its own (Keras's tracked lists and dicts) holding `items`,
    filled through the base type's methods (the class's own would track them again, and a
    built layer's tracker refuses); a wrapper that only tracks for its framework
    (TensorFlow's `_DictWrapper`, `ListWrapper`) becomes the plain container."""
    try:
        shell = type(value).__new__(type(value))
        if isinstance(items, dict) and type(shell).__mro__[1:2] == (dict,) or \
                isinstance(shell, dict) and dict in type(shell).__mro__:
            dict.update(shell, items)
        elif list in type(shell).__mro__:
            list.extend(shell, items)
        else:
            return items
        if hasattr(value, "__dict__"):
            shell.__dict__.update(value.__dict__)
        return shell
    except (TypeError, AttributeError):
        return items
