"""The state Keras's JAX loop hands back to the model after each step, kept untracked.

After every execution Keras's JAX `fit`, `evaluate` and `predict` set `model._jax_state = {...}`
(the step's new weights, optimizer slots and metrics, for a callback that syncs them). Set on
a Keras layer, a dict is tracked: wrapped in a `TrackedDict`, each of its lists in a
`TrackedList`, every value looked at, a walk as long as the model's state every step. For a
small model that walk is the largest single cost of Keras's loop on the host. It holds JAX
arrays only (nothing to track), so while tpu_magic runs a call the model hands it over as a
read-only mapping, which Keras's tracker leaves as it is; Keras reads it back the same way
(`.get`, `[...]`, truth).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from tpu_magic.core.overrides import overridden

_NAME = "_jax_state"


@contextlib.contextmanager
def untracked(model: Any) -> Iterator[None]:
    """While a call runs: the model's `_jax_state` stored as a `HandedState`, untracked."""
    own = model._setattr_hook  # the class's hook (Keras's backends may have one)

    def hook(name: str, value: Any) -> tuple[str, Any]:
        name, value = own(name, value)
        if name == _NAME and type(value) is dict:
            return name, HandedState(value)
        return name, value

    with overridden(model, "_setattr_hook", hook):
        yield


class HandedState(Mapping):
    """A step's state by group name, read-only (a mapping, not a dict: Keras's tracker wraps
    dicts, lists and tuples, and leaves other values as they are)."""

    def __init__(self, groups: dict[str, Any]) -> None:
        self._groups = groups

    def __getitem__(self, name: str) -> Any:
        return self._groups[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)
