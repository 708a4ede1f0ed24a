"""The magics on Keras's JAX backend: `DataParallel` over 8 simulated devices."""

import sys

import numpy as np
import pytest
from IPython.core.error import UsageError

import tpu_magic
from support.cells import (CNN, DENSE, FIT_256, a_fit_near_the_map_limit, let_go_is_collected,
                           overrides_kept, train, traced_steps_kept)
from support.data import DIGITS
from support.same import plainly, same_history

LSTM = """
keras.utils.set_random_seed(0)
words = (x[:, :40] * 16).astype("int32")
inputs = keras.Input((40,), dtype="int32")
hidden = keras.layers.LSTM(16)(keras.layers.Embedding(17, 8)(inputs))
lstm = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
lstm.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


def test_connect_uses_data_parallel_over_8_devices_and_no_tensorflow(ip):
    result = ip.connected
    assert (result.backend, result.strategy_name, result.replicas) == ("jax", "DataParallel", 8)
    assert tpu_magic.session().backend.name == "jax"
    assert "tensorflow" not in sys.modules
    assert "Keras on JAX" in result.summary()
    assert "TensorFlow cannot be imported here and JAX can" in result.summary()
    # a rehearsal never starts libtpu (whose stderr would land in the cell)
    import os

    from tpu_magic.core.process import ENVIRONMENT_SET

    assert os.environ.get("JAX_PLATFORMS") == "cpu" and "JAX_PLATFORMS" in ENVIRONMENT_SET


def test_the_device_check_measures_jax(ip):
    check = ip.run_line_magic("tpu_connect", "--simulate 8 --check --no-panel").check
    assert check.device_count == 8 and check.measured_tflops > 0
    assert "jax" in check.versions


def test_the_seed_cnn_trains_with_a_partial_last_batch(ip, tmp_path):
    report = train(ip, CNN + "cnn.fit(images[:1000], y[:1000], batch_size=128, epochs=2, "
                             "validation_data=(images[1000:1013], y[1000:1013]))",
                   f"--no-progress --checkpoint {tmp_path}")
    assert report.strategy == "DataParallel" and report.epochs == 2
    assert len(report.checkpoints) == 2 and "tensorflow" not in sys.modules
    assert report.global_batch == 128 and report.per_replica == 16
    assert np.isfinite(report.metrics["loss"]) and "val_loss" in report.metrics


def test_a_model_the_notebook_lets_go_is_collected_as_in_plain_keras(ip):
    assert let_go_is_collected(ip)


def test_a_fit_near_the_memory_map_limit_frees_the_models_let_go_first_and_says_so(
        ip, monkeypatch):
    # XLA:CPU maps each program's code; a process at vm.max_map_count dies in the next
    # compile (a segmentation fault, rehearsed with the limit lowered: docs/limits.md)
    assert a_fit_near_the_map_limit(ip, monkeypatch) == (True, True, True)
    # JAX's kept programs were let go too (the maps stayed past the share): the fit
    # compiled again what it runs, and trained as plain Keras
    same_history(plainly(DIGITS, DENSE + FIT_256), ip.user_ns)


def test_a_later_cell_runs_the_traced_step_until_the_trainable_set_changes(ip):
    assert traced_steps_kept(ip) == (True, True)


def test_a_model_class_with_its_own_fit_keeps_it_in_later_cells(ip):
    assert overrides_kept(ip) == (3, 1)


def test_six_sample_predict_and_thirteen_sample_evaluate_equal_the_cpu_copy(ip):
    train(ip, CNN + "cnn.fit(images[:256], y[:256], batch_size=64, epochs=1)")
    report = train(ip, "p6 = cnn.predict(images[:6])\n"
                       "e13 = cnn.evaluate(images[:13], y[:13], return_dict=True)")
    assert report.predictions == (6,)
    sync = ip.run_line_magic("tpu_sync", "cnn")
    assert sync.max_abs_diff < 1e-5
    ns = ip.user_ns
    cpu = ns["cnn_cpu"]
    np.testing.assert_allclose(ns["p6"], cpu.predict(ns["images"][:6], verbose=0), atol=1e-5)
    expected = cpu.evaluate(ns["images"][:13], ns["y"][:13], return_dict=True, verbose=0)
    assert ns["e13"]["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert ns["e13"]["accuracy"] == pytest.approx(expected["accuracy"])


def test_an_lstm_trains_and_its_cpu_copy_predicts_any_count(ip):
    report = train(ip, LSTM + "lstm.fit(words[:500], y[:500], batch_size=64, epochs=1)")
    assert report.epochs == 1 and report.steps == 8
    # XLA counts the scan's body once: the layers' count (40 steps of the LSTM) is used
    from tpu_magic.core.flops import counted_training_flops

    assert report.utilization.source == "counted from the layers"
    assert report.utilization.flops_per_sample == counted_training_flops(ip.user_ns["lstm"])
    sync = ip.run_line_magic("tpu_sync", "lstm --as lstm_small")
    assert sync.parameters == ip.user_ns["lstm"].count_params()
    assert ip.user_ns["lstm_small"].predict(ip.user_ns["words"][:3], verbose=0).shape == (3, 10)


def test_a_bad_batch_is_a_usage_error_before_training(ip):
    train(ip, CNN)
    before = [w.copy() for w in ip.user_ns["cnn"].get_weights()]
    with pytest.raises(UsageError, match="batch_size 100 is not divisible by 8 replicas: use 96 or 104"):
        train(ip, "cnn.fit(images[:200], y[:200], batch_size=100)")
    after = ip.user_ns["cnn"].get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_a_fixed_input_batch_is_the_global_batch(ip):
    report = train(ip, """
