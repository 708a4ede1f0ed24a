"""Rebuilding a model made outside the distribution strategy inside it.

Keras's own rule (backend/tensorflow/trainer.py): "Model must be created under
scope of DistStrat it will be trained with"; `fit` in the scope on a model built outside
fails (a bare AssertionError, "Mixing different tf.distribute.Strategy objects", or
"colocate_vars_with must only be passed a variable created in this
tf.distribute.Strategy.scope()"). So variables are not moved: the model is rebuilt from
its config inside the scope, weights copied, and compiled anew from its compile config (a
new optimizer; the old object cannot be reused).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, MutableMapping

import keras

from tpu_magic.core import random_state, variables
from tpu_magic.core.errors import RewrapError, TpuMagicError
from tpu_magic.core.variables import names_of


@dataclass(frozen=True)
class Rewrapped:
    """One model rebuilt inside the strategy, and the names that now point at it."""

    names: tuple[str, ...]
    old: Any
    new: Any
    optimizer_state_copied: bool
    parts: tuple[str, ...] = ()  # names of its layers and inner models, rebound to the new ones
    placed: bool = False  # its variables moved onto the devices (JAX): the same object

    def summary(self, strategy_name: str, replicas: int) -> str:
        what = "model" if isinstance(self.old, keras.Model) else "layer"
        if self.placed:
            return (f"`{self.names[0]}` was built outside {strategy_name}: its variables now "
                    f"live on the {replicas} device{'s' * (replicas != 1)}, laid out for it "
                    f"(the same {what}, its weights and state as they were).")
        if self.new is self.old:
            return (f"`{self.names[0]}` was compiled outside {strategy_name} and has no weights "
                    "yet: compiled again inside it (same compile settings); its weights will be "
                    f"made for {replicas} replica{'s' * (replicas != 1)} when it first runs.")
        state = ", optimizer state" if self.optimizer_state_copied else ""
        also = f" (also named {', '.join(f'`{n}`' for n in self.names[1:])})" if self.names[1:] else ""
        parts = (f" Its parts {', '.join(f'`{n}`' for n in self.parts)} now point at the new "
                 "model's, so they stay one model with it." if self.parts else "")
        return (
            f"`{self.names[0]}`{also} was built outside {strategy_name}: "
            f"rebuilt inside it for {replicas} replica{'s' * (replicas != 1)} (same weights{state} "
            "and compile settings); the name now points at the new model." + parts
        )


def built_outside(model: Any, connection: Any) -> bool:
    """True when the model belongs to another strategy (or to none) than the connection's."""
    return connection.backend.built_outside(model, connection.strategy)


def built_for(model: Any, connection: Any) -> bool:
    """True when the model was built for the connection's strategy: it has variables, all
    made for it."""
    return connection.backend.built_for(model, connection.strategy)


def custom_objects_from(namespace: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """Functions and classes a notebook defined, so a custom loss or layer deserializes.

    A notebook layer whose `__init__` takes no `**kwargs` (the keras-io pattern) gets a
    tolerant constructor in its place (see `TolerantLayer`).
    """
    found = {
        name: TolerantLayer.wrap(obj) for name, obj in namespace.items()
        if not name.startswith("_") and isinstance(obj, (types.FunctionType, type))
    }
    loss = getattr(model, "loss", None)
    if isinstance(loss, types.FunctionType):
        found[loss.__name__] = loss
    return found


class TolerantLayer:
    """Rebuilds a notebook layer from Keras's automatic config when its `__init__` takes no
    `**kwargs` and it has no `get_config`/`from_config` of its own.

    Keras 3 records the constructor's arguments and adds `name`, `trainable` and `dtype`;
    `cls(**config)` then fails with a TypeError. Here only the arguments the constructor
    accepts are passed, and `trainable` and the dtype policy are set afterwards.
    """

    def __init__(self, cls: type):
        self.cls = cls
        self.__name__ = cls.__name__
        self.accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}

    @classmethod
    def wrap(cls, obj: Any) -> Any:
        if not (isinstance(obj, type) and issubclass(obj, keras.layers.Layer)) or \
                obj.from_config.__func__ is not keras.layers.Layer.from_config.__func__:
            return obj
        parameters = inspect.signature(obj.__init__).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return obj
        return cls(obj)

    def from_config(self, config: dict) -> Any:
        layer = self.cls(**{k: v for k, v in config.items() if k in self.accepted})
        if "trainable" in config and "trainable" not in self.accepted:
            layer.trainable = config["trainable"]
        if "dtype" in config and "dtype" not in self.accepted and config["dtype"] is not None:
            layer.dtype_policy = keras.dtype_policies.deserialize(config["dtype"]) \
                if isinstance(config["dtype"], dict) else keras.dtype_policies.get(config["dtype"])
        return layer


