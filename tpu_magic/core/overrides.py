"""An attribute of one object (a model's method, say) replaced while a call runs, and put
back as it was: the object's own value where it had one, else the class's again."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


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
