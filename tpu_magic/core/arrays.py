"""NumPy inputs, backend-free: counting samples, trimming outputs.

Both input builders use these: `backends.tf.data` (tf.data, the TensorFlow backend) and
`backends.jax.data` (a Keras PyDataset, the JAX backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import keras
import numpy as np


@dataclass(frozen=True)
class Pipeline:
    """A dataset and the number of steps that cover the data once."""

    dataset: Any
    steps: int
    samples: int
    padded: int  # samples of padding in one pass
    left_out: int = 0  # samples a pass leaves out (whole batches only, no padding)
    # the first `k` batches of the first epoch, as NumPy, fed as the dataset feeds them
    # (None: they cannot be read again): the first-step parity check's batches
    first: Callable[[int], list] | None = None
    # the first `k` batches' `batch_shapes`, known before the fit reads anything (None:
    # not known without reading): the parity check decides a setup agreed before the fit
    shapes: Callable[[int], list] | None = None


def batch_shapes(batch: Any) -> tuple:
    """What a batch looks like: (path, shape, dtype name) of each array, in `keras.tree`'s
    order. Two batches with the same are the same computation's input."""
    return tuple((path, tuple(np.shape(a)), str(np.asarray(a).dtype))
                 for path, a in keras.tree.flatten_with_path(batch))


def is_array_input(x: Any) -> bool:
    """True for NumPy arrays (or lists/tuples/dicts of them), which tpu_magic batches itself."""
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(isinstance(a, np.ndarray) for a in leaves)


def rows_spec(data: Any) -> Any:
    """The shape of one row and the dtype of each array in `data` (None kept as None)."""
    return keras.tree.map_structure(
        lambda a: None if a is None else (tuple(np.shape(a)[1:]), str(np.asarray(a).dtype)),
        data, none_is_leaf=True)


def num_samples(x: Any) -> int:
    """The common first dimension of the arrays in `x` (see `common_length`)."""
    return common_length("the call", x=x)


def common_length(method: str, **parts: Any) -> int:
    """The number of samples every array of the parts (x, y, sample_weight, ...) has.

    Args:
        method: the call, for the message ("fit", "validation_data", ...).
        parts: name → an array or a structure of arrays; None is skipped.

    Raises:
        InputError: two arrays have different lengths (plain Keras: "Data cardinality is
            ambiguous"), each array named with its length.
    """
    from tpu_magic.core.errors import InputError

    lengths: dict[str, int] = {}
    for part, value in parts.items():
        if value is None:
            continue
        for path, leaf in keras.tree.flatten_with_path(value):
            name = part + "".join(f"[{p!r}]" for p in path)
            if np.ndim(leaf) == 0:
                raise InputError(f"{method}: {name} is a single value, not an array of samples: "
                                 "give one row per sample")
            lengths[name] = len(leaf)
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise InputError(
            f"{method} got arrays of different lengths ({listed}): every array of x, y and "
            "sample_weight needs one row per sample (plain Keras: \"Data cardinality is "
            "ambiguous\"). Cut them to the same samples, e.g. x[:n], y[:n].")
    return next(iter(lengths.values()), 0)


def trim(outputs: Any, samples: int) -> Any:
    """Drops the padded rows from predict outputs."""
    return keras.tree.map_structure(lambda a: a[:samples], outputs)


def class_weights_to_sample_weights(y: Any, class_weight: dict) -> np.ndarray:
    """`fit`'s `class_weight` as one weight per sample, by Keras's own rule (a one-hot
    target counts by its argmax; a class not named weighs 1)."""
    from keras.src.trainers.data_adapters.data_adapter_utils import (
        class_weight_to_sample_weights)

    return np.asarray(class_weight_to_sample_weights(np.asarray(y), class_weight), "float32")


def string_input(model: Any, data: Any) -> str | None:
    """Where strings would reach the model: a string array, a string dataset feature, or a
    string `Input` of the model; None if nowhere."""
    for leaf in keras.tree.flatten(data if not hasattr(data, "element_spec") else
                                   _inputs_spec(data.element_spec)):
        dtype = getattr(leaf, "dtype", None)
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "OSU":
            return f"an input array of dtype {leaf.dtype}"
        if dtype is not None and getattr(dtype, "name", str(dtype)) == "string":
            return "a string feature in the dataset"
    for tensor in getattr(model, "_inputs", None) or []:
        if str(getattr(tensor, "dtype", "")) == "string":
            return f"its Input {getattr(tensor, 'name', '')!r} has dtype string"
    return None


def _inputs_spec(spec: Any) -> Any:
    """The inputs part of a dataset element (x of (x, y[, w]))."""
    return spec[0] if isinstance(spec, tuple) else spec
