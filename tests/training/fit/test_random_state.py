"""A `%%tpu_train` cell on TensorFlow leaves the notebook's random state where plain Keras
leaves it (issue 55): NumPy's and Python's global generators, Keras's global seed generator,
and TensorFlow's global seed and op-seed counter, after a fit of every input kind, shuffled
or not, beside the same cell in plain Keras with the same seed, on 8 replicas and on one.
(Plain Keras's own shuffle on TensorFlow draws from graph-level seeds, none of these; the
magic's own order is seeded from NumPy's state without drawing from it.) The JAX side is
tests/jax_backend/test_random_state_jax.py and tests/training/inputs/test_reads_as_plain_keras.py."""

import numpy as np
import pytest

from support.random_states import DATA, INPUTS, TF_INPUTS, fit_cell, states
from support.same import imports, plainly

KINDS = {**INPUTS, **TF_INPUTS}


@pytest.mark.parametrize("target", ["--simulate 8", "cpu"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_fit_leaves_the_random_state_where_plain_keras_does(fresh, target, kind):
    fresh.run_line_magic("tpu_connect", f"{target} --no-panel")
    setup, arguments = KINDS[kind]
    cell = fit_cell(arguments) + "later = np.random.random(100)\n"
    plain = plainly(DATA + setup, cell)
    theirs = states()
    fresh.run_cell(imports() + DATA + setup)
    fresh.run_cell_magic("tpu_train", "--no-progress", cell)
    assert states() == theirs
    np.testing.assert_array_equal(fresh.user_ns["later"], plain["later"])
