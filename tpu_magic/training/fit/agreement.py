"""Variables each replica updates on its own, made to agree after training and before
every validation pass.

Under MirroredStrategy a non-synchronized BatchNormalization updates its moving mean and
variance on each replica from that replica's share of the batch, so the replicas end up
holding different statistics. Left so, the trained model answers with each replica's own
statistics while its `%tpu_sync` copy answers with their mean: the same model gives two
accuracies. Here every replica gets the mean, so the live model, its validation and its
CPU copy all use one set. The moving mean of equal shares averages to the whole batch's
exactly; the variance misses the spread between the shares' means (docs/limits.md).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from tpu_magic.core import variables


def agree(model: Any, backend: Any) -> list[str]:
    """Gives every replica the mean of the replicas' values, for the non-trainable variables
    they disagree on. Returns their paths."""
    changed = []
    with backend.reading(model):
        for weight in model.non_trainable_weights:
            parts = [np.asarray(p) for p in backend.replica_values(weight)]
            if len(parts) < 2 or not np.issubdtype(parts[0].dtype, np.floating) or \
                    all(variables.same(parts[0], p) for p in parts[1:]):
                continue
            weight.assign(np.mean(np.stack(parts), axis=0).astype(parts[0].dtype))
            changed.append(weight.path)
    return changed


class ReplicasAgree(keras.callbacks.Callback):
    """Averages the replicas' own variables before each validation pass and when fit ends."""

    def __init__(self, backend: Any):
        super().__init__()
        self.backend = backend
        self.averaged: set[str] = set()

    def on_test_begin(self, logs=None):
        self.averaged.update(agree(self.model, self.backend))

    def on_train_end(self, logs=None):
        self.averaged.update(agree(self.model, self.backend))