def rewrap(model: Any, connection: Any, custom_objects: Mapping[str, Any],
           label: str | None = None) -> tuple[Any, bool]:
    """Clones `model` inside the connection's strategy with the same weights and compile
    settings.

    Args:
        label: the user's name for the model (messages name it), else Keras's name.

    Returns:
        (the new model, whether the optimizer's state was copied too).

    Raises:
        RewrapError: the model cannot be cloned (e.g. a subclassed model).
    """
    name = label or getattr(model, "name", type(model).__name__)
    strategy = connection.strategy
    optimizer_state = variables.optimizer_state(model, connection.backend)
    # Variables of another strategy can only be read inside that strategy's scope.
    with connection.backend.reading(model):
        weights = model.get_weights() if model.built else []
        compile_config = model.get_compile_config() if model.compiled else None
        try:
            config = model.get_config() if _is_graph_model(model) else None
        except NotImplementedError as exc:  # a layer with unserializable constructor arguments
            raise RewrapError(f"model {name!r} was built outside the strategy and cannot be "
                              f"rebuilt inside it: "
                              f"{unbuildable(exc, ', or build the model inside the %%tpu_train cell')}"
                              ) from None
    if config is None and not model.weights:
        # No weights to move (a subclassed model before its first call): only its optimizer
        # and metrics were made outside, and compiling again inside the strategy remakes them.
        return model, compile_again(model, connection, custom_objects)
    if config is None:
        raise RewrapError(
            f"model {name!r} ({type(model).__name__}) was built outside the strategy and "
            "cannot be rebuilt inside it (only Sequential and functional models can be cloned). "
            "Build it inside a %%tpu_train cell, where models are created for the strategy."
        )
    with keras.saving.custom_object_scope(dict(custom_objects)), strategy.scope():
        try:
            new = model.__class__.from_config(config)
        except (TypeError, ValueError) as exc:
            raise RewrapError(f"model {name!r} was built outside the strategy and cannot be "
                              f"rebuilt inside it: "
                              f"{unbuildable(exc, ', or build the model inside the %%tpu_train cell')}"
                              ) from None
        if weights:
            new.set_weights(weights)
        if compile_config:
            new.compile_from_config(compile_config)  # a new optimizer from the old one's config
        copied = _restore_optimizer_state(new, optimizer_state)
    return new, copied


def compile_again(model: Any, connection: Any, custom_objects: Mapping[str, Any]) -> bool:
    """A model whose optimizer and metrics were made outside the strategy (compiled in a
    plain cell), compiled again inside it from its compile config, the optimizer's state
    copied over. Returns whether there was state to copy."""
    state = variables.optimizer_state(model, connection.backend)
    with keras.saving.custom_object_scope(dict(custom_objects)), connection.strategy.scope():
        if model.compiled:
            model.compile_from_config(model.get_compile_config())
        return _restore_optimizer_state(model, state)


def rebuilt_layer(layer: Any, connection: Any, custom_objects: Mapping[str, Any],
                  label: str) -> Any:
    """A layer made (or adapted) outside the strategy, made again inside it from its
    config and build config, with its weights (an adapted `Normalization`'s statistics).

    Raises:
        RewrapError: the layer cannot be rebuilt from its config.
    """
    with connection.backend.reading(layer):
        weights = layer.get_weights()
    try:
        with keras.saving.custom_object_scope(dict(custom_objects)), \
                connection.strategy.scope():
            new = type(layer).from_config(layer.get_config())
            build = layer.get_build_config()
            if build:
                new.build_from_config(build)
            new.set_weights(weights)
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise RewrapError(f"layer {label!r} was made outside the strategy and cannot be made "
                          f"again inside it: "
                          f"{unbuildable(exc, ', or make it inside the %%tpu_train cell')}"
                          ) from None
    return new


