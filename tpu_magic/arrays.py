"""NumPy inputs, backend-free: counting samples, the data order's seed, trimming outputs.

Both input builders use these: `pipeline` (tf.data, the TensorFlow backend) and
`pydataset` (a Keras PyDataset, the JAX backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np


@dataclass(frozen=True)
class Pipeline:
    """A dataset and the number of steps that cover the data once."""

    dataset: Any
    steps: int
    samples: int
    padded: int  # samples of padding in one pass


def is_array_input(x: Any) -> bool:
    """True for NumPy arrays (or lists/tuples/dicts of them), which tpu_magic batches itself."""
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(isinstance(a, np.ndarray) for a in leaves)


def num_samples(x: Any) -> int:
    """The common first dimension of the arrays in `x`."""
    lengths = {len(a) for a in keras.tree.flatten(x)}
    if len(lengths) != 1:
        raise ValueError(f"inputs have different numbers of samples: {sorted(lengths)}")
    return lengths.pop()


def new_seed() -> int:
    """A seed for the data order, from NumPy's global generator (`keras.utils.set_random_seed`
    makes it repeatable)."""
    return int(np.random.randint(0, 2**31 - 1))


def trim(outputs: Any, samples: int) -> Any:
    """Drops the padded rows from predict outputs."""
    return keras.tree.map_structure(lambda a: a[:samples], outputs)