static = keras.Sequential([keras.Input(batch_shape=(64, 64)), keras.layers.Dense(10, activation="softmax")])
static.compile("sgd", "sparse_categorical_crossentropy")
static.fit(x[:200], y[:200], epochs=1)
ps = static.predict(x[:6])
""")
    assert report.global_batch == 64 and report.per_replica == 8
    assert ip.user_ns["ps"].shape == (6, 10)


def test_a_model_built_outside_the_cell_is_placed_on_the_devices_as_it_is(ip, capsys):
    # On JAX a variable's value can move: the same object, its weights and optimizer state
    # as they were, now laid out over the 8 devices (a subclassed model too, which cannot be
    # rebuilt from a config).
    ip.run_cell("""
class Tiny(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(10)

    def call(self, inputs):
        return self.dense(inputs)

outside = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
outside.compile('sgd', keras.losses.SparseCategoricalCrossentropy(from_logits=True))
tiny = Tiny()
tiny.compile('sgd', keras.losses.SparseCategoricalCrossentropy(from_logits=True))
tiny.fit(x[:64], y[:64], batch_size=64, verbose=0)
before = [w.copy() for w in tiny.get_weights()]
""")
    old, tiny = ip.user_ns["outside"], ip.user_ns["tiny"]
    report = train(ip, "outside.fit(x[:128], y[:128], batch_size=64)\n"
                       "tiny.fit(x[:128], y[:128], batch_size=64, epochs=0)")
    assert report.rewrapped == ("outside", "tiny")
    assert ip.user_ns["outside"] is old and ip.user_ns["tiny"] is tiny
    assert "now live on the 8 devices" in capsys.readouterr().out
    for variable in old.weights + tiny.weights + tiny.optimizer.variables:
        assert len(variable.value.sharding.device_set) == 8, variable.path
    assert all(np.array_equal(a, b) for a, b in zip(ip.user_ns["before"], tiny.get_weights()))


def test_resume_from_a_checkpoint(ip, tmp_path):
    fit = "cnn.fit(images[:256], y[:256], batch_size=64, epochs={}, verbose=0)"
    train(ip, CNN + fit.format(2), f"--no-progress --checkpoint {tmp_path}")
    report = train(ip, CNN + fit.format(3), f"--no-progress --checkpoint {tmp_path} --resume")
    assert report.resumed_from.endswith("ckpt-000002-epoch-0002.h5")
    assert report.history.epoch == [2]


def test_the_backend_cannot_change_in_a_running_process(ip):
    with pytest.raises(UsageError, match="keras is already imported with the jax backend.*Restart"):
        ip.run_line_magic("tpu_connect", "--backend tf --no-panel")


def test_another_device_split_needs_a_restart(ip):
    with pytest.raises(UsageError, match="--simulate 4 needs 4 CPU devices, but JAX already started "
                                         "with 8"):
        ip.run_line_magic("tpu_connect", "--backend jax --simulate 4 --no-panel")
    assert tpu_magic.session().replicas == 8


def test_ctrl_c_stops_at_a_batch_boundary_with_the_bar_on(ip, capsys):
    ip.run_cell("""
import os, signal
class PressCtrlC(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            os.kill(os.getpid(), signal.SIGINT)
""")
    with pytest.raises(KeyboardInterrupt):  # the interrupt ends the cell: the next line never runs
        train(ip, CNN + "cnn.fit(images[:1024], y[:1024], batch_size=64, epochs=20, "
                        "callbacks=[PressCtrlC()])\nafter_the_fit = True", "")
    assert "after_the_fit" not in ip.user_ns
    report = tpu_magic.workspace().report
    assert report.interrupted and report.epochs <= 1 and report.steps >= 3
    assert "epoch 1/20" in capsys.readouterr().err
    again = train(ip, "cnn.fit(images[:64], y[:64], batch_size=64)")
    assert again.epochs == 1 and not again.interrupted


def test_fit_at_learning_rate_0_equals_evaluate_with_counts_and_no_targets(ip):
    """Exactness on JAX: fit's history at lr 0 equals evaluate (a partial last batch), count
    metrics stay whole, a model that trains without targets runs, and a plain later cell
    still predicts any count."""
    train(ip, """
keras.utils.set_random_seed(0)
dense = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
dense.compile(keras.optimizers.SGD(0.0), "binary_crossentropy",
              metrics=[keras.metrics.TruePositives(name="tp"), keras.metrics.FalseNegatives(name="fn"),
                       keras.metrics.TrueNegatives(name="tn"), keras.metrics.FalsePositives(name="fp")])
odd = (y[:203] % 2).astype("float32")
h = dense.fit(x[:203], odd, batch_size=32, epochs=1, shuffle=False,
              class_weight={0: 1.0, 1: 1.0})
e = dense.evaluate(x[:203], odd, batch_size=32, return_dict=True)
""")
    history, evaluation = ip.user_ns["h"].history, ip.user_ns["e"]
    for key, value in evaluation.items():
        assert history[key][0] == pytest.approx(value, abs=1e-5), key
    assert sum(evaluation[k] for k in ("tp", "fn", "tn", "fp")) == 203
    ip.run_cell("seven = dense.predict(x[:7], verbose=0)")
    assert ip.user_ns["seven"].shape == (7, 1)


def test_a_model_whose_loss_cannot_be_masked_loses_no_sample_on_jax(ip):
    # Its loss comes from add_loss, which no padding mask reaches: the last, short batch
    # (203 = 6 x 32 + 11) runs as it is, whole on every device, so every sample counts and
    # the numbers are plain Keras's on one device (TensorFlow's replicas leave it out).
    from support.same import plainly, same_history, same_weights

    setup = "data = x[:203]\n"
    cell = """
class Penalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(keras.ops.mean(keras.ops.square(inputs)))
        return inputs

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8), Penalty()])
model.compile(keras.optimizers.SGD(0.01))
history = model.fit(data, epochs=2, batch_size=32, shuffle=False, verbose=0)
"""
    plain = plainly("x = " + repr(ip.user_ns["x"][:203].tolist()) + "\nx = np.array(x, 'float32')\n"
                    + setup, cell)
    ip.run_cell(setup)
    report = train(ip, cell)
    assert report.left_out == {}
    assert not any("no targets" in note for note in report.notes)
    same_history(plain, ip.user_ns)
    same_weights(plain, ip.user_ns)


def test_a_single_chip_tpu_is_one_replica_with_tpu_advice(ip, monkeypatch):
    """Colab's v5e-1: `local` on a TPU VM without TensorFlow, one TPU device (here a CPU one)."""
    import jax

    from tpu_magic.connecting import connect as connecting
    from tpu_magic.core.process import set_connection as set_session
    from tpu_magic.core.target import MachineSigns

    one_chip = jax.devices("cpu")[:1]
    real_devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda kind=None: one_chip if kind == "tpu"
                        else real_devices(kind))
    rehearsal = tpu_magic.session()
    env = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "COLAB_RELEASE_TAG": "release-colab_2026"}
    try:
        result = connecting.connect("local", env=env,
                                    signs=MachineSigns(accel_devices=("/dev/accel0",)))
        assert (result.kind, result.replicas, result.backend) == ("tpu", 1, "jax")
        assert "1 replica (" in result.summary()
        report = train(ip, CNN + "cnn.fit(images[:300], y[:300], batch_size=100, epochs=1, "
                                 "validation_data=(images[300:313], y[300:313]))")
        assert (report.replicas, report.global_batch, report.per_replica) == (1, 100, 100)
        assert any("100 samples per replica (batch_size 100 / 1) is not a multiple of 8" in n
                   and "batch_size 128 (128 per replica) for a good start" in n for n in report.notes)
        assert np.isfinite(report.metrics["val_loss"])
    finally:
        set_session(rehearsal)


