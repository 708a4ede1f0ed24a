"""Heavy optional dependencies, imported on demand with a message that says how to fix them."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from types import ModuleType
from typing import Mapping

from tpu_magic.core.errors import MissingDependencyError

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
    return _required("tensorflow", TENSORFLOW_FIX)


def _required(name: str, fix: str) -> ModuleType:
    found = sys.modules.get(name)  # the loop asks once a step: skip the import machinery
    if found is not None:
        return found
    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingDependencyError(fix) from None


JAX_FIX = ("JAX is not installed: `pip install \"tpu_magic[jax]\"` (CPU), `pip install "
           "\"jax[tpu]\"` on a TPU VM or `pip install \"jax[cuda12]\"` for GPUs, then restart "
           "the runtime.")


def require_jax() -> ModuleType:
    """Imports JAX.

    Raises:
        MissingDependencyError: naming the pip command that fixes it.
    """
    return _required("jax", JAX_FIX)


PACKAGES = ("tensorflow", "tensorflow-cpu", "tensorflow-tpu", "keras", "jax", "jaxlib", "libtpu")


def installed_versions() -> dict[str, str]:
    """Versions of the packages that must fit together, for those installed."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def version_warnings(versions: Mapping[str, str]) -> list[str]:
    """Combinations that are known not to work together."""
    warnings = []
    flavours = [n for n in ("tensorflow", "tensorflow-cpu", "tensorflow-tpu") if n in versions]
    if len(flavours) > 1:
        distinct = {versions[n] for n in flavours}
        if len(distinct) > 1:
            warnings.append(
                "TensorFlow flavours of different versions are installed ("
                + ", ".join(f"{n} {versions[n]}" for n in flavours)
                + "): they share one `tensorflow` package; keep one, e.g. "
                f"`pip uninstall -y {' '.join(f for f in flavours if f != flavours[-1])}`."
            )
    keras = versions.get("keras")
    if keras and int(keras.split(".")[0]) < 3:
        warnings.append(f"keras {keras} is older than 3: `pip install -U \"keras>=3\"`.")
    if "jax" in versions and "jaxlib" in versions:
        if versions["jax"].split(".")[:2] != versions["jaxlib"].split(".")[:2]:
            warnings.append(f"jax {versions['jax']} and jaxlib {versions['jaxlib']} differ.")
    if "libtpu" in versions and "tensorflow-tpu" not in versions and "jax" not in versions:
        warnings.append("libtpu is installed but neither tensorflow-tpu nor jax can use it.")
    return warnings
