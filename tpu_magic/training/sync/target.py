"""Which model `%tpu_sync` copies and the copy's name, told before anything heavy is
imported: `%tpu_sync` with nothing trained answers at once."""

from __future__ import annotations

import keyword
import sys
from typing import Any, Mapping

from tpu_magic.core.errors import SyncError
from tpu_magic.core.variables import name_of


def choose_model(namespace: Mapping[str, Any], name: str | None,
                 last_model: Any = None, last_name: str | None = None) -> tuple[str, Any]:
    """The model to sync: `name` from the namespace, else the one trained last.

    Raises:
        SyncError: nothing trained yet, an unknown name, or a name that is not a Keras model.
    """
    if name is None:
        if last_model is None:
            raise SyncError(
                "nothing trained yet: run a %%tpu_train cell that calls fit, or name the model "
                "to copy, e.g. `%tpu_sync model`"
            )
        return name_of(namespace, last_model, preferred=last_name) or "model", last_model
    if name not in namespace:
        raise SyncError(f"no variable named {name!r} in the notebook: name a Keras model, "
                        "or leave MODEL out to copy the model trained last")
    model = namespace[name]
    keras = sys.modules.get("keras")  # no keras imported: nothing can be a Keras model yet
    if keras is None or not isinstance(model, keras.Model):
        raise SyncError(f"{name!r} is a {type(model).__name__}, not a Keras model: name the "
                        "model to copy, e.g. `%tpu_sync model`")
    return name, model


def copy_name(name: str, as_name: str | None) -> str:
    """The CPU copy's name: `as_name`, or `<name>_cpu`; a Python identifier either way."""
    chosen = as_name or f"{name}_cpu"
    if not chosen.isidentifier() or keyword.iskeyword(chosen):
        raise SyncError(f"--as {chosen!r} is not a Python name: use letters, digits and "
                        "underscores, e.g. --as model_cpu")
    return chosen


def chosen_copy(namespace: Mapping[str, Any], name: str | None, as_name: str | None,
                last_model: Any = None, last_name: str | None = None) -> tuple[str, str]:
    """(the model's name, its copy's name), checked: what `%tpu_sync` refuses, refused
    before anything heavy is imported.

    Raises:
        SyncError: see `choose_model` and `copy_name`.
    """
    name, _ = choose_model(namespace, name, last_model, last_name)
    return name, copy_name(name, as_name)
