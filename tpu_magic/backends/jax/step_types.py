"""One compiled train step for every step of every fit on a mesh of one device (Colab's
v5e-1, one GPU).

JAX keys a compiled step by the types of the arrays it is given, and an array laid out on a
mesh carries that mesh in its type. What a step returns does. What Keras makes itself does
not when the mesh is one device: a fresh model's weights, an optimizer's slots, and the zeros
`reset_metrics` writes before every epoch, since Keras leaves a value that sits on the one
device already where it is (`distribute_tensor` finds its placement equivalent). Keras then
compiles its train step twice in a model's first fit (its first step, then the steps fed its
outputs) and once more in the second (the metrics' fresh zeros beside weights from a step).
On a mesh of several devices every value is laid out on the mesh, and the step compiles
once. On a chip a step compiles for seconds to minutes.

Here, whenever Keras resets the metrics (before each epoch's first step, and before each
evaluation), every value of the model's state that lacks its variable's mesh is put on its
layout (`jax.device_put`: the same device, so no copy). Values are unchanged; only their
type is, so the step Keras compiled for its outputs serves from the first step on.
"""

from __future__ import annotations

from typing import Any, ContextManager

from tpu_magic.core.deps import require_jax
from tpu_magic.core.overrides import overridden
from tpu_magic.core.steps import state_groups


def one_program(model: Any) -> ContextManager[None]:
    """While tpu_magic runs the model's calls: its state is laid out on the mesh each time
    Keras resets its metrics (see the module's docstring)."""
    reset = model.reset_metrics

    def reset_metrics() -> None:
        reset()
        on_the_mesh(model)

    return overridden(model, "reset_metrics", reset_metrics)


def on_the_mesh(model: Any) -> None:
    """Puts every state value whose type lacks its variable's mesh on the variable's layout."""
    jax = require_jax()
    for group in state_groups(model):
        for variable in group:
            layout = getattr(variable, "_layout", None)
            sharding = getattr(layout, "backend_layout", layout)
            value = getattr(variable, "_value", None)
            if isinstance(sharding, jax.sharding.NamedSharding) and \
                    isinstance(value, jax.Array) and value.is_fully_addressable and \
                    jax.typeof(value).sharding.mesh.empty:
                variable._value = jax.device_put(value, sharding)
