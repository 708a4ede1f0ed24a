"""The start of a Keras call on TensorFlow, without the batch Keras draws only to build.

Keras's TensorFlow trainer starts every `fit` and `evaluate` (a fit's validation passes
too) of a model made under a strategy with `_maybe_symbolic_build`: it starts the input's
iterator, draws a batch, averages it over the replicas, and hands it to `_symbolic_build`,
which builds whatever of the model, its compiled loss and metrics and its optimizer is
still unbuilt. The iterator is then dropped and the call starts it again. Once all of
those are built, `_symbolic_build` does nothing with the batch, and drawing it is all
cost (an iterator's start, a global batch read and averaged, at every later `fit`).
While tpu_magic runs a model's calls the model skips it where everything is built, and
draws it, as Keras does, where anything is not; it then builds from replica 0's part of
that batch (only its shapes are read), where Keras's average of the parts fails on a batch
the replicas do not split evenly (a generator's batch of 29 on 8 replicas: AddN's "must
have the same size and shape"). A model made outside every strategy never
draws it (Keras's own rule), so plain Keras on one device, the reference, is unchanged.
An input that counts Keras's passes over it (a `PyDataset` made whole,
`keras_inputs.WholeBatches`, whose first two passes share one tape) is told the build pass
was skipped, so the call's own pass is still the one it reads as the epoch (otherwise a
fit's second validation pass over a `PyDataset` would read nothing).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tpu_magic.core.overrides import overridden

_HOOK = "_maybe_symbolic_build"


@contextlib.contextmanager
def without_build_batch(model: Any) -> Iterator[None]:
    """While inside, `model`'s calls draw no batch to build what is built already."""
    if _HOOK in getattr(model, "__dict__", {}) or not hasattr(type(model), _HOOK):
        yield  # a call already inside, or not a Keras TensorFlow model
        return
    keras_own = getattr(model, _HOOK)

    def maybe_symbolic_build(iterator: Any = None, data_batch: Any = None) -> None:
        strategy = getattr(model, "_distribute_strategy", None)
        if strategy is None:
            keras_own(iterator=iterator, data_batch=data_batch)
            return
        if not built(model):
            if data_batch is None and iterator is not None:
                data_batch = _first_part(strategy, iterator)
            keras_own(data_batch=data_batch)
            return
        # an input that counts its passes (a `PyDataset` made whole) is told none was read
        skipped = getattr(getattr(iterator, "data_adapter", None), "build_pass_skipped", None)
        if callable(skipped):
            skipped()

    with overridden(model, _HOOK, maybe_symbolic_build):
        yield


def _first_part(strategy: Any, iterator: Any) -> Any:
    """The first batch Keras's iterator gives, as Keras's `_maybe_symbolic_build` reads it,
    each distributed value's replica 0 part (the shapes the model is built from)."""
    import keras
    import tensorflow as tf

    for _, _, batches in iterator:
        return keras.tree.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues) else v, next(batches))
    return None


def built(model: Any) -> bool:
    """Whether Keras's `_symbolic_build` would build nothing: the model's layers, its
    compiled metrics and loss, and its optimizer are all built (the conditions of
    `keras.src.trainers.trainer.Trainer._symbolic_build`)."""
    if not all(layer.built for layer in model._flatten_layers()):
        return False
    for part in (getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None),
                 getattr(model, "optimizer", None)):
        if part is not None and not part.built:
            return False
    return True
