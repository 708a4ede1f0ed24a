"""Utilization: FLOPs of a sample, achieved TFLOP/s against the peaks, input-bound or not."""

import pytest

import keras
from tpu_magic.training.fit.progress import FitProgress, FitTiming
from tpu_magic.core.flops import counted_training_flops, forward_flops

CONV = """
keras.utils.set_random_seed(4)
conv = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                         keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
conv.compile("adam", "sparse_categorical_crossentropy")
"""
# Conv2D: 3×3×1×16 weights at 6×6 positions, 2 FLOPs a multiply-add: 2 × 144 × 36 = 10,368.
# Dense: 576 × 10 weights: 11,520. Training: forward, the weights' gradients (as much
# again) and the inputs' gradients above the first layer (the Dense's 11,520).
FORWARD = 10_368 + 11_520
TRAINING = 2 * FORWARD + 11_520


def test_the_count_from_the_layers_is_the_analytic_one(digits):
    digits.run_cell(CONV)
    conv = digits.user_ns["conv"]
    assert forward_flops(conv) == FORWARD and counted_training_flops(conv) == TRAINING
    lstm = keras.Sequential([keras.Input((20,), dtype="int32"), keras.layers.Embedding(50, 8),
                             keras.layers.LSTM(16), keras.layers.Dense(1)])
    # 4 gates × (8 inputs + 16 state) × 16 units, 20 steps; the Embedding costs nothing
    assert forward_flops(lstm) == 2 * 4 * (8 + 16) * 16 * 20 + 2 * 16


def test_the_report_sets_achieved_tflops_against_the_measured_peak(digits):
    check = digits.run_line_magic("tpu_connect", "--simulate 8 --no-panel --check").check
    report = digits.run_cell_magic("tpu_train", "--no-progress", CONV + (
        "conv.fit(x.reshape(-1, 8, 8, 1), y, batch_size=128, epochs=2, verbose=0)"))
    used = report.utilization
    assert used.flops_per_sample == TRAINING and used.source == "counted from the layers"
    assert used.achieved_tflops == pytest.approx(TRAINING * report.samples_per_second / 1e12)
    # 8 simulated replicas share the one CPU --check measured
    assert used.measured_tflops == pytest.approx(check.measured_tflops)
    assert used.nominal_tflops is None  # a CPU has no entry in the chip table
    text = report.summary()
    assert "TFLOP/s = " in text and "of the measured peak" in text
    assert "MFLOP a sample (counted from the layers)" in text
    assert 0 <= used.input_share <= 1 and "reading a batch takes" in used.input_how
    verdicts = [line for line in text.splitlines() if "input-bound" in line]
    assert len(verdicts) == 1 and "(input: " not in text  # said once, with how it was measured
    assert verdicts[0].strip().startswith(("input-bound: reading a batch takes",
                                           "not input-bound: reading a batch takes"))
    assert "(0 %)" not in text  # a share above nothing never reads as none


def test_a_later_fit_of_the_same_pipeline_reuses_the_input_measurement(digits):
    # drawing tpu_magic's own pipeline again after fit starts every replica's iterator; a
    # later fit of the same shapes, samples, batch and replicas reuses the first's figure
    digits.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    fit = "conv.fit(x[:1024].reshape(-1, 8, 8, 1), y[:1024], batch_size={}, epochs=1, verbose=0)"
    first = digits.run_cell_magic("tpu_train", "--no-progress", CONV + fit.format(128)).utilization
    assert "drawn on their own after fit" in first.input_how and first.input_batch_seconds
    again = digits.run_cell_magic("tpu_train", "--no-progress", fit.format(128)).utilization
    assert "drawn after an earlier fit of the same pipeline" in again.input_how
    assert again.input_batch_seconds == first.input_batch_seconds
    assert again.input_key == first.input_key
    other = digits.run_cell_magic("tpu_train", "--no-progress", fit.format(64)).utilization
    assert "drawn on their own after fit" in other.input_how and other.input_key != first.input_key


def test_a_slow_input_is_called_input_bound(digits):
    report = digits.run_cell_magic("tpu_train", "--no-progress", CONV + """
import time
def slow(image, label):
    image = tf.py_function(lambda a: (time.sleep(0.03), a)[1], [image], tf.float32)
    return tf.reshape(image, (-1, 8, 8, 1)), label
slow_data = (tf.data.Dataset.from_tensor_slices((x[:512].reshape(-1, 64), y[:512]))
             .batch(64).map(slow))
conv.fit(slow_data, epochs=1, verbose=0)
""")
    used = report.utilization
    assert used.input_bound and used.input_share >= 0.9
    assert "the data, not the device, sets the pace" in report.summary()
    assert "\n  input-bound: reading a batch takes" in report.summary()


def test_the_bar_shows_tflops():
    shown = []

    class Bar:
        def __init__(self, **kwargs):
            self.n, self.desc = 0, kwargs.get("desc", "")

        def update(self, k):
            self.n += k

        def reset(self, total=None):
            self.n = 0

        def set_description(self, desc, refresh=True):
            self.desc = desc

        def set_postfix(self, values, refresh=True):
            shown.append(values)

        def close(self):
            pass

    timing = FitTiming(global_batch=100, flops_per_sample=2e9)  # 0.2 TFLOP a step
    callbacks = keras.callbacks.CallbackList([FitProgress(timing, bar=Bar, min_interval=0.0)],
                                             epochs=1, steps=3)
    callbacks.on_train_begin()
    callbacks.on_epoch_begin(0)
    for step in range(3):
        callbacks.on_train_batch_begin(step)
        callbacks.on_train_batch_end(step, {"loss": 1.0})
    callbacks.on_epoch_end(0, {"loss": 1.0})
    callbacks.on_train_end()
    assert timing.tflops == pytest.approx(2e9 * timing.samples_per_second / 1e12)
    assert "TFLOP/s" in shown[-1] and "samples/s" in shown[-1]