def test_the_panel_trains_syncs_and_saves_by_click_without_tensorflow(ip, tmp_path):
    connected = ip.run_line_magic("tpu_connect", "--simulate 8")  # with its panel this time
    panel = tpu_magic.workspace().panel
    assert connected.reused and "8 replicas" in panel.device.value
    train(ip, "keras.utils.set_random_seed(1)\n"
              "dense = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, "
              "activation='softmax')])\n"
              "dense.compile('adam', 'sparse_categorical_crossentropy')\n"
              "dense.fit(x[:256], y[:256], batch_size=64, epochs=1, "
              "validation_data=(x[1500:1513], y[1500:1513]))")
    panel.batch_size.value, panel.epochs.value = 128, 2
    panel.train_button.click()
    report = tpu_magic.workspace().job.result(timeout=240)
    assert (report.epochs, report.global_batch, report.interrupted) == (2, 128, False)
    panel.sync_button.click()
    assert panel.state == "ok" and "`dense` → `dense_cpu`" in panel.status.value
    np.testing.assert_allclose(ip.user_ns["dense_cpu"].predict(ip.user_ns["x"][:5], verbose=0),
                               ip.user_ns["dense"].predict(ip.user_ns["x"][:5], verbose=0),
                               atol=1e-6)
    panel.save_path.value = str(tmp_path / "dense")
    panel.save_button.click()
    assert panel.state == "ok" and (tmp_path / "dense.weights.h5").exists()
    assert "tensorflow" not in sys.modules