def made_outside(model: Any, moved: list, namespace: Mapping[str, Any]) -> list[str]:
    """The parts of `model` whose variables were made outside the distribution (`moved`),
    outermost first, each by its notebook name where it has one: "`norm`
    (Normalization)", "layer 'dense_3' (Dense)", "its optimizer's state"."""
    moved_ids = {id(v) for v in moved}
    found, inside = [], set()
    for layer in model._flatten_layers(include_self=False):
        own = [id(v) for v in layer.variables]
        if id(layer) in inside or not own or not all(i in moved_ids for i in own):
            continue
        inside.update(id(inner) for inner in layer._flatten_layers(include_self=False))
        names = names_of(namespace, layer)
        found.append(f"`{names[0]}` ({type(layer).__name__})" if names
                     else f"layer {layer.name!r} ({type(layer).__name__})")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and any(id(v) in moved_ids for v in optimizer.variables):
        found.append("its optimizer's state")
    return found


def unbuildable(exc: BaseException, instead: str = "") -> str:
    """Why Keras could not rebuild a model from its config, and the fix, for a message
    (`instead`: another way out, e.g. ", or build the model inside the cell")."""
    text = str(exc).strip()
    if "<class '" in text:  # "<class '__main__.Block'> could not be deserialized properly"
        layer = text.split("<class '")[1].split("'>")[0].rsplit(".", 1)[-1]
        why = "its constructor does not take the config Keras recorded for it"
    elif text.startswith("Object ") and " was created by passing" in text:
        layer = text.split()[1]
        why = "its constructor was given values Keras cannot serialize"
    else:
        layer = None
    if layer:
        return (f"its layer class {layer} cannot be rebuilt from a config: {why}. Give {layer} "
                "a get_config() that returns its constructor's arguments and let __init__ take "
                f"**kwargs (passing them to super().__init__){instead}")
    return (f"{text.splitlines()[0] if text else type(exc).__name__}. Give its custom layers a "
            f"get_config() that returns their constructor's arguments{instead}")


def _is_graph_model(model: Any) -> bool:
    """Sequential and functional models rebuild from their config; subclassed ones may not."""
    return isinstance(model, keras.Sequential) or type(model).__name__ == "Functional"


def _restore_optimizer_state(new: Any, state: list | None) -> bool:
    optimizer = getattr(new, "optimizer", None)
    if optimizer is None or state is None:
        return False
    if not optimizer.built:
        optimizer.build(new.trainable_variables)
    variables = optimizer.variables
    if len(variables) != len(state) or any(tuple(v.shape) != a.shape for v, a in zip(variables, state)):
        return False
    for variable, value in zip(variables, state):
        variable.assign(value)
    return True


def rewrap_namespace(
    namespace: MutableMapping[str, Any], names: Iterable[str], connection: Any
) -> list[Rewrapped]:
    """Rewraps every model among `names` built outside the connection's strategy, rebinding
    all names.

    Every name in the namespace that pointed at an old model points at its new one.
    """
    done: list[Rewrapped] = []
    outside = [name for name in sorted(names)
               if isinstance(namespace.get(name), keras.layers.Layer)
               and namespace[name].weights and built_outside(namespace[name], connection)]
    # A model that holds others (a classifier on a base model) first: its parts are rebound to
    # the new model's parts, so the family stays one (unfreezing `base` later changes the
    # model that trains), and none of them is rebuilt on its own.
    outside.sort(key=lambda name: -len(list(namespace[name]._flatten_layers())))
    for name in outside:
        model = namespace[name]
        if not built_outside(model, connection) or _rebound(model, done):
            continue
        rebound = tuple(names_of(namespace, model))
        if connection.backend.place(model, connection) is not None:  # moved where it is
            done.append(Rewrapped(rebound, model, model, True, placed=True))
            continue
        if isinstance(model, keras.Model):
            new, copied = rewrap(model, connection, custom_objects_from(namespace, model),
                                 label=name)
        else:
            new, copied = rebuilt_layer(model, connection, custom_objects_from(namespace, model),
                                        label=name), False
        for key in rebound:
            namespace[key] = new
        parts = _rebind_parts(namespace, model, new) if new is not model else ()
        done.append(Rewrapped(rebound, model, new, copied, parts))
    return done


