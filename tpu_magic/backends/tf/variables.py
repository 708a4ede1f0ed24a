"""A model's variables under `tf.distribute`: which strategy they belong to, those made
outside it, their replicas' values, and the CPU for a copy. A variable belongs to the
strategy it was made in: nothing moves."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tpu_magic.core.deps import require_tensorflow
from tpu_magic.core.errors import ConnectError
from tpu_magic.core.session import Connection
from tpu_magic.core.variables import variables_of


def built_outside(model: Any, strategy: Any) -> bool:
    """The model was made in another strategy's scope, or some of its variables were."""
    own = getattr(model, "_distribute_strategy", None)  # Keras sets it when made in a scope
    if own is not None and own is not strategy:
        return True
    return bool(outside_variables(model, strategy))


def outside_variables(model: Any, strategy: Any) -> list:
    return [v for v in variables_of(model)
            if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))]


def place(model: Any, connection: Connection) -> None:
    """Nothing moves: a variable belongs to the strategy it was made in. A model made
    outside every strategy and not built yet (a subclassed model compiled in a plain
    cell) is given this one, so that Keras builds it symbolically inside the strategy
    before its first step, as it does a model made in the scope (otherwise it builds it
    inside a replica's step, which TensorFlow cannot run: "You must feed a value for
    placeholder tensor")."""
    if not model.weights and getattr(model, "_distribute_strategy", None) is None:
        model._distribute_strategy = connection.strategy


def built_for(model: Any, strategy: Any) -> bool:
    if not model.weights:
        return False
    return getattr(model, "_distribute_strategy", None) is strategy and \
        not built_outside(model, strategy)


def reading(model: Any) -> Any:
    """The scope a model's mirrored variables are read in (their own strategy's)."""
    own = getattr(model, "_distribute_strategy", None)
    return own.scope() if own is not None else contextlib.nullcontext()


def replica_values(variable: Any) -> list[Any]:
    variable = getattr(variable, "value", variable)
    return list(getattr(variable, "values", (variable,)))


@contextlib.contextmanager
def on_the_cpu() -> Iterator[None]:
    """The CPU, outside every strategy (a copy built here).

    Raises:
        ConnectError: called inside a strategy's scope (inside %%tpu_train).
    """
    tf = require_tensorflow()
    if tf.distribute.has_strategy():
        raise ConnectError("%tpu_sync builds the CPU copy outside every strategy: run it in "
                           "its own cell, not inside %%tpu_train")
    with tf.device("/cpu:0"):
        yield


def scalars_readable() -> None:
    """A mirrored variable reads as a number outside its strategy, as a plain variable does:
    `float(model.optimizer.learning_rate)` or `int(model.optimizer.iterations)` in a plain
    cell after training (Keras's variable hands `float()` to TensorFlow's, and TensorFlow's
    `DistributedVariable` has none). Its value is the one every replica holds
    (`read_value`). Set on TensorFlow's class once a process, before the first
    MirroredStrategy; a TensorFlow that defines them itself keeps its own."""
    from tensorflow.python.distribute import values

    kind = values.DistributedVariable
    if "__float__" not in kind.__dict__:
        kind.__float__ = lambda self: float(self.read_value())
    if "__int__" not in kind.__dict__:
        kind.__int__ = lambda self: int(self.read_value())
