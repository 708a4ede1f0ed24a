"""An attribute replaced while a call runs, and put back as it was: one object's (a model's
method: `overridden`; the object's own value where it had one, else the class's again), or
a module's, process-wide, while any call is inside (`ProcessSwap`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def overridden(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.<name>` is `value` inside, on the object alone (not its class)."""
    before = owner.__dict__.get(name, _NONE)
    object.__setattr__(owner, name, value)
    try:
        yield
    finally:
        if before is _NONE:
            owner.__dict__.pop(name, None)
        else:
            object.__setattr__(owner, name, before)


_NONE = object()  # the object had no value of its own


class ProcessSwap:
    """A module's attribute replaced process-wide while any of tpu_magic's calls is inside
    `during()`: the first to enter puts the replacement in (made from the module's own
    value), the last to leave puts the module's own back, counted under a lock (cells may
    run on two threads at once, and a framework may call the attribute from threads of its
    own, where nothing thread-local would reach).

    Args:
        module: the module, asked for when first entered (its framework is imported then).
        name: the attribute.
        make: the replacement, from the module's own value.
    """

    def __init__(self, module: Callable[[], Any], name: str,
                 make: Callable[[Any], Any]) -> None:
        self.module, self.name, self.make = module, name, make
        self._lock = threading.Lock()
        self._inside = 0
        self._own: Any = None

    @contextlib.contextmanager
    def during(self) -> Iterator[None]:
        module = self.module()
        with self._lock:
            if self._inside == 0:
                self._own = getattr(module, self.name)
                setattr(module, self.name, self.make(self._own))
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    setattr(module, self.name, self._own)

    @property
    def own(self) -> Any:
        """The module's own value, while the replacement is in."""
        return self._own


@contextlib.contextmanager
def without(owner: Any, names: Any) -> Iterator[None]:
    """`owner`'s own values of `names` (methods installed on it) taken off inside, so its
    class's run, and put back after."""
    saved = [(name, owner.__dict__.pop(name)) for name in names
             if name in getattr(owner, "__dict__", {})]
    try:
        yield
    finally:
        for name, value in saved:
            object.__setattr__(owner, name, value)
