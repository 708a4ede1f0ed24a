"""'The same as plain Keras on one device': the comparison every published-code test makes.

A cell runs twice from the same seed: plainly, in a namespace of its own (one device, no
tpu_magic, the same Keras backend as the process), and through `%%tpu_train` in the test
shell. The helpers here compare what the two runs left behind; `cpu_copy` and
`evaluate_equals_cpu_copy` compare a trained model with its copy outside every strategy.
Backend-agnostic: the TF suite (tests/training/published/, tests/training/test_train.py) and
the JAX suite (tests/jax_backend) both use them.
"""

from __future__ import annotations

import numpy as np
import pytest

# keras is imported inside the helpers: the JAX suite imports this module before its
# `%tpu_connect` has chosen Keras's backend.

TOLERANCE = dict(rel=1e-4, abs=1e-5)


def imports() -> str:
    """A cell's first lines, for the process's backend (TensorFlow is not importable on JAX's)."""
    import keras

    tf = ", tensorflow as tf" if keras.backend.backend() == "tensorflow" else ""
    return f"import numpy as np, keras{tf}\nkeras.utils.set_random_seed(7)\n"


def plainly(setup: str, cell: str, data_parallel: bool = False) -> dict:
    """Runs `setup` and `cell` with plain Keras on one device (`data_parallel`: under Keras's
    own `DataParallel` over the process's devices, JAX only). Returns their namespace."""
    namespace: dict = {}
    distribution = _distribution()
    try:
        exec(imports() + setup, namespace)
        if data_parallel:
            _set_distribution(namespace["keras"].distribution.DataParallel())
        exec(cell, namespace)
    finally:  # a cell's own keras.distribution must not reach the magic's run
        _set_distribution(distribution)
    return namespace


def both(ip, setup: str, cell: str, line: str = "--no-progress"):
    """Runs `setup` and `cell` plainly, then `setup` in the shell and `cell` through
    %%tpu_train. Returns (the plain namespace, the shell's, the report)."""
    plain = plainly(setup, cell)
    ip.run_cell(imports() + setup)
    report = ip.run_cell_magic("tpu_train", line, cell)
    return plain, ip.user_ns, report


def same_history(plain, ours, name="history", tolerance=TOLERANCE):
    theirs, mine = plain[name].history, ours[name].history
    assert sorted(mine) == sorted(theirs)
    for key, values in theirs.items():
        assert mine[key] == pytest.approx(values, **tolerance), \
            f"{key}\nplain: {short(theirs)}\nmagic: {short(mine)}"


def same_history_keys(plain, ours, name="history"):
    assert sorted(ours[name].history) == sorted(plain[name].history)


def same_weights(plain, ours, model="model", atol=1e-5):
    mine, theirs = ours[model].get_weights(), plain[model].get_weights()
    assert len(mine) == len(theirs)
    for a, b in zip(theirs, mine):
        np.testing.assert_allclose(b, a, atol=atol)


def same_values(plain, ours, name, tolerance=TOLERANCE):
    """A result (a number, a list of them, a dict of them, or arrays) equal in both runs;
    a failure shows both (plain first)."""
    try:
        _same_values(plain[name], ours[name], tolerance)
    except AssertionError as error:
        raise AssertionError(f"{error}\nplain: {short(plain[name])}\n"
                             f"magic: {short(ours[name])}") from None


def short(value):
    """A run's result, shortened for a failure message."""
    if isinstance(value, dict):
        return {key: short(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"{type(value).__name__} of {len(value)}: {short(value[0])} ..."
    if hasattr(value, "shape") and getattr(value, "size", 1) > 8:
        value = np.asarray(value)
        return f"array{value.shape} first {value.ravel()[:4]} mean {value.mean():.6g}"
    return value


def _same_values(theirs, mine, tolerance):
    import keras

    if isinstance(theirs, dict):
        assert sorted(mine) == sorted(theirs)
        for key in theirs:
            assert mine[key] == pytest.approx(theirs[key], **tolerance), key
        return
    flat_theirs, flat_mine = keras.tree.flatten(theirs), keras.tree.flatten(mine)
    assert len(flat_mine) == len(flat_theirs)
    for a, b in zip(flat_theirs, flat_mine):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=tolerance["rel"],
                                   atol=tolerance["abs"])


def cpu_copy(model):
    """The same model outside every strategy (what %tpu_sync will make), compiled as
    `support.cells.DENSE` compiles its model, for reference results in this process."""
    import keras

    copy = model.__class__.from_config(model.get_config())
    copy.set_weights(model.get_weights())
    copy.compile(keras.optimizers.SGD(0.1), model.loss, metrics=["accuracy"])
    return copy


def evaluate_equals_cpu_copy(ip, model, x, y, atol=1e-5):
    """`model.evaluate` in a later plain cell (tpu_magic still routes it) equals its CPU copy's.

    The copy evaluates all samples in one batch: plain Keras logs per-output losses of a
    multi-output model batch-averaged (a last, partial batch counts as a whole one), so
    only one batch gives the exact means the magic reports.
    """
    ip.run_line_magic("tpu_sync", f"{model} --as reference_copy")
    ip.run_cell(f"ours = {model}.evaluate({x}, {y}, return_dict=True, verbose=0)\n"
                f"theirs = reference_copy.evaluate({x}, {y}, return_dict=True, verbose=0, "
                f"batch_size=len(keras.tree.flatten({y})[0]))")
    ours, theirs = ip.user_ns["ours"], ip.user_ns["theirs"]
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key], abs=atol), key


def fit_equals_evaluate_at_lr0(ip, model, x, y, batch):
    """With learning rate 0, fit's epoch logs are evaluate's on the same data (plain Keras's
    own property; the last, partial batch must count by its real samples)."""
    ip.run_cell(f"{model}.optimizer.learning_rate = 0.0\n"
                f"h0 = {model}.fit({x}, {y}, batch_size={batch}, epochs=1, shuffle=False, "
                "verbose=0)\n"
                f"e0 = {model}.evaluate({x}, {y}, batch_size={batch}, return_dict=True, verbose=0)")
    history, evaluation = ip.user_ns["h0"].history, ip.user_ns["e0"]
    assert sorted(history) == sorted(evaluation)
    for key, value in evaluation.items():
        assert history[key][0] == pytest.approx(value, abs=1e-5), key


def _distribution():
    import keras

    if keras.backend.backend() != "jax":
        return None
    return keras.distribution.distribution()


def _set_distribution(distribution) -> None:
    import keras

    if keras.backend.backend() == "jax":
        keras.distribution.set_distribution(distribution)


def run_cell(ip, code: str):
    """Runs `code` as a plain cell in the test shell and raises what it raised (IPython's
    `run_cell` only prints a cell's error)."""
    result = ip.run_cell(code)
    result.raise_error()
    return result
