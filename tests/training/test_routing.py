"""Routing restores exactly what `keras.Model` held: overlapping cells on two threads, and a
patch someone else made (a tracking library's `fit` wrapper) between cells."""

import functools
import threading

import numpy as np
import pytest

import keras
from tpu_magic.training import routing

from support.cells import DENSE, train


class Recording:
    """A router that records what reached it and answers with the model's name."""

    def __init__(self):
        self.calls = []

    def route(self, name, model, call, named):
        self.calls.append((name, sorted(named)))
        return model.name


def test_overlapping_cells_on_two_threads_restore_what_was_there():
    before = keras.Model.__dict__.get("fit")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    first, second = Recording(), Recording()
    second_in, first_out = threading.Event(), threading.Event()
    seen = {}

    def other_cell():
        with routing.cell(second):
            second_in.set()
            first_out.wait(30)
            # the first cell ended on its thread: this one's calls are still routed here
            seen["second"] = model.fit(np.zeros((2, 2)), np.zeros((2, 1)), epochs=3)

    thread = threading.Thread(target=other_cell)
    with routing.cell(first):
        thread.start()
        second_in.wait(30)
        seen["first"] = model.fit(np.zeros((2, 2)), np.zeros((2, 1)))
    first_out.set()
    thread.join(30)
    assert seen == {"first": model.name, "second": model.name}
    assert first.calls == [("fit", ["self", "x", "y"])]
    assert second.calls == [("fit", ["epochs", "self", "x", "y"])]
    assert keras.Model.__dict__.get("fit") is before  # exactly: Keras's inherited method


def test_a_foreign_patch_made_between_cells_survives_and_sees_the_fit(digits):
    calls = []
    keras_fit = keras.Model.fit

    @functools.wraps(keras_fit)
    def tracked_fit(self, *args, **kwargs):  # as an experiment tracker patches it
        calls.append(self.name)
        return keras_fit(self, *args, **kwargs)

    train(digits, DENSE + "model.fit(x[:64], y[:64], batch_size=64, verbose=0)")
    keras.Model.fit = tracked_fit
    try:
        report = train(digits, DENSE + "model.fit(x[:64], y[:64], batch_size=64, verbose=0)")
        assert report.fits == 1 and len(calls) == 1  # routed, and the tracker saw Keras's fit
        assert keras.Model.__dict__["fit"] is tracked_fit  # restored exactly
    finally:
        del keras.Model.fit
    assert keras.Model.fit is keras_fit


def test_a_wrapper_without_keras_signature_does_not_break_the_cell(digits):
    keras_fit = keras.Model.fit

    def bare_wrapper(self, *args, **kwargs):  # no functools.wraps: its signature is *args
        return keras_fit(self, *args, **kwargs)

    keras.Model.fit = bare_wrapper
    try:
        report = train(digits, DENSE + "model.fit(x[:64], y[:64], 32, 1, verbose=0)")
        assert report.fits == 1 and report.global_batch == 32 and report.epochs == 1
    finally:
        del keras.Model.fit
    with pytest.raises(AttributeError):
        del keras.Model.fit  # nothing of ours was left on the class
