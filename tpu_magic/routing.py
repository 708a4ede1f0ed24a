"""Which Keras `fit`/`evaluate`/`predict` calls tpu_magic handles: decided per model.

- While a `%%tpu_train` cell runs, `keras.Model`'s three methods dispatch by thread: on the
  thread running the cell they go to the cell's router (a `train.TrainingCell`); on any
  other thread (a panel job, a user's thread) to Keras's own. The class is restored when the
  cell ends, also on error.
- A model a cell ran, built or rewrapped is *adopted*: its instance gets its own three
  methods, so in later plain cells it keeps exact any-size `predict`/`evaluate` and a checked
  `fit` (the seeds' workflow: train, then `model.predict(x[:7])` in the next cell). Models
  tpu_magic never touched keep plain Keras everywhere.
- Calls Keras makes from inside a routed call (e.g. `fit`'s validation `evaluate`) pass
  straight through to Keras.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from typing import Any, Callable, Iterator, Protocol

import keras

# predict_on_batch too: under MirroredStrategy Keras hands each replica the whole batch and
# concatenates their outputs (12 rows in, 96 out on 8 replicas). train_on_batch and
# test_on_batch give one device's numbers there (each replica's share is the whole batch).
METHODS = ("fit", "evaluate", "predict", "predict_on_batch")
ORIGINAL = {name: getattr(keras.Model, name) for name in METHODS}
_SIGNATURE = {name: inspect.signature(method) for name, method in ORIGINAL.items()}
_ADOPTED = "_tpu_magic_router"
_local = threading.local()


class Router(Protocol):
    def route(self, name: str, model: Any, call: dict, named: set) -> Any:
        """Runs `model.<name>` with `call` (every argument, defaults filled in); `named`
        holds the arguments the user gave."""


def _dispatching(name: str):
    original = ORIGINAL[name]

    def method(model, *args, **kwargs):
        if getattr(_local, "inside", 0):
            return original(model, *args, **kwargs)
        router = getattr(_local, "cell", None) or model.__dict__.get(_ADOPTED)
        if router is None:
            return original(model, *args, **kwargs)
        bound = _SIGNATURE[name].bind(model, *args, **kwargs)
        named = set(bound.arguments)
        bound.apply_defaults()
        call = dict(bound.arguments)
        call.pop("self")
        call.update(call.pop("kwargs", {}))
        return router.route(name, model, call, named)

    method.__name__, method.__doc__, method.__wrapped__ = name, original.__doc__, original
    return method


_DISPATCH = {name: _dispatching(name) for name in METHODS}


@contextlib.contextmanager
def cell(router: Router) -> Iterator[None]:
    """`router` takes every call on this thread while the cell runs."""
    previous = getattr(_local, "cell", None)
    _local.cell = router
    for name in METHODS:
        setattr(keras.Model, name, _DISPATCH[name])
    try:
        yield
    finally:
        _local.cell = previous
        if previous is None:
            for name, original in ORIGINAL.items():
                setattr(keras.Model, name, original)


@contextlib.contextmanager
def inside_keras() -> Iterator[None]:
    """While tpu_magic runs Keras's own method: Keras's inner calls pass straight through."""
    _local.inside = getattr(_local, "inside", 0) + 1
    try:
        yield
    finally:
        _local.inside -= 1


def adopt(model: Any, router: Router) -> None:
    """From now on, outside cells too, the model's `fit`/`evaluate`/`predict` go to `router`."""
    object.__setattr__(model, _ADOPTED, router)
    for name in METHODS:
        object.__setattr__(model, name, types.MethodType(_DISPATCH[name], model))


# What a plain cell must not call on a model a background job is training: each would read
# or change weights mid-step (compile would also replace the job's train function).
GUARDED = ("fit", "evaluate", "predict", "compile", "train_on_batch", "test_on_batch",
           "predict_on_batch", "set_weights", "load_weights", "save_weights", "save")


@contextlib.contextmanager
def guarded(model: Any, refusal: Callable[[str], Exception],
            owner: threading.Thread) -> Iterator[None]:
    """While a job trains `model` on the `owner` thread, other threads' calls of the
    `GUARDED` methods raise `refusal("model.NAME")`; the job's own calls (and Keras's from
    inside them, e.g. fit's validation `evaluate`) pass.

    The instance's own attributes (an adopted model's methods) are restored exactly.
    """
    saved = {name: model.__dict__[name] for name in GUARDED if name in model.__dict__}

    def refusing(name: str):
        def method(*args, **kwargs):
            if threading.current_thread() is owner:
                allowed = saved.get(name) or getattr(type(model), name).__get__(model)
                return allowed(*args, **kwargs)
            raise refusal(f"model.{name}")

        return method

    for name in GUARDED:
        object.__setattr__(model, name, refusing(name))
    try:
        yield
    finally:
        for name in GUARDED:
            if name in saved:
                object.__setattr__(model, name, saved[name])
            else:
                model.__dict__.pop(name, None)


def adopted(model: Any) -> bool:
    return getattr(model, "__dict__", {}).get(_ADOPTED) is not None