def test_mixed_bfloat16_on_jax_and_a_float32_cpu_copy(ip):
    report = train(ip, CNN + "cnn.fit(images[:256], y[:256], batch_size=64, epochs=1)",
                   "--no-progress --precision mixed_bf16")
    cnn = ip.user_ns["cnn"]
    conv, out = cnn.layers[1], cnn.layers[-1]
    assert report.precision.startswith("mixed_bfloat16")
    assert (conv.kernel.dtype, conv.compute_dtype) == ("float32", "bfloat16")
    assert out.compute_dtype == "float32" and np.isfinite(report.metrics["loss"])
    ip.run_line_magic("tpu_sync", "cnn")
    copy = ip.user_ns["cnn_cpu"]
    assert {w.dtype for w in copy.weights} == {"float32"} and copy.layers[1].compute_dtype == "float32"
    assert "tensorflow" not in sys.modules


def test_xla_counts_the_flops_the_layers_add_up_to_and_the_report_uses_them(ip):
    from tpu_magic.core.flops import counted_training_flops

    report = train(ip, """
keras.utils.set_random_seed(4)
conv = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                         keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
conv.compile("adam", "sparse_categorical_crossentropy")
conv.fit(x.reshape(-1, 8, 8, 1), y, batch_size=128, epochs=2, verbose=0)
""")
    used = report.utilization
    counted = counted_training_flops(ip.user_ns["conv"])
    # the train step's own count, from the executable the memory plan compiled and the fit
    # ran: XLA adds what the layers' count leaves out (biases, the softmax, the loss, Adam's
    # update of each weight), 15 % more on a model this small
    assert used.source == "XLA cost analysis of the train step"
    assert counted <= used.flops_per_sample <= 1.25 * counted
    assert used.achieved_tflops == pytest.approx(used.flops_per_sample
                                                 * report.samples_per_second / 1e12)
    assert 0 <= used.input_share <= 1 and "drawn on their own after fit" in used.input_how


def test_the_flops_come_from_the_planned_step_and_nothing_is_lowered_to_count_them(
        ip, monkeypatch):
    # pay once (issue 57): the count is the cost analysis of the train step the memory plan
    # compiled and the fit runs, in every cell; the gradient lowered on its own to count
    # (`training_flops`, a language model's takes long) is not asked
    backend = type(tpu_magic.session().backend)
    own, asked = backend.training_flops, []
    monkeypatch.setattr(backend, "training_flops",
                        lambda self, model, batch=None: asked.append(model.name) or
                        own(self, model, batch))
    fit = "{0}.fit(x[:512], y[:512], batch_size=128, epochs=1, verbose=0)"
    build = """
keras.utils.set_random_seed(4)
{0} = keras.Sequential([keras.Input((64,)), keras.layers.Dense(24, activation="relu"),
                        keras.layers.Dense(10, activation="softmax")], name="{0}")
{0}.compile("sgd", "sparse_categorical_crossentropy")
"""
    first = train(ip, build.format("counted") + fit.format("counted")).utilization
    again = train(ip, fit.format("counted")).utilization
    assert again.flops_per_sample == first.flops_per_sample
    assert again.source == first.source == "XLA cost analysis of the train step"
    rebuilt = train(ip, build.format("rebuilt") + fit.format("rebuilt")).utilization
    assert rebuilt.flops_per_sample == pytest.approx(first.flops_per_sample)
    assert asked == []


