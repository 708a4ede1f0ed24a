"""`%%tpu_train` on 8 simulated replicas (as a TPU v2-8) and on 1, with real Keras models."""

import numpy as np
import pytest
import tensorflow as tf
from IPython.core.error import UsageError

import keras
import tpu_magic
from tpu_magic.training.fit.progress import FitProgress, FitTiming

from support.cells import (DENSE, a_fit_near_the_map_limit, dense_model, let_go_is_collected,
                           overrides_kept, train, traced_steps_kept)
from support.data import SETUP
from support.same import cpu_copy

KERAS_FIT, KERAS_PREDICT = keras.Model.fit, keras.Model.predict


def test_a_model_built_in_the_cell_trains_on_8_replicas(digits):
    report = train(digits, DENSE + "history = model.fit(x[:400], y[:400], batch_size=64, epochs=2)")
    model = digits.user_ns["model"]
    assert isinstance(model.weights[0].value, tf.distribute.DistributedValues)
    assert (report.replicas, report.global_batch, report.per_replica, report.epochs) == (8, 64, 8, 2)
    assert report.compile_seconds > 0 and report.samples_per_second > 0
    assert len(report.epoch_seconds) == 2 and set(report.metrics) >= {"loss", "accuracy"}
    assert len(digits.user_ns["history"].history["loss"]) == 2
    assert tpu_magic.workspace().last_model is model and report.model_name == "model"
    assert "64 (8 per replica)" in report.summary()
    assert keras.Model.fit is KERAS_FIT


def test_a_model_the_notebook_lets_go_is_collected_as_in_plain_keras(digits):
    assert let_go_is_collected(digits)


def test_a_fit_near_the_memory_map_limit_frees_the_models_let_go_first_and_says_so(
        digits, monkeypatch):
    assert a_fit_near_the_map_limit(digits, monkeypatch) == (True, True, True)


def test_a_later_cell_runs_the_traced_step_until_the_trainable_set_changes(digits):
    assert traced_steps_kept(digits) == (True, True)


def test_a_built_model_starts_its_calls_without_drawing_a_batch_to_build_it(digits, monkeypatch):
    # Keras's TF fit and evaluate (a fit's validation too) of a model made under a strategy
    # start iterators and draw and average a batch only to build what is unbuilt; once all is
    # built tpu_magic skips that (backends/tf/call_start.py), and draws it where anything is not
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    keras_own, reached = TensorFlowTrainer._maybe_symbolic_build, []

    def counting(self, iterator=None, data_batch=None):
        # a batch drawn to build: Keras's iterator, or its first batch tpu_magic drew from it
        reached.append(iterator is not None or data_batch is not None)
        return keras_own(self, iterator=iterator, data_batch=data_batch)

    monkeypatch.setattr(TensorFlowTrainer, "_maybe_symbolic_build", counting)
    fit = ("history = model.fit(x[:128], y[:128], batch_size=64, epochs=2, verbose=0, "
           "validation_data=(x[128:192], y[128:192]))\n"
           "scores = model.evaluate(x[:64], y[:64], batch_size=64, return_dict=True)")
    train(digits, DENSE + fit)  # the first fit builds the compiled metrics: Keras's own start
    first = len(reached)
    assert first >= 1 and reached[0]
    model = digits.user_ns["model"]
    train(digits, fit)
    assert len(reached) == first  # nothing drawn: two fits' worth of validation and evaluate
    assert "_maybe_symbolic_build" not in model.__dict__  # Keras's own again outside the calls
    history = digits.user_ns["history"].history
    assert len(history["val_loss"]) == 2 and np.isfinite(history["val_loss"]).all()


def test_a_model_class_with_its_own_fit_keeps_it_in_later_cells(digits):
    assert overrides_kept(digits) == (3, 1)


def test_padded_training_step_has_the_gradient_of_the_real_samples(digits):
    digits.run_cell(DENSE + "before = model.get_weights()")
    train(digits, "model.fit(x[:13], y[:13], batch_size=16, epochs=1, shuffle=False)")
    trained = digits.user_ns["model"].get_weights()
    reference = dense_model()
    reference.set_weights(digits.user_ns["before"])
    reference.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    reference.fit(digits.user_ns["x"][:13], digits.user_ns["y"][:13], batch_size=13,
                  shuffle=False, verbose=0)
    for got, want in zip(trained, reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=2e-6)


