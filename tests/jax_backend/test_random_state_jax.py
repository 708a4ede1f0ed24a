"""A `%%tpu_train` cell leaves the notebook's random state where plain Keras leaves it (issue
55): NumPy's and Python's global generators and Keras's global seed generator, after a fit
of every input kind, shuffled or not, beside the same cell in plain Keras with the same
seed, on 8 devices (this suite's) and on one. Where plain Keras draws (a shuffled array's
order each pass, a shuffled `PyDataset`'s), the magic draws the same, so its data order is
plain Keras's too."""

import numpy as np
import pytest

from support.random_states import DATA, INPUTS, fit_cell, states
from support.same import imports, plainly, same_history, same_weights


def _plain_and_ours(ip, setup, cell, line="--no-progress"):
    plain = plainly(DATA + setup, cell)
    theirs = states()
    ip.run_cell(imports() + DATA + setup)
    ip.run_cell_magic("tpu_train", line, cell)
    return plain, ip.user_ns, theirs, states()


@pytest.mark.parametrize("kind", list(INPUTS))
def test_a_fit_leaves_the_random_state_where_plain_keras_does(ip, kind):
    setup, arguments = INPUTS[kind]
    plain, ours, theirs, mine = _plain_and_ours(ip, setup, fit_cell(arguments))
    assert mine == theirs
    same_history(plain, ours)
    same_weights(plain, ours)


def test_a_later_section_draws_the_same_data_after_a_shuffled_fit(ip):
    setup, arguments = INPUTS["arrays shuffled"]
    cell = fit_cell(arguments) + "later = np.random.random(1000)\n"
    plain, ours, _, _ = _plain_and_ours(ip, setup, cell)
    np.testing.assert_array_equal(ours["later"], plain["later"])


@pytest.mark.parametrize("line", ["--shard model --mesh 2x4", "--steps-per-execution 4"])
def test_a_shuffled_fit_sharded_or_grouped_draws_as_plain_keras(ip, line):
    setup, arguments = INPUTS["arrays shuffled"]
    plain, ours, theirs, mine = _plain_and_ours(ip, setup, fit_cell(arguments),
                                                f"--no-progress {line}")
    assert mine == theirs
    same_history(plain, ours)


def test_a_resumed_fit_draws_what_plain_keras_draws_from_its_epoch(ip, tmp_path):
    # plain Keras's counterpart of --resume: a new model trained from the epoch it resumes at
    setup, arguments = INPUTS["arrays shuffled"]
    first, rest = fit_cell(arguments, epochs=1), fit_cell(arguments, epochs=3)
    plainly(DATA + setup, first + rest.replace("verbose=0", "initial_epoch=1, verbose=0"))
    theirs = states()
    ip.run_cell(imports() + DATA + setup)
    ip.run_cell_magic("tpu_train", f"--no-progress --checkpoint {tmp_path}", first)
    ip.run_cell_magic("tpu_train", f"--no-progress --checkpoint {tmp_path} --resume", rest)
    assert ip.user_ns["history"].epoch == [1, 2]
    assert states() == theirs


# keras.Model.fit's docstring: `x` a generator (with steps_per_epoch), `validation_data` a
# generator (with validation_steps). Plain Keras first reads the validation generator at the
# first validation, after the first epoch's training batches; two generators that draw from
# NumPy's global generator must be read in that order, or they train and validate on other
# data.
GENERATORS = """
order = []
def batches(name, batch_size):
    i = 0
    while True:
        order.append(f"{name}{i}")
        i += 1
        xb = np.random.rand(batch_size, 8).astype("float32")
        yield xb, (xb.sum(1) > 4).astype("int32")
"""


@pytest.mark.parametrize("line", ["--no-progress", "--no-progress --steps-per-execution 4"])
def test_training_and_validation_generators_are_read_in_plain_keras_order(ip, line):
    cell = """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
model.compile("sgd", "sparse_categorical_crossentropy")
history = model.fit(batches("t", 16), steps_per_epoch=7, epochs=2, verbose=0,
                    validation_data=batches("v", 16), validation_steps=2)
"""
    plain, ours, theirs, mine = _plain_and_ours(ip, GENERATORS, cell, line)
    assert plain["order"][7:9] == ["v0", "v1"]  # after the first epoch's 7 batches
    assert ours["order"] == plain["order"]
    assert mine == theirs
    same_history(plain, ours)
