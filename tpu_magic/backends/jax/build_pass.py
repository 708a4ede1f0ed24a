"""Keras's build pass on JAX, for tpu_magic's own pipeline: the model built from the next
pass's first batch without reading a pass of its own.

Keras's JAX `fit` builds a model that is not built yet (its layers, compiled metrics or
loss) from the first batch of a pass it reads for that alone (`_symbolic_build`). On a
pipeline that shuffles as plain Keras does (`data.PaddedBatches`), that pass would draw an
order of its own where tpu_magic has drawn it already (the first batches read ahead for the
first-step check): here the model is built from `upcoming`'s batch instead, and where it is
built already the pipeline is told the pass was skipped (it draws that pass's order then,
as plain Keras would). Other inputs are left to Keras.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tpu_magic.core.overrides import overridden


@contextlib.contextmanager
def from_upcoming_batches(model: Any) -> Iterator[None]:
    """While inside, `model`'s calls build it from tpu_magic's pipeline without a pass."""
    if "_symbolic_build" in getattr(model, "__dict__", {}):
        yield  # a call already inside
        return
    keras_own = model._symbolic_build

    def symbolic_build(iterator: Any = None, data_batch: Any = None) -> Any:
        pipeline = _own_pipeline(iterator)
        if data_batch is None and pipeline is not None:
            from tpu_magic.core.steps import builds_from_a_pass

            if builds_from_a_pass(model):
                data_batch = pipeline.upcoming(1)[0]
            else:
                pipeline.build_pass_skipped()
        return keras_own(iterator=iterator, data_batch=data_batch)

    with overridden(model, "_symbolic_build", symbolic_build):
        yield


def _own_pipeline(iterator: Any) -> Any:
    """tpu_magic's own pipeline behind Keras's epoch iterator (None: another input)."""
    from tpu_magic.backends.jax.data import PaddedBatches

    found = getattr(getattr(iterator, "data_adapter", None), "py_dataset", None)
    return found if isinstance(found, PaddedBatches) else None
