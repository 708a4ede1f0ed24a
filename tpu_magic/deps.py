"""Heavy optional dependencies, imported on demand with a message that says how to fix them."""

from __future__ import annotations

import importlib
from types import ModuleType

from tpu_magic.errors import MissingDependencyError

TENSORFLOW_FIX = (
    "TensorFlow is not installed. Install one flavour: "
    "`pip install tensorflow` (CPU and GPU; `tensorflow[and-cuda]` for CUDA), "
    "`pip install tensorflow-cpu` (smaller, CPU only); or `pip install \"tpu_magic[tf]\"`. "
    "Then restart the runtime. On a TPU VM (Colab's and Kaggle's TPUs) no TensorFlow is "
    "needed: tpu_magic trains on JAX there (`%tpu_connect --backend jax`)."
)


def require_tensorflow() -> ModuleType:
    """Imports TensorFlow.

    Raises:
        MissingDependencyError: naming the pip command that fixes it.
    """
    try:
        return importlib.import_module("tensorflow")
    except ImportError:
        raise MissingDependencyError(TENSORFLOW_FIX) from None


def require_keras() -> ModuleType:
    """Imports Keras 3 (after TensorFlow, so `tf.keras` and `keras` agree).

    Raises:
        MissingDependencyError: Keras is missing or older than 3.
    """
    require_tensorflow()
    try:
        keras = importlib.import_module("keras")
    except ImportError:
        raise MissingDependencyError("Keras is not installed: `pip install \"keras>=3\"`.") from None
    if int(keras.__version__.split(".")[0]) < 3:
        raise MissingDependencyError(
            f"Keras {keras.__version__} is installed; tpu_magic needs Keras 3: "
            "`pip install -U \"keras>=3\"`, then restart the runtime."
        )
    return keras
