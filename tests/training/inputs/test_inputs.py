"""The decisions of `training/inputs/exactness.py` and `training/inputs/build.py`, one at a time.

They read Keras models, so they run here (Keras imported) and not in tests/unit; nothing is
distributed: plain models on the CPU, and for `Inputs` a stand-in connection whose input
builder records what it was asked for.
"""

from types import SimpleNamespace

import keras
import numpy as np
import pytest
from keras import ops

from tpu_magic.core.arrays import Pipeline
from tpu_magic.core.batching import BatchPlan
from tpu_magic.core.errors import InputError
from tpu_magic.training.inputs import exactness
from tpu_magic.training.inputs.build import Inputs


def _dense(loss="sparse_categorical_crossentropy", cls=keras.Sequential):
    model = cls([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    if loss is not None:
        model.compile("sgd", loss)
    return model


def mean_squared(y_true, y_pred):  # reduces the batch to one number itself
    return ops.mean(ops.square(y_true - y_pred))


def per_sample(y_true, y_pred):  # one value a sample: Keras reduces it
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def test_padding_is_masked_where_keras_steps_compute_a_per_sample_loss():
    plain = _dense()
    assert exactness.keras_steps(plain) and exactness.masks_reach_loss(plain, True)
    assert exactness.why_not_exact(plain, has_targets=True) is None
    assert exactness.masks_reach_loss(_dense(per_sample), True)
    assert exactness.scalar_losses(_dense(per_sample)) == []


@pytest.mark.parametrize("model, targets, words", [
    (lambda: _dense(mean_squared), True,
     "its loss mean_squared reduces a batch to one number itself"),
    (lambda: _dense(), False, "it has no targets or compiled loss (its loss comes from add_loss)"),
    (lambda: _dense(None), True, "it has no targets or compiled loss"),
    (lambda: _dense(cls=OwnStep), True, "its train_step/test_step/compute_loss/compute_metrics "
                                        "are its own"),
])
def test_where_padding_cannot_be_masked_the_note_says_why(model, targets, words):
    built = model()
    assert not exactness.masks_reach_loss(built, targets)
    why = exactness.why_not_exact(built, targets)
    assert why.startswith(words) and "whole batches of real samples only" in why
    assert "evaluate the last few samples" in why
    assert "evaluate runs its last few samples on one device" in \
        exactness.why_not_exact(built, targets, rest_on_one_device=True)


def test_a_scalar_loss_is_found_and_keras_own_losses_are_not():
    assert exactness.scalar_losses(_dense(mean_squared)) == ["mean_squared"]
    assert exactness.scalar_losses(_dense(keras.losses.MeanSquaredError())) == []
    assert not exactness.keras_steps(_dense(cls=OwnStep))


class Recorder:
    """The backend's input builder, recording each pipeline it is asked for."""

    def __init__(self):
        self.asked = []

    def _pipeline(self, kind, x, y, weights, batch, **options):
        samples = len(x)
        self.asked.append(dict(kind=kind, samples=samples, y=y, weights=weights, batch=batch,
                               **options))
        steps = -(-samples // batch)
        return Pipeline(dataset=f"{kind} dataset", steps=steps, samples=samples,
                        padded=steps * batch - samples, left_out=3 if kind == "eval" else 0)

    def train_pipeline(self, x, y, weights, batch, **options):
        return self._pipeline("train", x, y, weights, batch, **options)

    def eval_pipeline(self, x, y, weights, batch, **options):
        return self._pipeline("eval", x, y, weights, batch, **options)


def _inputs(runs_short=False):
    recorder = Recorder()
    backend = SimpleNamespace(inputs=lambda: recorder, runs_short_batches=lambda: runs_short,
                              repeats_input=lambda steps, given: False, evaluates_rest=False)
    connection = SimpleNamespace(backend=backend, replicas=8, tpu_rules=False, strategy=None)
    notes = []
    return Inputs(connection, notes.append, lambda m: "model"), recorder, notes


def _fit_call(x, y, **given):
    call = dict(x=x, y=y, sample_weight=None, validation_split=0.0, validation_data=None,
                class_weight=None, shuffle=True, initial_epoch=0, steps_per_epoch=None)
    call.update(given)
    return call


def test_fit_holds_out_keras_validation_rows_and_folds_class_weight():
    inputs, recorder, notes = _inputs()
    x, y = np.arange(100 * 4, dtype="float32").reshape(100, 4), np.arange(100) % 3
    given = _fit_call(x, y, validation_split=0.2, class_weight={0: 1.0, 1: 2.0, 2: 3.0})
    before = dict(given)
    built = inputs.for_fit(_dense(), given, BatchPlan(32, 8, 4), seed=5)
    train, validation = recorder.asked
    assert (train["kind"], train["samples"], train["seed"], train["remainder"]) == \
        ("train", 80, 5, "pad")
    assert validation["kind"] == "eval" and validation["samples"] == 20
    np.testing.assert_array_equal(train["weights"], np.array([1.0, 2.0, 3.0])[y[:80]])
    call = built.call
    assert built.batch == 32 and call["x"] == "train dataset" and call["validation_split"] == 0.0
    assert call["class_weight"] is None and call["shuffle"] is False and call["y"] is None
    assert call["validation_data"] == "eval dataset" and call["validation_steps"] == 1
    assert notes == [] and dict(built.left_out) == {"validation": 3}
    assert given == before  # the call given is left as it was: a new one comes back
    with pytest.raises(TypeError):
        call["x"] = None  # and that one is read-only


def test_fit_without_targets_refuses_sample_weights():
    inputs, *_ = _inputs()
    x = np.zeros((16, 4), "float32")
    with pytest.raises(InputError, match="fit got sample_weight but no targets"):
        inputs.for_fit(_dense(), _fit_call(x, None, sample_weight=np.ones(16)),
                       BatchPlan(8, 8, 1), seed=0)


def test_a_loss_that_cannot_take_the_mask_drops_the_remainder_and_says_so():
    inputs, recorder, notes = _inputs()
    x, y = np.zeros((30, 3), "float32"), np.zeros((30, 3), "float32")
    inputs.for_fit(_dense(mean_squared), _fit_call(x, y), BatchPlan(16, 8, 2), seed=0)
    assert recorder.asked[0]["remainder"] == "drop" and recorder.asked[0]["batch"] == 16
    assert notes and notes[0].startswith("model 'model': its loss mean_squared reduces")


def test_where_short_batches_run_as_they_are_nothing_is_padded():
    inputs, recorder, notes = _inputs(runs_short=True)
    x, y = np.zeros((12, 4), "float32"), np.zeros(12)
    built = inputs.for_fit(_dense(mean_squared), _fit_call(x, y), BatchPlan(64, 8, 8), seed=0)
    assert recorder.asked[0]["remainder"] == "short" and built.batch == 12 and notes == []


def test_an_input_neither_arrays_nor_batched_goes_to_keras_as_it_is():
    inputs, recorder, _ = _inputs()
    built = inputs.for_fit(_dense(), _fit_call(object(), None), BatchPlan(8, 8, 1), seed=0)
    assert built.batch == 8 and recorder.asked == [] and built.first is None


def test_the_first_batch_is_told_from_the_arrays_without_building_a_pipeline():
    inputs, recorder, _ = _inputs()
    x, y = np.zeros((30, 4), "float32"), np.zeros(30)
    first = inputs.first_batch(_dense(), _fit_call(x, y), BatchPlan(16, 8, 2))
    assert recorder.asked == []  # nothing built
    fx, fy, weights = first  # padded: every batch carries the mask, as the pipeline's do
    assert fx.shape == (16, 4) and fy.shape == (16,) and set(weights) >= {"tpu_magic_mask"}
    inputs, _, _ = _inputs(runs_short=True)
    assert [a.shape for a in inputs.first_batch(_dense(), _fit_call(x, y),
                                                 BatchPlan(64, 8, 8))] == [(30, 4), (30,)]
