"""The packed sample weight every padded batch carries: its keys, read by `exactness`.

The input builders (`backends.tf.data`, `backends.jax.data`) write it, a dict of three
per-row values in place of Keras's sample weight:

- `MASK`: 1 for a real sample, 0 for padding;
- `WEIGHT`: the user's own sample weight (times `class_weight`), 1 where none was given;
- `REAL`: the share of real samples in the batch (k / B), the same on every row.
"""

from __future__ import annotations

from typing import Any

MASK, WEIGHT, REAL = "tpu_magic_mask", "tpu_magic_weight", "tpu_magic_real"


def is_packed(sample_weight: Any) -> bool:
    """Whether a step's sample weight is tpu_magic's packed one."""
    return isinstance(sample_weight, dict) and MASK in sample_weight
