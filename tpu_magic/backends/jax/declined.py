"""Steps Keras declines to compile on JAX for TensorFlow's sake, compiled.

Keras runs a model's steps op by op (no XLA) wherever one of its layers says
`supports_jit = False`, on every backend. Its image augmentation layers that transform
coordinates (RandomRotation, RandomZoom, RandomTranslation, RandomShear,
RandomPerspective, RandomCrop) say so because XLA cannot compile TensorFlow's image
transform; on JAX the same layers trace and compile like any other, so a model that merely
holds one trains op by op there, many times slower (keras #23229: a TPU notebook's
training went from minutes to hours). On JAX, tpu_magic compiles such a model's steps: the
same steps, their random draws the same (a step's seed state is passed in and out either
way), their sums rounded as XLA's fusions round them. A layer of the user's own, or one
that cannot compile (string lookups, hashing), leaves the model as Keras made it.
"""

from __future__ import annotations

from typing import Any

# Keras's own layers whose JAX code traces under `jax.jit` in training mode, by class name
COMPILE_ON_JAX = frozenset({"RandomRotation", "RandomZoom", "RandomTranslation",
                            "RandomShear", "RandomPerspective", "RandomCrop"})


def declining_layers(model: Any) -> list[str] | None:
    """The classes of the layers that keep Keras from compiling the model's steps, where
    every one of them is Keras's own and compiles on JAX (None: none declines, or one
    that cannot compile does)."""
    declining = [layer for layer in model._flatten_layers()
                 if not getattr(layer, "supports_jit", True)]
    if not declining or any(type(layer).__name__ not in COMPILE_ON_JAX or
                            not type(layer).__module__.startswith("keras.")
                            for layer in declining):
        return None
    return sorted({type(layer).__name__ for layer in declining})


def compile_declined(model: Any, label: str) -> str | None:
    """Compiles the model's steps (its `jit_compile` on) where Keras declined only for
    layers that compile on JAX; the note that says so (None: nothing changed: the model
    compiles already, runs eagerly as asked (`run_eagerly=True`), or holds a layer that
    cannot)."""
    if getattr(model, "run_eagerly", False) or model.jit_compile:
        return None
    names = declining_layers(model)
    if names is None:
        return None
    model._jit_compile = True  # Keras's setter refuses where a layer declines
    return (f"{label!r} holds {', '.join(names)}, which Keras runs op by op on every "
            "backend (XLA cannot compile TensorFlow's image transform): on JAX its steps "
            "compile, so they are compiled, the same steps and random draws, many times "
            "faster (run_eagerly=True in compile keeps them op by op)")
