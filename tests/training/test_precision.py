"""--precision: the dtype policy of the models a cell builds, float32 outputs, float32 copies."""

import numpy as np
import pytest
from IPython.core.error import UsageError

import keras
from support.cells import DENSE, train

CNN = """
keras.utils.set_random_seed(2)
cnn = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                        keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
cnn.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
history = cnn.fit(x[:512].reshape(-1, 8, 8, 1), y[:512], batch_size=64, epochs=3, verbose=0)
"""


def _loss(ip, line):
    report = train(ip, CNN, f"--no-progress {line}".strip())
    return report, ip.user_ns["cnn"], ip.user_ns["history"].history["loss"][-1]


def test_mixed_bfloat16_computes_in_bf16_with_float32_variables_and_output(digits, capsys):
    _, _, reference = _loss(digits, "--precision fp32")
    report, cnn, loss = _loss(digits, "--precision mixed_bf16")
    conv, dense = cnn.layers[0], cnn.layers[-1]
    assert report.precision == "mixed_bfloat16 (--precision mixed_bf16)"
    assert (conv.kernel.dtype, conv.compute_dtype) == ("float32", "bfloat16")
    assert (dense.kernel.dtype, dense.compute_dtype) == ("float32", "float32")  # the softmax
    assert cnn(np.zeros((2, 8, 8, 1), "float32")).dtype == "float32"
    notes = [n for n in report.notes if "compute in float32" in n or "computes in float32" in n]
    assert len(notes) == 1 and dense.name in notes[0]
    assert loss == pytest.approx(reference, rel=0.05)  # close to float32 training
    assert keras.config.dtype_policy().name == "float32"  # the global policy came back


def test_the_cpu_copy_and_checkpoints_are_float32(digits, tmp_path):
    train(digits, CNN, f"--no-progress --precision bf16 --checkpoint {tmp_path}")
    cnn = digits.user_ns["cnn"]
    assert cnn.layers[0].kernel.dtype == "bfloat16"  # pure bfloat16: variables too
    sync = digits.run_line_magic("tpu_sync", "cnn")
    copy = digits.user_ns["cnn_cpu"]
    assert {w.dtype for w in copy.weights} == {"float32"}
    assert copy.dtype_policy.name == "float32" and copy.layers[0].compute_dtype == "float32"
    assert sync.max_abs_diff < 0.05  # bfloat16 against float32 compute on the same weights
    from tpu_magic.training.checkpoints.one_file import read_checkpoint

    newest = sorted(tmp_path.glob("ckpt-*.h5"))[-1]
    assert {a.dtype for a in read_checkpoint(newest).weights.arrays} == {np.dtype("float32")}
    plain = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
    plain.set_weights(list(read_checkpoint(newest).weights.arrays))  # loads into float32


def test_float16_with_loss_scaling_trains_without_nan(digits):
    report, cnn, loss = _loss(digits, "--precision fp16")
    assert type(cnn.optimizer).__name__ == "LossScaleOptimizer"
    assert cnn.layers[0].compute_dtype == "float16" and np.isfinite(loss)
    assert all(np.all(np.isfinite(w)) for w in cnn.get_weights())


def test_a_model_built_before_the_cell_keeps_float32_and_says_so(digits):
    digits.run_cell(DENSE)
    report = train(digits, "model.fit(x[:256], y[:256], batch_size=64, epochs=1)",
                   "--no-progress --precision mixed_bf16")
    model = digits.user_ns["model"]
    assert model.layers[0].compute_dtype == "float32"
    assert any("was built before this cell with float32: it keeps float32" in n
               and "'model'" in n for n in report.notes)


def test_auto_is_float32_on_the_cpu_and_a_bad_value_loses_nothing(digits):
    report, cnn, _ = _loss(digits, "--precision auto")
    assert report.precision.startswith("float32 (auto: the CPU")
    assert cnn.layers[0].compute_dtype == "float32"
    before = [w.copy() for w in cnn.get_weights()]
    with pytest.raises(UsageError, match="--precision 'half' is not one of auto, bf16"):
        train(digits, "cnn.fit(x[:64].reshape(-1, 8, 8, 1), y[:64], batch_size=64)",
              "--no-progress --precision half")
    assert all(np.array_equal(a, b) for a, b in zip(before, cnn.get_weights()))


def test_the_default_precision_is_configurable(digits):
    digits.run_line_magic("config", "TpuMagics.precision = 'mixed_bf16'")
    try:
        report, cnn, _ = _loss(digits, "")
        assert report.precision.startswith("mixed_bfloat16")
    finally:
        digits.run_line_magic("config", "TpuMagics.precision = ''")
    report, cnn, _ = _loss(digits, "")
    assert report.precision is None and cnn.layers[0].compute_dtype == "float32"
