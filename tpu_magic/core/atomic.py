"""Writing a file so that a crash at any moment leaves either the old file or the new one.

The content goes to a temporary file in the same directory (same file system, so the
rename is atomic), is flushed to disk, and replaces the target with one rename; the
directory is then synced so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yields a temporary path beside `target`; on success it replaces `target`.

    Args:
        target: the file to write.
        suffix: the temporary file's ending (some writers check it, e.g. Keras's
            `.weights.h5`).

    Raises:
        Whatever the body raises; the temporary file is removed and `target` is untouched.
    """
    target = Path(target)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp{suffix}")
    try:
        yield temporary
        _fsync_file(temporary)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise
    _fsync_directory(target.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
