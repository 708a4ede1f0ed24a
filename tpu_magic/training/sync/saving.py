"""A CPU copy's weights written to a file: the `.weights.h5` path Keras requires, written
atomically (an interrupted save keeps the previous file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpu_magic.core.atomic import atomic_path
from tpu_magic.core.errors import SyncError

WEIGHTS_SUFFIX = ".weights.h5"  # Keras 3 refuses any other ending for weights files


def weights_path(text: str) -> Path:
    """`text` with the `.weights.h5` ending Keras requires, in a directory that exists.

    Raises:
        SyncError: the directory does not exist, or the path is a directory.
    """
    path = Path(text).expanduser()
    if path.name.endswith(WEIGHTS_SUFFIX):
        pass
    elif path.suffix == ".h5":
        path = path.with_name(path.name[: -len(".h5")] + WEIGHTS_SUFFIX)
    else:
        path = path.with_name(path.name + WEIGHTS_SUFFIX)
    if path.is_dir() or not text.strip() or text.endswith(("/", "\\")):
        raise SyncError(f"--save {text!r} is a directory: name a file in it, "
                        f"e.g. --save {Path(text) / ('model' + WEIGHTS_SUFFIX)}")
    if not path.parent.is_dir():
        raise SyncError(f"--save {text!r}: the directory {str(path.parent)!r} does not exist; "
                        "create it first or save elsewhere")
    return path


def save_weights(model: Any, path: Path) -> None:
    """`model.save_weights(path)` atomically: an interrupted save keeps the previous file."""
    try:
        with atomic_path(path, suffix=WEIGHTS_SUFFIX) as temporary:
            model.save_weights(str(temporary))
    except OSError as exc:
        raise SyncError(f"could not write {str(path)!r}: {exc.strerror or exc}") from None
