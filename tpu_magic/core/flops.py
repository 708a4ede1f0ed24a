"""FLOPs of one training sample, counted from a model's layers.

The multiply-adds of Dense, convolution and recurrent layers (2 FLOPs each). Training is the
forward pass, the weights' gradients (as much again) and the inputs' gradients (as much
again, except for the layers that read the model's inputs with nothing trainable before
them: no gradient flows back there), as XLA computes it. Elementwise layers (activations,
normalization, pooling) are left out: a few percent of a model that has matmuls. The
TensorFlow backend reports this count; the JAX backend asks XLA and falls back to it.
"""

from __future__ import annotations

import math
from typing import Any


def _shape(tensor: Any) -> tuple | None:
    try:
        return tuple(tensor.shape)
    except (AttributeError, ValueError, TypeError):
        return None


def _size(dims: tuple) -> int | None:
    if any(d is None for d in dims):
        return None
    return math.prod(dims)


def layer_flops(layer: Any) -> float | None:
    """Forward FLOPs of one sample through a built layer (0 for the elementwise ones),
    None where its shapes are unknown."""
    name = type(layer).__name__
    if hasattr(layer, "layers") and name not in ("Bidirectional",):  # a nested model
        return forward_flops(layer)
    if name == "Bidirectional":
        return sum(layer_flops(part) or 0.0 for part in (layer.forward_layer, layer.backward_layer))
    inputs, outputs = _shape(getattr(layer, "input", None)), _shape(getattr(layer, "output", None))
    if name in ("Dense", "EinsumDense"):
        kernel = getattr(layer, "kernel", None)
        if kernel is None or outputs is None:
            return None
        rows = _size(outputs[1:-1]) if name == "Dense" else 1
        return None if rows is None else 2.0 * _size(tuple(kernel.shape)) * rows
    if name.startswith("Conv") and "Transpose" not in name or name.startswith("DepthwiseConv") \
            or name.startswith("SeparableConv"):
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            kernel = getattr(layer, "depthwise_kernel", None)
        if kernel is None or outputs is None:
            return None
        positions = _size(outputs[1:-1])
        if positions is None:
            return None
        flops = 2.0 * _size(tuple(kernel.shape)) * positions
        pointwise = getattr(layer, "pointwise_kernel", None)
        if pointwise is not None:
            flops += 2.0 * _size(tuple(pointwise.shape)) * positions
        return flops
    if name in ("LSTM", "GRU", "SimpleRNN"):
        cell = layer.cell
        if inputs is None or inputs[1] is None:
            return None
        weights = _size(tuple(cell.kernel.shape)) + _size(tuple(cell.recurrent_kernel.shape))
        return 2.0 * weights * inputs[1]
    return 0.0


def forward_flops(model: Any) -> float | None:
    """Forward FLOPs of one sample through a model's layers (None: a layer's shapes unknown)."""
    total = 0.0
    for layer in getattr(model, "layers", []):
        flops = layer_flops(layer)
        if flops is None:
            return None
        total += flops
    return total


def counted_training_flops(model: Any) -> float | None:
    """Training FLOPs of one sample counted from the layers: forward, the weights'
    gradients, and the inputs' gradients below the first trainable layer."""
    forward = input_gradients = 0.0
    trainable_before = False
    for layer in getattr(model, "layers", []):
        flops = layer_flops(layer)
        if flops is None:
            return None
        forward += flops
        if trainable_before:
            input_gradients += flops
        trainable_before = trainable_before or bool(layer.trainable_weights)
    return 2.0 * forward + input_gradients if forward else None
