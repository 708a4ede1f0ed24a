"""The random state a notebook's own code draws from is the notebook's: tpu_magic draws from
it only what plain Keras would draw in the same cell.

`kept` holds it as it was around what tpu_magic builds (a model rebuilt inside the strategy,
a copy on one device): each new layer draws its initial weights and seed generators from
Keras's global seed generator and Python's `random` (and some code from NumPy's global
generator), so without it a model a later cell builds would start from other weights than
in the same seeded notebook in plain Keras. `order_seed` is the seed of a data order
tpu_magic shuffles itself where plain Keras's own shuffle draws nothing the notebook sees
(TensorFlow's graph-level seeds): read from NumPy's state, never drawn from it.
"""

from __future__ import annotations

import contextlib
import hashlib
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


def order_seed() -> int:
    """A seed for a data order, from NumPy's global state as it is now, drawing nothing:
    the same seeded notebook gets the same order, and the notebook's later draws are
    plain Keras's."""
    keys, position = np.random.get_state()[1:3]
    digest = hashlib.sha256(keys.tobytes() + int(position).to_bytes(4, "little")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
