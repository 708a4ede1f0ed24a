"""Which Keras `fit`/`evaluate`/`predict`/`predict_on_batch` calls tpu_magic handles:
decided per model.

- While a `%%tpu_train` cell runs, `keras.Model`'s methods dispatch by thread: on the
  thread running the cell they go to the cell's router (a `training.cell.TrainingCell`);
  on any other thread (a panel job, a user's thread) to what `keras.Model` had before.
  Entries are counted process-wide under a lock: the first saves exactly what
  `keras.Model` held (Keras's own methods, or a tracking library's wrapper), the last exit
  puts exactly that back, so overlapping cells on two threads and a patch someone made
  between cells both survive.
- A model a cell ran, built or rewrapped is *adopted*: its instance gets its own methods,
  so in later plain cells it keeps exact any-size `predict`/`evaluate` and a checked `fit`
  (the seeds' workflow: train, then `model.predict(x[:7])` in the next cell). Models
  tpu_magic never touched keep plain Keras everywhere.
- Calls Keras makes from inside a routed call (e.g. `fit`'s validation `evaluate`) pass
  straight through, to what `keras.Model` had before (`keras_method`).
- A call is bound against Keras's own signature, whatever wrapper sits on the class.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from typing import Any, Callable, Iterator, Protocol

import keras

from tpu_magic.core import record
from tpu_magic.core.overrides import overridden

# The *_on_batch methods too: under MirroredStrategy Keras hands each replica the whole batch
# (predict_on_batch then concatenates their outputs: 12 rows in, 96 out on 8 replicas), and
# under JAX's DataParallel a batch the devices do not divide fails (IndivisibleError).
METHODS = ("fit", "evaluate", "predict", "predict_on_batch", "train_on_batch", "test_on_batch")
_MISSING = object()
_local = threading.local()
# Process-wide, under the lock: how many cells are inside `cell`, and what keras.Model's own
# __dict__ held for each method before the first of them (_MISSING: it inherited it).
_lock = threading.Lock()
_entries = 0
_saved: dict[str, Any] = {}


def _keras_own(name: str) -> Any:
    """Keras's own function for a method (its trainer's), skipping any wrapper on the class."""
    for cls in keras.Model.__mro__:
        found = cls.__dict__.get(name)
        if found is not None and getattr(found, "__module__", "").startswith("keras."):
            return found
    return getattr(keras.Model, name)


_SIGNATURE = {name: inspect.signature(_keras_own(name)) for name in METHODS}


class Router(Protocol):
    def route(self, name: str, model: Any, call: dict, named: set) -> Any:
        """Runs `model.<name>` with `call` (every argument, defaults filled in); `named`
        holds the arguments the user gave."""


def keras_method(name: str) -> Any:
    """What runs `keras.Model.<name>` for tpu_magic and for the calls it does not route:
    what the class held before the cells patched it (a tracking library's wrapper stays in
    the chain), or, with no cell running, what it holds now."""
    saved = _saved.get(name, _MISSING)
    if saved is _MISSING:
        return getattr(keras.Model, name)
    return saved if saved is not None else _keras_inherited(name)


def _keras_inherited(name: str) -> Any:
    for cls in keras.Model.__mro__[1:]:
        if name in cls.__dict__:
            return cls.__dict__[name]
    return _keras_own(name)


def _dispatching(name: str):
    def method(model, *args, **kwargs):
        router = None if getattr(_local, "inside", 0) else (
            getattr(_local, "cell", None) or _router_of(model))
        if router is None:
            return keras_method(name)(model, *args, **kwargs)
        bound = _SIGNATURE[name].bind(model, *args, **kwargs)
        named = set(bound.arguments)
        bound.apply_defaults()
        call = dict(bound.arguments)
        call.pop("self")
        call.update(call.pop("kwargs", {}))
        return router.route(name, model, call, named)

    own = _keras_own(name)
    method.__name__, method.__doc__, method.__wrapped__ = name, own.__doc__, own
    return method


_DISPATCH = {name: _dispatching(name) for name in METHODS}


@contextlib.contextmanager
def cell(router: Router) -> Iterator[None]:
    """`router` takes every call on this thread while the cell runs."""
    previous = getattr(_local, "cell", None)
    _local.cell = router
    try:
        with _dispatched():
            yield
    finally:
        _local.cell = previous


@contextlib.contextmanager
def _dispatched() -> Iterator[None]:
    """`keras.Model`'s methods dispatch (`_dispatching`) while inside: counted process-wide,
    the first entry saves what the class held and the last exit puts it back."""
    global _entries
    with _lock:
        if _entries == 0:
            for name in METHODS:
                held = keras.Model.__dict__.get(name, _MISSING)
                _saved[name] = None if held is _MISSING else held
                setattr(keras.Model, name, _DISPATCH[name])
        _entries += 1
    try:
        yield
    finally:
        with _lock:
            _entries -= 1
            if _entries == 0:
                for name in METHODS:
                    held = _saved.pop(name)
                    if held is None:
                        delattr(keras.Model, name)
                    else:
                        setattr(keras.Model, name, held)


@contextlib.contextmanager
def inside_keras() -> Iterator[None]:
    """While tpu_magic runs Keras's own method: Keras's inner calls pass straight through."""
    _local.inside = getattr(_local, "inside", 0) + 1
    try:
        yield
    finally:
        _local.inside -= 1


def adopt(model: Any, router: Router) -> None:
    """From now on, outside cells too, the model's `fit`/`evaluate`/`predict` go to `router`.

    Where the model's class overrides a method (a KerasHub task's `fit` turns strings into
    token batches, then calls `super().fit`), the instance's method runs that override, and
    the Keras method it calls goes to the router: the override is never skipped.
    """
    record.of(model).router = router
    for name in METHODS:
        own = _overriding(type(model), name)
        method = _DISPATCH[name] if own is None else _through(own)
        record.install(model, name, types.MethodType(method, model))


def _overriding(cls: type, name: str) -> Any:
    """The class's own `name` where a subclass of `keras.Model` overrides Keras's; None
    where the class runs Keras's."""
    for klass in cls.__mro__:
        if klass is keras.Model:
            return None
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def _through(override: Callable[..., Any]) -> Callable[..., Any]:
    """`override`, run with `keras.Model`'s methods dispatching: its `super()` call is routed."""
    def method(model, *args, **kwargs):
        with _dispatched():
            return override(model, *args, **kwargs)

    method.__name__, method.__doc__, method.__wrapped__ = \
        override.__name__, override.__doc__, override
    return method


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

    with contextlib.ExitStack() as stack:
        for name in GUARDED:
            stack.enter_context(overridden(model, name, refusing(name)))
        yield


def adopted(model: Any) -> bool:
    return _router_of(model) is not None


def _router_of(model: Any) -> Any:
    found = record.find(model)
    return None if found is None else found.router
