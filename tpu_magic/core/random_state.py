"""The random state a notebook's own code draws from, kept as it was around what tpu_magic
builds: a model rebuilt inside the strategy, a copy on one device. Each new layer draws its
initial weights and seed generators from Keras's global seed generator and Python's
`random` (and some code from NumPy's global generator), so without this a model a later
cell builds would start from other weights than in the same seeded notebook in plain Keras.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Inside, draw as needed; after, Python's, NumPy's and Keras's global random states are
    what they were before."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    python, numpy = random.getstate(), np.random.get_state()
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    seed = None if generator is None else np.array(generator.state.value)
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, generator)
        if generator is not None:
            generator.state.assign(seed)