def test_a_later_fit_of_the_same_pipeline_reuses_the_input_measurement_on_jax(ip):
    fit = "dense.fit(x[:1024], y[:1024], batch_size={}, epochs=1, verbose=0)"
    first = train(ip, """
keras.utils.set_random_seed(4)
dense = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
dense.compile("sgd", "sparse_categorical_crossentropy")
""" + fit.format(128)).utilization
    assert "drawn on their own after fit" in first.input_how and first.input_batch_seconds
    again = train(ip, fit.format(128)).utilization
    assert "drawn after an earlier fit of the same pipeline" in again.input_how
    assert again.input_batch_seconds == first.input_batch_seconds
    other = train(ip, fit.format(64)).utilization
    assert "drawn on their own after fit" in other.input_how and other.input_key != first.input_key


def test_the_magics_batch_hooks_leave_the_steps_to_run_ahead_as_a_quiet_fit_does(ip):
    # Keras on JAX queues the next step while a step's logs are read on a worker thread,
    # if every callback is async-safe (a plain `fit`, verbose=0). The magic's bar and Stop
    # are; the parity check is not, so the fit it watches (a cell's first; here one step an
    # epoch, where Keras syncs the state and validates right after the step) runs its hooks
    # on the main thread and agrees, and the cell's next fit runs them off it.
    ip.run_cell("""
import threading
class Where(keras.callbacks.Callback):
    async_safe = True
    def __init__(self):
        super().__init__()
        self.main = []
    def on_train_batch_end(self, batch, logs=None):
        self.main.append(threading.current_thread() is threading.main_thread())
keras.utils.set_random_seed(5)
quiet = keras.Sequential([keras.Input((64,)), keras.layers.BatchNormalization(),
                          keras.layers.Dense(48, activation="relu"), keras.layers.Dropout(0.2),
                          keras.layers.Dense(10, activation="softmax")])
quiet.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
checked, later = Where(), Where()
""")
    report = train(ip, """
first = quiet.fit(x[:512], y[:512], batch_size=512, epochs=2,
                  validation_data=(x[512:600], y[512:600]), callbacks=[checked])
quiet.fit(x[:1024], y[:1024], batch_size=64, epochs=2,
          validation_data=(x[1024:1100], y[1024:1100]), callbacks=[later])
""", "")
    assert ip.user_ns["checked"].main == [True, True]
    assert report.parity is not None and report.parity.agrees, report.parity
    assert all(np.isfinite(ip.user_ns["first"].history[k]).all() for k in ("loss", "val_loss"))
    hooks = ip.user_ns["later"].main
    assert len(hooks) == 32 and not any(hooks) and report.steps == 32 and report.fits == 2
    assert np.isfinite(report.metrics["val_loss"])
    # The first fit again in a new cell: its setup agreed above, which the check tells
    # before the fit from its batches' shapes, so it leaves that fit's hooks to Keras's
    # worker threads too.
    ip.run_cell("again = Where()")
    report = train(ip, """
quiet.fit(x[:512], y[:512], batch_size=512, epochs=2,
          validation_data=(x[512:600], y[512:600]), callbacks=[again])
""", "")
    assert "agreed with one device earlier in this notebook" in report.parity.line()
    assert ip.user_ns["again"].main == [False, False]


def test_a_slow_input_is_called_input_bound_on_jax(ip):
    report = train(ip, """
import time
class Slow(keras.utils.PyDataset):
    def __len__(self):
        return 6
    def __getitem__(self, i):
        time.sleep(0.25)  # a step's compute (a few ms, more under load) stays a small share
        return x[i * 64:(i + 1) * 64], y[i * 64:(i + 1) * 64]
dense = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
dense.compile("sgd", "sparse_categorical_crossentropy")
dense.fit(Slow(), epochs=2, verbose=0)
""")
    assert report.utilization.input_bound and report.utilization.input_share >= 0.9
    assert "the data, not the device, sets the pace" in report.summary()
    assert "\n  input-bound: reading a batch takes" in report.summary()
