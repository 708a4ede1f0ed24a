"""A training sample's FLOPs on JAX: XLA's cost analysis of the gradient of the model's
forward pass, or the layers' count where XLA's falls short."""

from __future__ import annotations

from typing import Any

from tpu_magic.core.deps import require_jax
from tpu_magic.core.flops import counted_training_flops

FLOP_SAMPLES = 8  # the batch the gradient is lowered for (FLOPs are per sample)


def training_flops(model: Any, batch: Any = None) -> tuple[float, str] | None:
    """XLA's cost analysis of the gradient of the model's forward pass (lowered, not
    compiled: no device time), per sample; the layer count where it cannot lower. `batch`:
    a batch the model is fed (its inputs' shapes where the model's own leave a size open,
    a language model's sequence length)."""
    try:
        flops = _xla_training_flops(model, batch)
    except Exception:  # noqa: BLE001 - a model JAX cannot lower abstractly: count instead
        flops = None
    counted = counted_training_flops(model)
    # XLA's analysis counts a loop's body once, not once a step: a recurrent layer's
    # scan over 250 words comes out 250 times too small. There the layers' count holds.
    if flops and not (counted and flops < 0.5 * counted):
        return flops, "XLA cost analysis"
    return None if counted is None else (counted, "counted from the layers")


def _xla_training_flops(model: Any, batch: Any = None) -> float | None:
    """FLOPs of one sample's forward and backward pass, as XLA counts them."""
    jax = require_jax()
    import jax.numpy as jnp
    import keras

    inputs = _abstract_inputs(model, batch)
    if inputs is None:
        return None
    trainable = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in model.trainable_variables]
    fixed = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in model.non_trainable_variables]

    def loss(trainable, fixed, x):  # a loss whose gradient XLA cannot fold away
        out, _ = model.stateless_call(trainable, fixed, x, training=False)
        return sum(jnp.sum(jnp.square(o.astype("float32"))) for o in keras.tree.flatten(out))

    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        cost = jax.jit(jax.grad(loss)).lower(trainable, fixed, inputs).cost_analysis()
    finally:
        keras.distribution.set_distribution(distribution)
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = (cost or {}).get("flops")
    return None if not flops else flops / FLOP_SAMPLES


def _abstract_inputs(model: Any, batch: Any) -> Any:
    """The model's inputs for `FLOP_SAMPLES` samples, as shapes: its own `inputs` where they
    fix every size, else the inputs of `batch` (a dict of token ids and a padding mask for
    a KerasHub task, whose sequence length the model leaves open); None where neither can."""
    jax = require_jax()
    import keras

    shapes = [tuple(t.shape)[1:] for t in (getattr(model, "inputs", None) or [])]
    if shapes and not any(d is None for shape in shapes for d in shape):
        found = [jax.ShapeDtypeStruct((FLOP_SAMPLES, *shape), t.dtype)
                 for shape, t in zip(shapes, model.inputs)]
        return found[0] if len(found) == 1 else found
    if batch is None:
        return None
    x = keras.utils.unpack_x_y_sample_weight(batch)[0]
    return keras.tree.map_structure(
        lambda a: jax.ShapeDtypeStruct((FLOP_SAMPLES, *tuple(a.shape)[1:]), a.dtype), x)
