"""A failure injected into one step tpu_magic adds to a cell, for the tests of issue 50's rule:
whatever tpu_magic adds (the first-step check, the memory plan, FLOPs counting, the end-of-cell
namespace pass, rewraps, the report) may add a note, never an error.

A step is reached either through the backend object (`connection.backend`: its methods are
the protocol, and stay where they are when `tpu_magic/training/` is reorganised) or through a
function or class of `tpu_magic.training`, found by its name in whichever module of that
package defines it now (`defining`), so a test keeps patching the same function when files
move. Each injected function counts its calls: a test checks that the step it broke really
ran, so a patch that no longer reaches anything fails instead of passing vacuously.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable


class Injected(RuntimeError):
    """The failure a test injects (never one a user's code raises)."""


def defining(name: str) -> Any:
    """The module of `tpu_magic.training` (any depth) that defines `name` itself (not one that
    imports it). Raises LookupError naming what was searched when none does."""
    import tpu_magic.training as training

    searched = []
    for info in pkgutil.walk_packages(training.__path__, training.__name__ + "."):
        module = importlib.import_module(info.name)
        searched.append(info.name)
        value = getattr(module, name, None)
        if value is not None and getattr(value, "__module__", None) == module.__name__:
            return module
    raise LookupError(f"no module of tpu_magic.training defines {name!r} (searched "
                      f"{', '.join(searched)})")


def failing(calls: list, what: str) -> Callable[..., Any]:
    """A function that records its call in `calls` and raises `Injected`."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        calls.append(what)
        raise Injected(f"injected into {what} by the test")

    return fail


def inject(monkeypatch: Any, owner: Any, attribute: str, calls: list, what: str) -> str:
    """Replaces `owner.attribute` (a class's method, or a module's function) with a failing
    one for the test. Returns its full name, for the failure message."""
    getattr(owner, attribute)  # it must exist: a renamed step fails the test loudly
    monkeypatch.setattr(owner, attribute, failing(calls, what))
    return f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', owner.__name__)}" \
           f".{attribute}" if isinstance(owner, type) else f"{owner.__name__}.{attribute}"