def rewrap_for_cell(namespace: MutableMapping[str, Any], names: Iterable[str], connection: Any
                    ) -> tuple[list[Rewrapped], str | None]:
    """`rewrap_namespace` for a cell about to run: what it rewrapped, and where its own work
    failed (not a refusal the user must act on) a note saying what was skipped; the cell
    then runs, and a call of a model still made outside runs as plain Keras.

    Raises:
        RewrapError: a model that cannot be rebuilt, named with the fix.
    """
    try:
        with random_state.kept():  # the rebuilt models' draws: the notebook's stay its own
            return rewrap_namespace(namespace, names, connection), None
    except TpuMagicError:
        raise
    except Exception as exc:  # noqa: BLE001 - tpu_magic's own step: a note, never an error
        return [], (f"tpu_magic skipped rebuilding the models made outside "
                    f"{connection.strategy_name} ({type(exc).__name__}: {exc})")


def _rebound(model: Any, done: list[Rewrapped]) -> bool:
    """Whether `model` is a part of a model already rebuilt (its names moved with it)."""
    return any(model is layer for d in done for layer in d.old._flatten_layers())


def _rebind_parts(namespace: MutableMapping[str, Any], old: Any, new: Any) -> tuple[str, ...]:
    """Points every name of one of `old`'s layers (an inner model included) at `new`'s layer
    in the same place. Returns the names rebound."""
    pairs = {}
    for before, after in zip(old._flatten_layers(include_self=False),
                             new._flatten_layers(include_self=False)):
        if type(before) is type(after) and before.name == after.name:
            pairs[id(before)] = after
    rebound = []
    for key, value in list(namespace.items()):
        if not key.startswith("_") and id(value) in pairs:
            namespace[key] = pairs[id(value)]
            rebound.append(key)
    return tuple(sorted(rebound))


def place_model(model: Any, connection: Any, namespace: Mapping[str, Any], label: str) -> str:
    """A model the cell reaches with variables made elsewhere (a layer adapted in an earlier
    cell, an optimizer compiled in a plain cell): moved onto the devices where the backend
    can move variables (JAX), compiled again inside the strategy where only its optimizer
    was made outside. Returns what to say.

    Raises:
        RewrapError: variables that cannot move, named with the parts made outside.
    """
    moved = connection.backend.place(model, connection)
    if moved is not None:
        parts = made_outside(model, moved, namespace)
        devices = len(connection.devices) or connection.replicas
        return (f"model {label!r} reached this cell with parts made outside "
                f"{connection.strategy_name}: {', '.join(parts) or 'its variables'} now live "
                f"on its {devices} device{'s' * (devices != 1)} (the same objects).")
    outside = connection.backend.outside_variables(model, connection.strategy)
    if model.compiled and not ({id(v) for v in outside} & {id(v) for v in model.weights}):
        compile_again(model, connection, custom_objects_from(namespace, model))
        return (f"model {label!r} was compiled outside {connection.strategy_name}: compiled "
                "again inside it, with the same settings.")
    raise _unnamed(label, made_outside(model, outside, namespace), connection)


def _unnamed(label: str, parts: list[str], connection: Any) -> RewrapError:
    if not parts:
        return RewrapError(
            f"model {label!r} was built outside {connection.strategy_name}, and this "
            "cell reaches it without naming it. Name it in the cell (tpu_magic rebuilds the "
            "models a cell names) or build it inside the %%tpu_train cell.")
    return RewrapError(
        f"model {label!r} uses {', '.join(parts)}, made outside "
        f"{connection.strategy_name}, whose variables cannot move into it. Name "
        f"{'it' if len(parts) == 1 else 'them'} in the %%tpu_train cell (tpu_magic makes the "
        "layers and models a cell names again inside the strategy, weights included), or "
        "make (and adapt) it inside the cell.")
