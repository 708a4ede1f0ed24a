"""One-flag precision: `%%tpu_train --precision auto|bf16|mixed_bf16|fp16|fp32`.

Keras's dtype policies do the work (keras.io's mixed precision guide): `mixed_bfloat16`
and `mixed_float16` keep variables in float32 and compute in 16 bits; `bfloat16` puts the
variables in bfloat16 too. `mixed_float16` needs loss scaling, which Keras's `compile`
adds by itself (a `LossScaleOptimizer`). The guide's advice kept here: the model's output
activation (softmax, sigmoid) runs in float32, for numeric stability.

The choice is pure (`choose`); `in_force` sets the policy while a cell builds its models.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from tpu_magic.core.errors import PrecisionError

# --precision → Keras dtype policy ("auto" is decided by `choose`).
POLICIES = {"bf16": "bfloat16", "mixed_bf16": "mixed_bfloat16", "fp16": "mixed_float16",
            "fp32": "float32"}
LOW = ("bfloat16", "float16")
_OUTPUT_ACTIVATIONS = ("softmax", "sigmoid", "log_softmax")


@dataclass(frozen=True)
class Precision:
    """The dtype policy a cell trains with, and why."""

    policy: str
    reason: str

    @property
    def mixed(self) -> bool:
        return self.policy.startswith("mixed_")

    def describe(self) -> str:
        return f"{self.policy} ({self.reason})"


def choose(requested: str, kind: str, bf16_chip: bool | None) -> Precision:
    """The policy for `--precision requested` on a device of `kind`.

    Args:
        requested: auto, bf16, mixed_bf16, fp16 or fp32.
        kind: "tpu", "gpu" or "cpu" (a simulated TPU is a CPU).
        bf16_chip: whether the GPU computes bfloat16 natively (None: not known).

    Raises:
        PrecisionError: an unknown value.
    """
    text = requested.strip().lower()
    if text in POLICIES:
        return Precision(POLICIES[text], f"--precision {text}")
    if text != "auto":
        raise PrecisionError(f"--precision {requested!r} is not one of auto, bf16, mixed_bf16, "
                             "fp16, fp32: e.g. --precision auto (mixed bfloat16 on TPUs)")
    if kind == "tpu":
        return Precision("mixed_bfloat16", "auto: TPUs compute in bfloat16")
    if kind == "gpu" and bf16_chip:
        return Precision("mixed_bfloat16", "auto: this GPU computes bfloat16")
    if kind == "gpu" and bf16_chip is False:
        return Precision("mixed_float16", "auto: this GPU has no bfloat16, so float16 with "
                                          "loss scaling")
    if kind == "gpu":
        return Precision("mixed_float16", "auto: a GPU not in the chip table, so float16 with "
                                          "loss scaling, which every CUDA GPU computes")
    return Precision("float32", "auto: the CPU gains nothing from 16-bit compute")


def for_connection(requested: str, connection: Any) -> Precision:
    """`choose` for a connection: on a GPU, whether its chip computes bfloat16."""
    bf16 = None
    if connection.kind == "gpu":
        chip = connection.backend.device_view(connection, {}).chip
        bf16 = None if chip is None else chip.bf16
    return choose(requested, connection.kind, bf16)


@contextlib.contextmanager
def in_force(precision: Precision | None) -> Iterator[None]:
    """Models built inside get the policy; the previous global policy comes back after."""
    if precision is None:
        yield
        return
    import keras

    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision.policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


def low_precision(policy: Any) -> bool:
    """Whether a dtype policy (or its name) computes in 16 bits."""
    name = getattr(policy, "name", policy)
    return any(word in str(name) for word in LOW)


def float32_outputs(model: Any) -> list[str]:
    """Puts the model's softmax/sigmoid output layers in float32 where they compute in 16
    bits with float32 variables (a mixed policy); returns the layers' names.

    Their variables are float32 already under a mixed policy, so only the compute dtype
    changes. Under a pure bfloat16 policy (bfloat16 variables) nothing is changed.
    """
    import keras

    changed = []
    for layer in _output_layers(model):
        activation = getattr(getattr(layer, "activation", None), "__name__", "")
        if isinstance(layer, keras.layers.Softmax):
            activation = "softmax"
        policy = layer.dtype_policy
        if activation in _OUTPUT_ACTIVATIONS and low_precision(policy) and \
                policy.variable_dtype == "float32":
            layer.dtype_policy = keras.DTypePolicy("float32")
            changed.append(layer.name)
    return changed


def keep_outputs_float32(chosen: Precision | None, model: Any, label: str) -> tuple[bool, list[str]]:
    """Under a 16-bit policy: the model's output activations in float32 (Keras's advice); a
    model built before the cell keeps its float32 and is named.

    Returns:
        (whether a layer changed, the notes to say).
    """
    if chosen is None or not low_precision(chosen.policy):
        return False, []
    if not low_precision(model.dtype_policy):
        return False, [f"model {label!r} was built before this cell with "
                       f"{model.dtype_policy.name}: it keeps float32 variables and compute. "
                       f"Build it inside the %%tpu_train cell to train in {chosen.policy}."]
    if not chosen.mixed:
        return False, [f"{chosen.policy}: variables and outputs are bfloat16 too; "
                       "--precision mixed_bf16 keeps variables and output activations in "
                       "float32 (Keras's advice)"]
    changed = float32_outputs(model)
    if not changed:
        return False, []
    return True, [f"{chosen.policy}: the output layer{'s' * (len(changed) > 1)} "
                  f"{', '.join(changed)} compute{'s' * (len(changed) == 1)} in float32, "
                  "as Keras's mixed precision guide advises (a softmax or sigmoid in 16 "
                  "bits loses precision); the rest computes in 16 bits, variables float32"]


def _output_layers(model: Any) -> list[Any]:
    try:
        outputs = list(model.outputs)
    except (AttributeError, ValueError):
        layers = getattr(model, "layers", [])
        return layers[-1:]
    found = []
    for tensor in outputs:
        history = getattr(tensor, "_keras_history", None)
        if history is not None and history[0] not in found:
            found.append(history[0])
    return found


def float32_config(config: Any) -> Any:
    """A serialized model with every 16-bit float dtype policy replaced by float32 (for the
    CPU copy); integer dtypes are left as they are."""
    if isinstance(config, dict):
        if config.get("class_name") in ("DTypePolicy", "FloatDTypePolicy") and \
                low_precision(config.get("config", {}).get("name", "")):
            return "float32"
        return {key: ("float32" if key == "dtype" and isinstance(value, str)
                      and low_precision(value) else float32_config(value))
                for key, value in config.items()}
    if isinstance(config, list):
        return [float32_config(item) for item in config]
    return config
