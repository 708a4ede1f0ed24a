"""Which dtype policy `--precision` means on which device (pure)."""

import pytest

from tpu_magic.core.errors import PrecisionError
from tpu_magic.training.models.precision import choose, float32_config, low_precision


@pytest.mark.parametrize("requested, kind, bf16, policy, why", [
    ("auto", "tpu", None, "mixed_bfloat16", "TPUs compute in bfloat16"),
    ("auto", "gpu", True, "mixed_bfloat16", "this GPU computes bfloat16"),  # A100, L4, H100
    ("auto", "gpu", False, "mixed_float16", "loss scaling"),  # T4, V100, P100
    ("auto", "gpu", None, "mixed_float16", "not in the chip table"),
    ("auto", "cpu", None, "float32", "the CPU gains nothing"),
    ("AUTO", "cpu", None, "float32", "auto"),
    ("bf16", "cpu", None, "bfloat16", "--precision bf16"),
    ("mixed_bf16", "gpu", False, "mixed_bfloat16", "--precision mixed_bf16"),
    ("fp16", "tpu", None, "mixed_float16", "--precision fp16"),
    ("fp32", "tpu", None, "float32", "--precision fp32"),
])
def test_the_policy_for_each_device(requested, kind, bf16, policy, why):
    chosen = choose(requested, kind, bf16)
    assert chosen.policy == policy and why in chosen.reason


@pytest.mark.parametrize("requested", ["half", "float16", "", "bf32"])
def test_an_unknown_value_names_itself_and_the_choices(requested):
    with pytest.raises(PrecisionError, match=f"--precision {requested!r} is not one of auto"):
        choose(requested, "tpu", None)


def test_a_serialized_model_becomes_float32_and_integers_stay():
    config = {"layers": [
        {"class_name": "InputLayer", "config": {"dtype": "int32"}},
        {"class_name": "Dense", "config": {"dtype": {"class_name": "DTypePolicy",
                                                     "config": {"name": "mixed_bfloat16"}}}},
        {"class_name": "Dense", "config": {"dtype": "float16"}},
    ]}
    layers = float32_config(config)["layers"]
    assert [layer["config"]["dtype"] for layer in layers] == ["int32", "float32", "float32"]
    assert low_precision("mixed_float16") and not low_precision("float32")
