"""Keeping TensorFlow's own log chatter out of notebook cells."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from tpu_magic.core import process


def quiet_native_logs() -> None:
    """Hides TensorFlow's C++ info and warning lines, unless the user chose a level.

    Must run before TensorFlow is imported to take effect.
    """
    process.set_environment("TF_CPP_MIN_LOG_LEVEL", "2", "TensorFlow's C++ logging reads it "
                            "once, when TensorFlow is imported", keep_users=True)


@contextlib.contextmanager
def tensorflow_info_silenced() -> Iterator[None]:
    """Drops the `tensorflow` logger's INFO lines for the duration (strategy chatter).

    A filter, not a level: TensorFlow sets its logger's level when first imported.
    """
    logger = logging.getLogger("tensorflow")
    keep_warnings = _AtLeastWarning()
    logger.addFilter(keep_warnings)
    try:
        yield
    finally:
        logger.removeFilter(keep_warnings)


class _AtLeastWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING
