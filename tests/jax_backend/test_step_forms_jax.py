"""It fits (issue 58), on 8 simulated devices: a step run as micro-batches inside the step
(`--microbatches N`, or chosen by the memory plan where the step does not fit a device)
equals plain Keras at the full batch, and rematerialized blocks change no number. The
device's memory is rehearsed with `TPU_MAGIC_DEVICE_MEMORY_BYTES`: a limit under the plan
of the step as written makes the plan choose a form that fits, said in its line; with
`--memory off` the step is refused, the refusal's savings planned."""

import numpy as np
import pytest
from IPython.core.error import UsageError

import tpu_magic
from support.cells import train
from support.same import both, same_history, same_weights
from support.step_forms import CNN, CNN_DATA, GEMMA, GEMMA_DATA, SEQUENCE, SEQUENCE_DATA

LIMIT = "TPU_MAGIC_DEVICE_MEMORY_BYTES"
TIGHT = dict(rel=1e-5, abs=1e-6)
MLP_DATA = """
rs = np.random.RandomState(4)
rows = rs.rand(128, 64).astype("float32")
labels = rs.randint(0, 4, 128)
"""
MLP = """
keras.utils.set_random_seed(6)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                          keras.layers.Dense(512, activation="relu"),
                          keras.layers.Dense(4, activation="softmax")])
model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy")
history = model.fit(rows, labels, batch_size=64, epochs=2, shuffle=False, verbose=0)
"""

@pytest.mark.parametrize("placement", ["", "--shard model --mesh 2x4"])
def test_micro_batches_give_the_full_batchs_weights_metrics_and_schedule(ip, placement):
    plain, ours, report = both(ip, CNN_DATA, CNN, f"--no-progress --microbatches 4 {placement}")
    assert "4 micro-batches of 16 (the same update as batch 64)" in report.memory_plan
    same_history(plain, ours, tolerance=TIGHT)
    same_weights(plain, ours, atol=1e-6)
    assert ours["iterations"] == plain["iterations"] == 8  # once a batch


def test_a_masked_sequence_model_is_weighed_by_the_whole_batchs_tokens(ip):
    plain, ours, report = both(ip, SEQUENCE_DATA, SEQUENCE, "--no-progress --microbatches 4")
    assert "4 micro-batches" in report.memory_plan
    same_history(plain, ours, tolerance=TIGHT)
    same_weights(plain, ours, atol=1e-6)


def test_a_kerashub_causal_lm_with_lora_in_micro_batches_equals_plain_keras(ip):
    plain, ours, report = both(ip, GEMMA_DATA, GEMMA, "--no-progress --microbatches 2")
    assert "2 micro-batches of 8" in report.memory_plan
    same_history(plain, ours, tolerance=TIGHT)
    same_weights(plain, ours, "lm", atol=1e-6)


def test_rematerialized_blocks_change_no_number(ip):
    plain, ours, report = both(ip, GEMMA_DATA, GEMMA, "--no-progress --remat on")
    assert "its repeated blocks rematerialized" in report.memory_plan
    same_history(plain, ours, tolerance=TIGHT)
    same_weights(plain, ours, "lm", atol=1e-6)


def test_a_step_that_does_not_fit_trains_as_the_plan_chooses(ip, monkeypatch):
    ip.run_cell(CNN_DATA)
    written = train(ip, CNN)  # as written: the plan's peak
    peak = float(written.memory_plan.split("memory plan: ")[1].split()[0])
    monkeypatch.setenv(LIMIT, str(int(0.7 * peak * 2**30)))
    plain, ours, report = both(ip, CNN_DATA, CNN)
    line = report.memory_plan
    assert "is more than 90 %" in line and "micro-batches" in line and "planned in" in line, line
    same_history(plain, ours, tolerance=TIGHT)
    same_weights(plain, ours, atol=1e-6)
    with pytest.raises(UsageError, match="Nothing has run .* What would change the numbers, "
                                         "planned, largest saving first: half the batch "
                                         "saves"):
        train(ip, CNN, "--no-progress --memory off")


def test_a_check_whose_copy_of_the_state_would_not_fit_beside_the_step_is_skipped_and_said(
        ip, monkeypatch):
    # a chip's memory rehearsed: room for the step, not for the check's one-device copy of
    # the model's state beside it (an MLP's, all trainable, with its optimizer's momentum:
    # the most of its step)
    from tpu_magic.core.steps import copied_bytes

    ip.run_cell(MLP_DATA)
    written = train(ip, MLP, "--no-progress --verify off")
    peak = float(written.memory_plan.split("memory plan: ")[1].split()[0]) * 2**30
    copy = copied_bytes(ip.user_ns["model"])
    assert copy > 0.5 * peak, (copy, peak)
    monkeypatch.setenv(LIMIT, str(int((1.05 * peak + 0.5 * copy) / 0.9)))
    plain, ours, report = both(ip, MLP_DATA, MLP)
    assert "is more than 90 %" not in report.memory_plan, report.memory_plan  # the step fits
    assert any(note.startswith("the first step is not compared with one device: its "
                               "one-device step would hold a copy of the model's state")
               for note in report.notes), report.notes
    same_history(plain, ours, tolerance=TIGHT)
    same_weights(plain, ours, atol=1e-6)
    monkeypatch.delenv(LIMIT)  # with room, the same cell is checked
    assert not any("not compared" in note for note in train(ip, MLP).notes)


def test_micro_batches_say_what_is_not_the_full_batchs(ip):
    ip.run_cell(CNN_DATA)
    cell = CNN.replace("keras.layers.Flatten(),", "keras.layers.BatchNormalization(), "
                                                   "keras.layers.Flatten(), "
                                                   "keras.layers.Dropout(0.2),")
    report = train(ip, cell, "--no-progress --microbatches 2")
    notes = " ".join(report.notes)
    assert "normalize each of the 2 micro-batches by its own statistics" in notes
    assert "--microbatches 2: not the full batch's numbers, since it draws random numbers" \
        in notes
    assert np.isfinite(ip.user_ns["history"].history["loss"]).all()


WIDE = """
rs = np.random.RandomState(6)
rows = rs.rand(4096, 32).astype("float32")
classes = rs.randint(0, 3, 4096)
keras.utils.set_random_seed(7)
wide = keras.Sequential([keras.Input((32,))] +
                        [keras.layers.Dense(256, activation="relu") for _ in range(3)] +
                        [keras.layers.Dense(3, activation="softmax")])
wide.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""
INFERENCE = """
out = wide.predict(rows, batch_size=4096, verbose=0)
evaluation = wide.evaluate(rows, classes, batch_size=4096, return_dict=True, verbose=0)
"""


def test_a_prediction_and_an_evaluation_that_do_not_fit_run_in_batches_that_do(
        ip, monkeypatch):
    from tpu_magic.backends.jax.memory import call_memory

    ip.run_cell(WIDE)
    train(ip, "wide.predict(rows[:8], verbose=0)")  # built on the devices
    wide, rows = ip.user_ns["wide"], ip.user_ns["rows"]
    with tpu_magic.session().strategy.scope():  # laid out as the cell lays batches out
        whole, half = (call_memory(wide, "predict", (rows[:n],)).peak for n in (4096, 2048))
    limit = half / 0.9 * 1.01  # the half batch fits with the plan's headroom, the whole not
    assert whole > 0.9 * limit
    monkeypatch.setenv(LIMIT, str(int(limit)))
    plain, ours, report = both(ip, WIDE, INFERENCE)
    assert any("predict's batch of 4096 needs more than 90 %" in note and
               "it runs in batches of 2048" in note for note in report.notes), report.notes
    np.testing.assert_allclose(ours["out"], plain["out"], rtol=1e-6, atol=1e-7)
    for key, value in plain["evaluation"].items():
        assert ours["evaluation"][key] == pytest.approx(value, rel=1e-6), key


def test_a_causal_lm_whose_step_does_not_fit_trains_as_plain_keras_at_the_full_batch(
        ip, monkeypatch):
    # a chip's memory rehearsed: a limit under the data-parallel step's plan
    ip.run_cell(GEMMA_DATA)
    written = train(ip, GEMMA)
    peak = float(written.memory_plan.split("memory plan: ")[1].split()[0])
    monkeypatch.setenv(LIMIT, str(int(0.8 * peak * 2**30)))
    plain, ours, report = both(ip, GEMMA_DATA, GEMMA)
    assert "is more than 90 %" in report.memory_plan, report.memory_plan
    same_history(plain, ours, tolerance=TIGHT)
    same_weights(plain, ours, "lm", atol=1e-6)
