"""What tpu_magic keeps about a user's objects, in one place: a record an object, kept on the
object in one attribute that only this module reads and writes, so it goes when the object
goes. (A table beside the objects, by identity, kept them all: a record refers to its
model (its programs, the check's jitted step), so no model was ever collected, nor its
compiled programs: each fit of a small model left about 240 memory maps behind, until a
long session's compile failed and the process died of SIGSEGV.) An object that takes no
attribute keeps its record in such a table.

A model's record (`ModelRecord`) holds everything tpu_magic remembers about it between
calls and cells: the generation of its traced functions and the variables they take, the
placements settled for it, the compiled programs and measured steps of its calls, the
router of a model that keeps routing after its cell, its learning rate before
`--scale-lr`. `invalidate` drops every compiled program, kept function, measured step and
settled plan at once, as Keras's own `compile` resets its three functions together. Other
objects (an optimizer, a variable, a distribution) keep a few named values
(`kept`/`keep`).

A method tpu_magic puts on a user's object for good (the exactness overrides of a model's
`compute_loss`, an adopted model's routes, an optimizer's gradient average) is put there
by `install`, which the record lists (`installed`): a copy of the model (`%tpu_sync`)
leaves those out. A method replaced only while a call runs is `core.overrides`'s. These
two modules are the only ones that write a user's object (tests/unit/test_architecture.py).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable


@dataclasses.dataclass(eq=False)
class ModelRecord:
    """What tpu_magic keeps about one model.

    Attributes:
        generation: the generation of its traced functions: a new object at every retrace
            (`invalidate`); a compiled program or kept function of another is stale.
        traced_state: which variables its traced functions take, by identity (None: never
            traced by tpu_magic).
        settled: placements settled for it, by what they hold for (`placement.place`).
        programs: the backend's compiled programs of its calls (JAX: the device loop).
        functions: Keras's traced functions kept by K (TensorFlow), by (generation, K).
        measured: a step's measured times, by kind and batch type.
        router: the router of a model that keeps routing after its cell (None: not adopted).
        exact: the loss tracker the exactness overrides were installed for (None: none).
        real_rows: the real samples' share of the step being traced (exactness), or None.
        base_rate: its learning rate before `--scale-lr` (None: never scaled).
        reference: the first-step check's one-device step and its compile (JAX), made
            before the fit's first step (`backends.jax.parity`).
        installed: the methods installed on it, by name (`install`).
        beside: the compiles started beside its steps and not yet waited for (JAX,
            `backends.jax.beside`): a call waits for them before it ends.
        last_fit: its last `fit` as a `%%tpu_train` cell made it (`training.cell.FitCall`,
            which the panel's Train repeats): kept here, with the model, so that the
            notebook's workspace can hold the model weakly.
    """

    generation: object = dataclasses.field(default_factory=object)
    traced_state: tuple | None = None
    settled: dict = dataclasses.field(default_factory=dict)
    programs: Any = None
    functions: dict = dataclasses.field(default_factory=dict)
    measured: dict = dataclasses.field(default_factory=dict)
    router: Any = None
    exact: Any = None
    real_rows: Any = None
    base_rate: float | None = None
    reference: Any = None
    installed: dict = dataclasses.field(default_factory=dict)
    beside: list = dataclasses.field(default_factory=list)
    last_fit: Any = None


class _Table:
    """Records on their objects, as the attribute `name` (a record and its object form a
    cycle Python's collector frees together); for an object that takes no attribute, by
    its identity in a table, dropped when it is collected (a variable is not hashable, so
    no `WeakKeyDictionary`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._records: dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, obj: Any, make: Callable[[], Any] | None = None) -> Any:
        with self._lock:
            own = getattr(obj, "__dict__", None)
            if isinstance(own, dict):
                found = own.get(self._name)
                if found is None and make is not None:
                    found = make()
                    object.__setattr__(obj, self._name, found)
                return found
            key = id(obj)
            found = self._records.get(key)
            if found is None and make is not None:
                found = self._records[key] = make()
                weakref.finalize(obj, self._records.pop, key, None)
            return found


_MODELS = _Table("_tpu_magic_record")
_OTHERS = _Table("_tpu_magic_kept")  # an optimizer's, a variable's, a distribution's values
# the attributes records are kept in: a copy of a user's object (`%tpu_sync`) leaves them out
ATTRIBUTES = ("_tpu_magic_record", "_tpu_magic_kept")


def of(model: Any) -> ModelRecord:
    """The model's record, made on first use."""
    return _MODELS.get(model, ModelRecord)


def find(model: Any) -> ModelRecord | None:
    """The model's record, where tpu_magic keeps one (None: it never ran the model)."""
    return _MODELS.get(model)


def invalidate(model: Any) -> ModelRecord:
    """A new generation of the model's functions: every compiled program, kept function,
    measured step and settled placement of the old one dropped at once, and Keras's own
    functions too (they would run without what changed)."""
    record = of(model)
    record.generation = object()
    record.programs = None
    record.functions = {}
    record.measured = {}
    record.settled = {}
    record.reference = None
    model.train_function = model.test_function = model.predict_function = None
    return record


def kept(obj: Any, key: str, default: Any = None) -> Any:
    """A value tpu_magic keeps about an object that is not a model (`keep`)."""
    values = _OTHERS.get(obj)
    return default if values is None else values.get(key, default)


def keep(obj: Any, key: str, value: Any) -> None:
    _OTHERS.get(obj, dict)[key] = value


def install(obj: Any, name: str, value: Any) -> None:
    """Puts `value` on the object as its own `name` for good (a method override), recorded
    on the object's record (a model's `installed`, another object's `installed` value)."""
    object.__setattr__(obj, name, value)
    _installed(obj)[name] = value


def installed(obj: Any) -> dict:
    """The methods tpu_magic installed on the object, by name (still its own)."""
    record = _MODELS.get(obj)
    found = record.installed if record is not None else kept(obj, "installed", {})
    return {name: value for name, value in found.items()
            if getattr(obj, "__dict__", {}).get(name) is value}


def _installed(obj: Any) -> dict:
    import keras

    if isinstance(obj, keras.Model):
        return of(obj).installed
    values = _OTHERS.get(obj, dict)
    return values.setdefault("installed", {})

