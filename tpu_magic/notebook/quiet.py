"""Keeping TensorFlow's own log chatter out of notebook cells."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from typing import Iterator

from tpu_magic.core import process


def quiet_native_logs() -> None:
    """Hides TensorFlow's C++ info and warning lines, unless the user chose a level.

    Must run before TensorFlow is imported to take effect.
    """
    process.set_environment("TF_CPP_MIN_LOG_LEVEL", "2", "TensorFlow's C++ logging reads it "
                            "once, when TensorFlow is imported", keep_users=True)


# What TensorFlow's C++ side writes to the process's stderr as it loads, before absl reads
# TF_CPP_MIN_LOG_LEVEL (TensorFlow 2.21 writes these whatever the level): the absl preamble
# and info lines (I1124 12:00:00.000 ... or I0000 00:00:1795... port.cc:153] oneDNN ...).
_LOAD_NOTES = re.compile(rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
                         rb"|I\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w.]+:\d+\]).*$")


def load_notes_dropped(text: bytes) -> bytes:
    """`text` (native stderr) without TensorFlow's load-time info lines; every other line kept."""
    return b"".join(line for line in text.splitlines(keepends=True)
                    if not _LOAD_NOTES.match(line.rstrip(b"\r\n")))


@contextlib.contextmanager
def native_load_notes_dropped() -> Iterator[None]:
    """For a connect (where the frameworks load): the process's stderr (file descriptor 2,
    which Jupyter shows in the cell) goes to a temporary file, and comes back without
    TensorFlow's load-time info lines at the end. Warnings and errors come back, in order;
    Python's own `sys.stderr` is not touched."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr descriptor (an embedded interpreter): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as caught:
        _flush_native_stderr()
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            _flush_native_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = load_notes_dropped(caught.read())
            if kept:
                os.write(2, kept)


def tensorflow_load_notes_dropped() -> contextlib.AbstractContextManager[None]:
    """For a training cell: `native_load_notes_dropped` while TensorFlow is not loaded yet
    and can be, since the cell may load it (KerasHub and grain import it on Kaggle's JAX
    image, where tensorflow-cpu sits beside JAX); nothing once it is, or where it cannot be
    (Colab's TPU image), so the cell's native stderr is not held back there. Where it is
    held, it comes back when the cell ends."""
    from tpu_magic.backends import tensorflow_may_load

    return native_load_notes_dropped() if tensorflow_may_load() else contextlib.nullcontext()


def _flush_native_stderr() -> None:
    for stream in (sys.__stderr__, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass


@contextlib.contextmanager
def tensorflow_info_silenced() -> Iterator[None]:
    """Drops the `tensorflow` logger's INFO lines for the duration (strategy chatter).

    A filter, not a level: TensorFlow sets its logger's level when first imported.
    """
    with _filtered("tensorflow", _AtLeastWarning()):
        yield


class _AtLeastWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def drop_library_notes() -> None:
    """From `%load_ext tpu_magic` on, drops log lines libraries write about their own settings,
    which a cell's user cannot act on: grain's "prefetch_buffer_size=8 is smaller than
    num_threads=16", at every fit, evaluate and predict of a KerasHub task (KerasHub's own
    read options), in training cells and plain ones. Once however often it is called."""
    logging.getLogger("absl").addFilter(_LIBRARY_NOTES)


def keep_library_notes() -> None:
    """Undoes `drop_library_notes` (`%unload_ext tpu_magic`)."""
    logging.getLogger("absl").removeFilter(_LIBRARY_NOTES)


@contextlib.contextmanager
def _filtered(name: str, rule: logging.Filter) -> Iterator[None]:
    """`rule` on the logger `name` for the duration."""
    logger = logging.getLogger(name)
    logger.addFilter(rule)
    try:
        yield
    finally:
        logger.removeFilter(rule)


class _LibraryNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("prefetch_buffer_size=%s is smaller than num_threads")


_LIBRARY_NOTES = _LibraryNotes()