def test_partial_predict_and_evaluate_equal_the_cpu_copy(digits):
    report = train(digits, DENSE + """
model.fit(x[:256], y[:256], batch_size=64, epochs=1)
six = model.predict(x[:6])
scores = model.evaluate(x[:13], y[:13], batch_size=64, return_dict=True)
plain = model.evaluate(x[:13], y[:13])
""")
    ns = digits.user_ns
    assert ns["six"].shape == (6, 10)
    copy = cpu_copy(ns["model"])
    np.testing.assert_allclose(ns["six"], copy.predict(ns["x"][:6], verbose=0), atol=1e-5)
    want = copy.evaluate(ns["x"][:13], ns["y"][:13], verbose=0, return_dict=True)
    assert ns["scores"]["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert ns["scores"]["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert ns["plain"] == pytest.approx([want["loss"], want["accuracy"]], abs=1e-5)
    assert report.predictions == (6,) and len(report.evaluations) == 2


def test_validation_data_with_a_partial_batch_is_exact(digits):
    train(digits, DENSE + "h = model.fit(x[:128], y[:128], batch_size=64, epochs=1, "
                          "validation_data=(x[1000:1013], y[1000:1013]))")
    ns = digits.user_ns
    want = cpu_copy(ns["model"]).evaluate(ns["x"][1000:1013], ns["y"][1000:1013], verbose=0,
                                          return_dict=True)
    assert ns["h"].history["val_loss"][-1] == pytest.approx(want["loss"], abs=1e-5)
    assert ns["h"].history["val_accuracy"][-1] == pytest.approx(want["accuracy"], abs=1e-6)


def test_validation_split_takes_the_last_samples(digits):
    report = train(digits, DENSE + "h = model.fit(x[:200], y[:200], batch_size=32, "
                                   "validation_split=0.25)")
    assert "val_loss" in digits.user_ns["h"].history and report.epochs == 1


def test_cnn_with_batchnorm_trains_with_a_partial_last_batch(digits):
    report = train(digits, """
keras.utils.set_random_seed(2)
cnn = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
    keras.layers.BatchNormalization(),
    keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Dropout(0.25),
    keras.layers.Flatten(),
    keras.layers.Dense(10, activation="softmax"),
])
cnn.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
images = x.reshape(-1, 8, 8, 1)
cnn.fit(images[:100], y[:100], batch_size=32, epochs=2)
probabilities = cnn.predict(images[:5])
""")
    assert report.epochs == 2 and digits.user_ns["probabilities"].shape == (5, 10)


def test_embedding_lstm_functional_model(digits):
    report = train(digits, """
keras.utils.set_random_seed(3)
words = np.random.randint(1, 500, size=(96, 20))
labels = (words[:, 0] > 250).astype("float32")
inputs = keras.Input((20,))
hidden = keras.layers.Embedding(500, 8)(inputs)
hidden = keras.layers.LSTM(8)(hidden)
lstm = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
lstm.compile("adam", "binary_crossentropy", metrics=["accuracy"])
lstm.fit(words, labels, batch_size=32, epochs=1, validation_data=(words[:10], labels[:10]))
""")
    assert report.epochs == 1 and "val_loss" in report.metrics


def test_subclassed_model_built_in_the_cell(digits):
    report = train(digits, """
class Classifier(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(10, activation="softmax")
    def call(self, inputs):
        return self.out(self.hidden(inputs))
sub = Classifier()
sub.compile("adam", "sparse_categorical_crossentropy")
sub.fit(x[:64], y[:64], batch_size=32)
""")
    assert report.epochs == 1


def test_subclassed_model_built_outside_says_to_build_it_in_the_cell(digits):
    digits.run_cell("""
class Outside(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(10, activation="softmax")
    def call(self, inputs):
        return self.dense(inputs)
outside = Outside()
outside.compile("adam", "sparse_categorical_crossentropy")
outside.fit(x[:32], y[:32], verbose=0)
""")
    with pytest.raises(UsageError, match="Build it inside a %%tpu_train cell"):
        train(digits, "outside.fit(x[:32], y[:32], batch_size=32)")


def test_a_model_built_outside_is_rewrapped_with_its_weights_and_names(digits, capsys):
    digits.run_cell("""
def my_loss(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)
keras.utils.set_random_seed(4)
old = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
old.compile(keras.optimizers.Adam(0.01), my_loss, metrics=["accuracy"])
old.fit(x[:64], y[:64], verbose=0)
alias = old
weights_before = old.get_weights()
""")
    ns = digits.user_ns
    original = ns["old"]
    report = train(digits, "snapshot = old.get_weights()\nold.fit(x[:128], y[:128], batch_size=64)")
    assert ns["old"] is not original and ns["alias"] is ns["old"]
    assert report.rewrapped == ("alias", "old")
    assert isinstance(ns["old"].weights[0].value, tf.distribute.DistributedValues)
    for got, want in zip(ns["snapshot"], ns["weights_before"]):
        np.testing.assert_array_equal(got, want)
    assert ns["old"].optimizer is not original.optimizer
    assert float(ns["old"].optimizer.learning_rate.numpy()) == pytest.approx(0.01)
    assert "rebuilt inside it" in capsys.readouterr().out


@pytest.mark.parametrize("call,message", [
    ("model.fit(x[:200], y[:200], batch_size=100)", "batch_size 100 is not divisible by 8 replicas: use 96 or 104"),
    ("model.evaluate(x[:20], y[:20], batch_size=6)", "batch_size 6 is not divisible by 8 replicas: use 8 or 16"),
    ("model.predict(x[:20], batch_size=0)", "batch_size 0 must be a positive whole number"),
    ("model.fit(tf.data.Dataset.from_tensor_slices((x[:200], y[:200])).batch(100))",
     "the dataset's batch 100 is not divisible by 8 replicas: use 96 or 104"),
])
def test_a_bad_batch_fails_before_training_and_keeps_the_weights(digits, call, message):
    train(digits, DENSE)
    before = digits.user_ns["model"].get_weights()
    with pytest.raises(UsageError) as err:
        train(digits, call)
    assert message in str(err.value)
    for got, want in zip(digits.user_ns["model"].get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_a_bad_batch_size_flag_fails_before_the_cell_runs(digits):
    digits.user_ns.pop("ran", None)
    with pytest.raises(UsageError, match="--batch-size 100 is not divisible by 8 replicas: use 96 or 104"):
        train(digits, "ran = True", "--batch-size 100")
    assert "ran" not in digits.user_ns


@pytest.mark.parametrize("line", ["--epochs 0", "--steps-per-execution 0", "--batch-size x", "--bogus"])
def test_bad_flags_are_usage_errors(digits, line):
    with pytest.raises(UsageError):
        train(digits, "pass", line)


def test_batch_size_and_epochs_flags_fill_in_and_tpu_advice_is_given(digits, capsys):
    report = train(digits, DENSE + "model.fit(x[:192], y[:192])", "--no-progress --batch-size 96 --epochs 2")
    assert (report.global_batch, report.epochs) == (96, 2)
    assert any("12 samples per replica" in n and "multiple of 8" in n for n in report.notes)
    assert "warning:" in capsys.readouterr().out


def test_scale_lr_scales_once_per_model(digits):
    first = train(digits, DENSE + "model.fit(x[:128], y[:128], batch_size=128)", "--no-progress --scale-lr")
    assert float(digits.user_ns["model"].optimizer.learning_rate.numpy()) == pytest.approx(0.8)
    assert any("0.1 → 0.8" in n for n in first.notes)
    train(digits, "model.fit(x[:128], y[:128], batch_size=128)", "--no-progress --scale-lr")
    assert float(digits.user_ns["model"].optimizer.learning_rate.numpy()) == pytest.approx(0.8)


def test_tf_data_input_trains(digits):
    report = train(digits, DENSE + """
ds = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(64)
model.fit(ds, epochs=2)
""")
    assert report.epochs == 2 and report.global_batch == 64


def test_batch_advice_is_said_once_in_the_cells_output(digits, capsys):
    # issue 34: the advice was printed by the cell and again by the report under it
    digits.run_cell("%%tpu_train --no-progress --batch-size 96\n"
                    + DENSE + "model.fit(x[:192], y[:192], epochs=1, verbose=0)\n")
    shown = capsys.readouterr().out
    assert shown.count("is not a multiple of 8") == 1, shown
    assert "notes: 1, shown above" in shown
    assert "is not a multiple of 8" in tpu_magic.workspace().report.summary()  # kept in full


def test_keras_default_shuffle_says_nothing_about_a_dataset_and_the_users_does(digits):
    # issue 34: "`shuffle=True` was passed, but will be ignored" in cells that passed no
    # shuffle (Keras's default; a KerasHub task makes the dataset itself)
    import warnings

    fit = DENSE + """
ds = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(64)
model.fit(ds, epochs=1{})
"""
    for given, said in (("", False), (", shuffle=True", True)):
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            train(digits, fit.format(given))
        assert any("shuffle=True` was passed" in str(w.message) for w in warned) is said, given


def test_static_batch_input_trains_and_predicts_any_count(digits):
    report = train(digits, """
keras.utils.set_random_seed(5)
inputs = keras.Input(batch_shape=(16, 64))
static = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(inputs))
static.compile("adam", "sparse_categorical_crossentropy")
static.fit(x[:300], y[:300], epochs=1)
few = static.predict(x[:6])
""")
    assert report.global_batch == 128 and digits.user_ns["few"].shape == (6, 10)
    with pytest.raises(UsageError, match="static batch size of 16.*use batch_size 128"):
        train(digits, "static.fit(x[:300], y[:300], batch_size=64)")


def test_steps_per_execution_on_one_replica_counts_every_step(fresh):
    fresh.run_line_magic("tpu_connect", "cpu")
    fresh.run_cell(SETUP)
    report = train(fresh, DENSE + "model.fit(x[:640], y[:640], batch_size=64, epochs=2)",
                   "--no-progress --steps-per-execution 4")
    assert fresh.user_ns["model"].steps_per_execution == 4
    assert (report.epochs, report.steps) == (2, 20) and report.samples_per_second > 0


def test_steps_per_execution_under_mirrored_replicas_runs_one_step_and_says_why(digits):
    report = train(digits, DENSE + "model.fit(x[:640], y[:640], batch_size=64, epochs=2)",
                   "--no-progress --steps-per-execution 4")
    assert digits.user_ns["model"].steps_per_execution == 1
    assert any("keras-team/keras#19246" in n for n in report.notes)
    assert (report.epochs, report.steps) == (2, 20)


class RecordingBar:
    """A tqdm stand-in that records where the bar was drawn."""

    made = []

    def __init__(self, total=None, **kwargs):
        self.total, self.n, self.desc, self.positions, self.closed = total, 0, kwargs.get("desc", ""), [], False
        RecordingBar.made.append(self)

    def update(self, k):
        self.n += k
        self.positions.append(self.n)

    def reset(self, total=None):
        self.n, self.total = 0, total

    def set_description(self, desc, refresh=True):
        self.desc = desc

    def set_postfix(self, values, refresh=True):
        self.postfix = values

    def close(self):
        self.closed = True


def test_bar_position_is_absolute_with_steps_per_execution():
    RecordingBar.made = []
    timing = FitTiming(global_batch=32)
    progress = FitProgress(timing, bar=RecordingBar, min_interval=0.0)
    callbacks = keras.callbacks.CallbackList([progress], epochs=2, steps=10)
    callbacks.on_train_begin()
    for epoch in range(2):
        callbacks.on_epoch_begin(epoch)
        for end_step in (3, 7, 9):  # Keras with steps_per_execution=4 calls the hook here
            callbacks.on_train_batch_end(end_step, {"loss": 1.0})
        callbacks.on_epoch_end(epoch, {"loss": 1.0})
    callbacks.on_train_end()
    epochs_bar, batch_bar = RecordingBar.made
    assert batch_bar.positions == [4, 8, 10, 4, 8, 10]
    assert epochs_bar.n == 2 and batch_bar.closed and epochs_bar.closed
    assert timing.steps_done == 20 and timing.steady_steps == 16
    assert batch_bar.desc == "epoch 2/2" and "samples/s" in batch_bar.postfix


def test_batch_hooks_ending_out_of_order_count_the_furthest_step_and_the_first_nan():
    # Keras on JAX runs async-safe callbacks' batch hooks on worker threads, which may end
    # out of order: the bar keeps the furthest step, and the first NaN wherever it arrives.
    RecordingBar.made = []
    timing = FitTiming(global_batch=32)
    progress = FitProgress(timing, bar=RecordingBar, min_interval=0.0)
    assert progress.async_safe
    callbacks = keras.callbacks.CallbackList([progress], epochs=1, steps=10)
    callbacks.on_train_begin()
    callbacks.on_epoch_begin(0)
    for step, loss in ((0, 1.0), (2, 1.0), (5, float("nan")), (1, 1.0), (4, float("nan")),
                       (3, 1.0), (9, float("nan"))):
        callbacks.on_train_batch_end(step, {"loss": loss})
    assert timing.steps_done == 10 and timing.steady_steps == 9
    assert timing.diverged == (1, 5)
    assert RecordingBar.made[1].positions == [1, 3, 6, 10]
    callbacks.on_epoch_end(0, {"loss": float("nan")})
    callbacks.on_train_end()


def test_the_magic_draws_a_live_bar_and_silences_keras(digits, capsys):
    train(digits, DENSE + "model.fit(x[:256], y[:256], batch_size=64, epochs=2)", "")
    err = capsys.readouterr().err
    assert "epochs: 100%" in err and "2/2" in err
    assert "epoch 1/2: 100%" in err and "epoch 2/2: 100%" in err and "4/4" in err
    assert "━━━" not in capsys.readouterr().out  # Keras's own progbar is off


def test_ctrl_c_stops_at_a_batch_boundary_and_keeps_the_weights(digits):
    digits.run_cell("""
import os, signal
class PressCtrlC(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            os.kill(os.getpid(), signal.SIGINT)
""")
    train(digits, DENSE + "start = model.get_weights()")
    with pytest.raises(KeyboardInterrupt):  # an interrupt ends the cell, as in any cell
        train(digits, "model.fit(x[:1024], y[:1024], batch_size=32, epochs=20, callbacks=[PressCtrlC()])")
    report = tpu_magic.workspace().report
    assert report.interrupted and report.epochs <= 1
    ns = digits.user_ns
    assert any(np.abs(a - b).max() > 0 for a, b in zip(ns["model"].get_weights(), ns["start"]))
    again = train(digits, "model.fit(x[:64], y[:64], batch_size=32)")
    assert again.epochs == 1 and not again.interrupted


def test_an_error_in_the_cell_surfaces_unchanged_and_keras_is_restored(digits):
    with pytest.raises(ZeroDivisionError):
        train(digits, "1 / 0")
    assert keras.Model.fit is KERAS_FIT and keras.Model.predict is KERAS_PREDICT


def test_rerunning_a_cell_works(digits):
    cell = DENSE + "model.fit(x[:128], y[:128], batch_size=64)"
    assert train(digits, cell).epochs == 1
    assert train(digits, cell).epochs == 1


def test_one_replica_on_the_cpu(fresh):
    fresh.run_line_magic("tpu_connect", "cpu")
    fresh.run_cell(SETUP)
    report = train(fresh, DENSE + "model.fit(x[:100], y[:100], batch_size=30)\nsix = model.predict(x[:6])")
    assert report.replicas == 1 and report.global_batch == 30
    assert fresh.user_ns["six"].shape == (6, 10)


def test_without_a_connect_it_connects_first(fresh, monkeypatch, capsys):
    from tpu_magic.connecting import connect as connect_module

    monkeypatch.delenv("TPU_NAME", raising=False)
    monkeypatch.setattr(connect_module, "read_machine_signs", connect_module.MachineSigns)
    fresh.run_cell(SETUP)
    report = train(fresh, DENSE + "model.fit(x[:64], y[:64], batch_size=32)")
    assert tpu_magic.session() is not None and report.epochs == 1
    assert "Connected" in capsys.readouterr().out


def test_evaluate_and_predict_default_batch_needs_no_tpu_advice(digits):
    train(digits, DENSE + "model.fit(x[:128], y[:128], batch_size=64)")
    report = train(digits, "rows = model.predict(x[:20])\nscore = model.evaluate(x[:20], y[:20])")
    # Keras's default of 32 would be 4 per replica, which earns the multiple-of-8 advice.
    assert not any("multiple of 8" in n for n in report.notes)
    assert digits.user_ns["rows"].shape == (20, 10) and report.predictions == (20,)


def test_tensorflow_info_lines_are_dropped_only_while_silenced():
    import logging

    from tpu_magic.notebook.quiet import tensorflow_info_silenced

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with tensorflow_info_silenced():
            logger.info("strategy chatter")
            logger.warning("a real warning")
        logger.info("after")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == ["a real warning", "after"]


def test_native_log_level_is_set_only_when_the_user_chose_none(monkeypatch):
    import os

    from tpu_magic.notebook.quiet import quiet_native_logs

    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    quiet_native_logs()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    quiet_native_logs()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"


def test_a_batch_larger_than_the_data_pads_only_to_whole_replicas(digits):
    report = train(digits, DENSE + "p = model.predict(x[:6])\nmodel.fit(x[:40], y[:40], epochs=1)\n"
                                   "e = model.evaluate(x[:13], y[:13], return_dict=True)",
                   "--no-progress --batch-size 800000000")
    assert len(digits.user_ns["p"]) == 6
    assert report.global_batch == 800000000 and report.steps == 1
