"""K steps an execution on TensorFlow (`backends/tf/executions.py`): where Keras's own loop
can run them (one device, a TPU) tpu_magic chooses K itself, as on JAX, and K steps give
what one step at a time gives in plain Keras; under MirroredStrategy with several replicas
one step an execution runs, and the report says why."""

import numpy as np
import pytest

from support.cells import GROUPED_MODEL, grouped_data, grouped_fit, train
from support.same import plainly, same_history, same_weights

# 250 steps an epoch (8000 rows, batch 32), validation and evaluation with short batches
SETUP = grouped_data(8000)
MODEL = GROUPED_MODEL
FIT = grouped_fit(epochs=2)


@pytest.fixture
def one_device(fresh):
    fresh.run_line_magic("tpu_connect", "cpu --no-panel")
    fresh.run_cell(SETUP)
    return fresh


def test_auto_runs_several_steps_an_execution_with_plain_keras_numbers(one_device):
    report = train(one_device, MODEL + FIT)
    k = report.execution.k
    assert k > 1 and 250 % k == 0, report.execution  # the epoch's 250 steps: whole executions
    assert report.execution.why.startswith("auto: a step takes "), report.execution
    assert f"steps per execution: {k} (auto" in report.summary()
    ours = one_device.user_ns
    assert ours["model"].steps_per_execution == 1  # the model's own K, as the user left it
    plain = plainly(SETUP, MODEL + FIT)
    same_history(plain, ours)
    same_weights(plain, ours)
    np.testing.assert_allclose(ours["rows_out"], plain["rows_out"], rtol=1e-5, atol=1e-6)
    for key, value in plain["evaluation"].items():
        assert ours["evaluation"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_a_later_cell_at_the_same_k_traces_nothing(one_device):
    train(one_device, MODEL + "model.fit(x, y, batch_size=32, epochs=1, verbose=0)")
    model = one_device.user_ns["model"]
    from tpu_magic.core import record

    kept = dict(record.of(model).functions)
    assert kept  # the traced functions of K, kept
    again = train(one_device, "model.fit(x, y, batch_size=32, epochs=1, verbose=0)")
    assert again.execution.k > 1
    assert record.of(model).functions == kept  # the same traced functions


def test_steps_a_dataset_names_are_whole_executions(one_device):
    """Endless datasets with `steps_per_epoch=40` and `validation_steps=6`: Keras runs whole
    executions of K on them, so K divides both (2, where 4 executions an epoch alone would
    give 10 and the validation would read 10 batches, not 6): plain Keras's history."""
    cell = MODEL + """
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
held = tf.data.Dataset.from_tensor_slices((x[:500], y[:500])).batch(32).repeat()
history = model.fit(data, steps_per_epoch=40, epochs=3, validation_data=held,
                    validation_steps=6, verbose=0)
"""
    setup = SETUP + "import tensorflow as tf\n"
    plain = plainly(setup, cell)
    one_device.run_cell("import tensorflow as tf")
    report = train(one_device, cell)
    assert report.execution.k == 2 and report.steps == 120, report.execution
    assert "the call's 2 steps a pass, which K divides" in report.execution.why
    same_history(plain, one_device.user_ns)


def test_mirrored_replicas_run_one_step_an_execution_and_say_why(sim8):
    sim8.run_cell(SETUP)
    report = train(sim8, MODEL + "model.fit(x, y, batch_size=64, epochs=1, verbose=0)")
    assert report.execution.k == 1
    assert "keras-team/keras#19246" in report.execution.why
