"""A JAX process of its own, as on Colab's TPU image: `require_jax` skips a test where JAX
is not installed (fails under TPU_MAGIC_JAX=required, as in CI), and `blocked_env` is the
environment with TensorFlow blocked and no backend or device count inherited."""

import importlib.util
import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent


def require_jax() -> None:
    if importlib.util.find_spec("jax") is None:
        if os.environ.get("TPU_MAGIC_JAX") == "required":
            pytest.fail("TPU_MAGIC_JAX=required but jax is not installed: pip install -e '.[jax]'")
        pytest.skip("jax is not installed (pip install -e '.[jax]')")


def blocked_env(**extra: str) -> dict:
    """os.environ with TensorFlow blocked (tests/without_tensorflow first on the path),
    KERAS_BACKEND and XLA_FLAGS left out, and `extra` set."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(TESTS / "without_tensorflow"), **extra)
    return env
