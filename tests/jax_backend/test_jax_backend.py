"""The magics on Keras's JAX backend: `DataParallel` over 8 simulated devices."""

import re
import sys

import numpy as np
import pytest
from IPython.core.error import UsageError

import tpu_magic
from support.cells import CNN, SHARDED, overrides_kept, train, traced_steps_kept

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
    assert used.source == "XLA cost analysis"
    assert used.flops_per_sample == pytest.approx(counted, rel=0.1)  # XLA adds biases, softmax
    assert used.achieved_tflops == pytest.approx(used.flops_per_sample
                                                 * report.samples_per_second / 1e12)
    assert 0 <= used.input_share <= 1 and "drawn on their own after fit" in used.input_how


def test_a_later_cell_reuses_the_flops_counted_for_the_same_model(ip, monkeypatch):
    # XLA's count lowers the model's gradient: once per model and shape, not once a cell
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
    assert asked == ["counted"] and again.flops_per_sample == first.flops_per_sample
    assert again.source == first.source == "XLA cost analysis"
    train(ip, build.format("rebuilt") + fit.format("rebuilt"))  # another model: counted
    assert asked == ["counted", "rebuilt"]


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


# -- --shard model: a model laid out over a mesh of the 8 devices ------------------------------


@pytest.mark.parametrize("mesh", ["1x8", "2x4"])
def test_a_model_sharded_over_a_mesh_trains_as_on_one_device(ip, mesh):
    plain = {}
    exec("import numpy as np, keras\n" + SHARDED, plain)  # one device, no distribution
    report = train(ip, SHARDED, f"--no-progress --shard model --mesh {mesh}")
    ours = ip.user_ns
    assert ours["history"].history["loss"] == pytest.approx(plain["history"].history["loss"],
                                                            rel=1e-4)
    rows, columns = map(int, mesh.split("x"))
    assert report.replicas == rows and report.global_batch == 32
    assert report.sharding[0].startswith(f"sharding: mesh {mesh} (data × model)")
    model = ours["sharded"]
    from tpu_magic.core.layouts import derived_spec

    total = replicated = per_device = 0
    for variable in model.weights:
        value = variable.value
        spec = tuple(value.sharding.spec) + (None,) * (len(variable.shape) - len(value.sharding.spec))
        assert spec == derived_spec(tuple(variable.shape), 4, columns), variable.path
        total += value.nbytes
        replicated += value.nbytes if all(s is None for s in spec) else 0
        per_device += value.addressable_shards[0].data.nbytes
    assert per_device <= (total - replicated) / columns + replicated + 1
    assert per_device < total / 2  # the big kernels really are split
    ip.run_line_magic("tpu_sync", "sharded --as sharded_cpu")  # gathered into one CPU copy
    x = ours["tokens"][:5]
    np.testing.assert_allclose(ours["sharded_cpu"].predict(x, verbose=0),
                               np.asarray(model.predict(x, verbose=0)), atol=1e-4)


def test_a_memory_plan_before_the_first_step_and_a_refusal_that_names_the_fixes(ip, monkeypatch):
    report = train(ip, SHARDED, "--no-progress --shard model --mesh 2x4 --plan-for v5e-8")
    plan = report.memory_plan
    assert plan.startswith("memory plan: ") and " of 16 GiB per TPU v5e device (weights " in plan
    assert "optimizer" in plan and "planned by XLA on this machine's CPU devices" in plan
    model = ip.user_ns["sharded"]
    import re

    weights_gib = sum(w.value.addressable_shards[0].data.nbytes for w in model.weights) / 2**30
    planned = float(re.search(r"\(weights ([\d.e-]+)", plan).group(1))
    assert planned == pytest.approx(weights_gib, rel=0.05)  # the weights one device holds

    monkeypatch.setenv("TPU_MAGIC_DEVICE_MEMORY_BYTES", str(4 * 2**20))  # a 4 MiB device
    ip.user_ns.pop("history", None)
    with pytest.raises(UsageError, match=r"memory plan: a training step needs .* GiB per "
                                         r"device, more than 90 % of its .* the biggest part "
                                         r"is .* Nothing has run and the weights are untouched"):
        train(ip, SHARDED, "--no-progress --shard model --mesh 2x4")
    refused = ip.user_ns["sharded"]
    assert int(refused.optimizer.iterations.numpy()) == 0 and "history" not in ip.user_ns
    with pytest.raises(UsageError, match="--plan-for v5e-4 plans for 4 devices, and this "
                                         "connection has 8"):
        train(ip, SHARDED, "--no-progress --shard model --plan-for v5e-4")


def test_token_ids_get_tokens_per_second_of_real_tokens(ip):
    report = train(ip, SHARDED.replace("epochs=2", "epochs=1") + "\n", "--no-progress")
    tokens = ip.user_ns["tokens"]
    per_row = np.count_nonzero(tokens) / len(tokens)
    assert report.tokens_per_second == pytest.approx(report.samples_per_second * per_row)
    assert "tokens/s (real tokens, padding left out)" in report.summary()


def test_a_failed_tpu_connect_advises_a_rehearsal_line_that_works_next(ip):
    with pytest.raises(UsageError, match="JAX finds no TPU here") as failed:
        ip.run_line_magic("tpu_connect", "local --backend jax --no-panel")
    advised = re.search(r"To rehearse without a TPU: `%(tpu_connect [^`]+)`", str(failed.value))
    assert advised, str(failed.value)
    name, line = advised.group(1).split(" ", 1)
    assert "--backend jax" in line  # the advice keeps the backend the user asked for
    ip.run_line_magic(name, line + " --no-panel")
    assert tpu_magic.session().replicas == 8


def test_no_tpu_on_colab_is_said_once_not_again_by_the_doctor(ip, monkeypatch):
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab")
    with pytest.raises(UsageError, match="No TPU is attached to this Colab runtime") as failed:
        ip.run_line_magic("tpu_connect", "local --backend jax --no-panel")
    assert str(failed.value).lower().count("no tpu is attached") == 1, str(failed.value)
    ip.run_line_magic("tpu_connect", "--backend jax --simulate 8 --no-panel")


def test_kerashub_dict_inputs_get_tokens_per_second_from_their_padding_mask(ip, caplog):
    # KerasHub's task makes a dataset of the arrays itself: the tokens are read off the first
    # batch Keras takes, and counted by the padding mask (ids here are non-zero everywhere).
    # What the libraries say about that dataset (Keras: "shuffle=True ... ignored", grain:
    # "prefetch_buffer_size=8 is smaller than num_threads=16") is not the user's doing: not
    # in the cell (issue 34)
    import logging
    import warnings

    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        report = train(ip, """
import keras_hub
rs = np.random.RandomState(0)
ids = rs.randint(1, 2048, (64, 17))
mask = np.ones((64, 16), bool)
mask[:, 12:] = False
x = {"token_ids": ids[:, :-1], "padding_mask": mask}
backbone = keras_hub.models.GemmaBackbone(vocabulary_size=2048, num_layers=1,
    num_query_heads=4, num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=8)
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
lm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
lm.fit(x, ids[:, 1:], batch_size=8, epochs=1, verbose=0)
import grain
rows = grain.MapDataset.source(list(range(64))).map(
    lambda i: ({"token_ids": ids[i, :-1], "padding_mask": mask[i]}, ids[i, 1:])).batch(8)
lm.fit(rows, epochs=1, verbose=0)  # a dataset of the user's own: tokens from its first batch
""", "--no-progress --verify off")
    assert not [w for w in warned if "shuffle=True" in str(w.message)]
    assert "prefetch_buffer_size" not in caplog.text
    assert report.samples_per_second
    assert report.tokens_per_second == pytest.approx(report.samples_per_second * 12)
    # its FLOPs counted by XLA from the batch it is fed (the model leaves the sequence
    # length open): TFLOP/s in the report, against the measured peak where --check ran
    used = report.utilization
    assert used.flops_per_sample and used.source == "XLA cost analysis"
    assert used.achieved_tflops == pytest.approx(
        used.flops_per_sample * report.samples_per_second / 1e12)
    assert "TFLOP/s" in report.summary() and "MFLOP a sample (XLA cost analysis)" in \
        report.summary()


def test_syncing_a_model_the_host_cannot_hold_is_refused_before_gathering(ip, monkeypatch):
    train(ip, SHARDED.replace("epochs=2", "epochs=1"), "--no-progress --shard model")
    ip.user_ns.pop("too_big_cpu", None)
    monkeypatch.setenv("TPU_MAGIC_HOST_MEMORY_BYTES", str(8 * 2**20))  # an 8 MiB host
    with pytest.raises(UsageError, match="needs about .* GiB of host memory .* nothing was "
                                         "copied"):
        ip.run_line_magic("tpu_sync", "sharded --as too_big_cpu")
    assert "too_big_cpu" not in ip.user_ns


# -- KerasHub language models: built from small configs (random weights, no downloads) -------

HUB_LM = """
import keras_hub
keras.utils.set_random_seed(3)
backbone = keras_hub.models.{backbone}(vocabulary_size=512, num_layers=2, num_query_heads={heads},
    num_key_value_heads={heads}, hidden_dim=64, intermediate_dim=128{extra})
lm = keras_hub.models.{task}(backbone=backbone, preprocessor=None)
backbone.enable_lora(rank=4)
lm.compile(optimizer=keras.optimizers.Adam(1e-3),
           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
           weighted_metrics=["accuracy"])
rs = np.random.RandomState(0)
ids = rs.randint(1, 512, (37, 17))
mask = np.ones((37, 16), bool)
mask[::3, 12:] = False  # every third sequence ends early: padding tokens
x = {{"token_ids": ids[:, :-1] * mask, "padding_mask": mask}}
y = ids[:, 1:] * mask
history = lm.fit(x, y, sample_weight=mask.astype("float32"), batch_size=8, epochs=2,
                 shuffle=False, verbose=0)
"""
GEMMA = dict(backbone="GemmaBackbone", task="GemmaCausalLM", extra=", head_dim=16")
MISTRAL = dict(backbone="MistralBackbone", task="MistralCausalLM", extra="")


def _hub_lm(**kind):
    return HUB_LM.format(**kind)


def _same_losses_as_one_device(ip, cell, line):
    plain = {}
    exec("import numpy as np, keras\n" + cell, plain)  # one device, no distribution
    report = train(ip, cell, line)
    for key, values in plain["history"].history.items():
        assert ip.user_ns["history"].history[key] == pytest.approx(values, rel=1e-4), key
    return report


def _bytes_per_device(model, columns):
    total = replicated = per_device = 0
    for variable in model.weights:
        value = variable.value
        total += value.nbytes
        if all(s is None for s in value.sharding.spec):
            replicated += value.nbytes
        per_device += value.addressable_shards[0].data.nbytes
    assert per_device <= (total - replicated) / columns + replicated + 1
    return per_device, total


@pytest.mark.parametrize("mesh", ["1x8", "2x4"])
def test_a_kerashub_causal_lm_with_lora_takes_its_own_layout_map(ip, mesh):
    """Gemma's `get_layout_map` lays out its kernels (over both mesh axes); LoRA factors and
    norms stay replicated; a last batch of 5 sequences of 37 is padded and masked; the
    losses and masked accuracy equal one device's."""
    report = _same_losses_as_one_device(ip, _hub_lm(heads=8, **GEMMA),
                                        f"--no-progress --shard model --mesh {mesh}")
    import keras
    import keras_hub

    rows, columns = map(int, mesh.split("x"))
    lm = ip.user_ns["lm"]
    device_mesh = keras.distribution.DeviceMesh((rows, columns), ["batch", "model"])
    own = keras_hub.models.GemmaBackbone.get_layout_map(device_mesh)
    mapped = 0
    for variable in lm.weights:
        layout = own[variable.path]
        spec = tuple(variable.value.sharding.spec)
        spec += (None,) * (len(variable.shape) - len(spec))
        if layout is not None:
            mapped += 1
            assert spec == tuple(layout.axes), variable.path
        elif "lora" in variable.path:
            assert all(s is None for s in spec), variable.path
    assert mapped >= 10
    assert any(v.trainable for v in lm.weights if "lora" in v.path)
    _bytes_per_device(lm, columns)
    assert "from GemmaBackbone.get_layout_map" in report.sharding[1]
    assert report.global_batch == 8 and report.memory_plan.startswith("memory plan: ")


def test_a_layout_the_mesh_does_not_divide_is_derived_with_a_note(ip):
    """4 query heads on a model axis of 8: Gemma's map would fail in device_put."""
    report = _same_losses_as_one_device(ip, _hub_lm(heads=4, **GEMMA),
                                        "--no-progress --shard model --mesh 1x8")
    query = next(v for v in ip.user_ns["lm"].weights
                 if v.path == "decoder_block_0/attention/query/kernel")
    assert tuple(query.value.sharding.spec)[:1] != ("model",)
    assert any("decoder_block_0/attention/query/kernel (4, 64, 16): layout derived: "
               "GemmaBackbone.get_layout_map's ('model', 'batch', None) does not divide" in note
               for note in report.notes)


def test_a_kerashub_backbone_without_a_layout_map_is_derived_from_shapes(ip, monkeypatch):
    monkeypatch.setattr("tpu_magic.core.layouts.SHARD_FROM_BYTES", 16 * 1024)
    report = _same_losses_as_one_device(ip, _hub_lm(heads=8, **MISTRAL),
                                        "--no-progress --shard model --mesh 2x4")
    per_device, total = _bytes_per_device(ip.user_ns["lm"], 4)
    assert per_device < total / 2
    assert "from its shape" in report.sharding[1] and "get_layout_map" not in report.sharding[1]


def test_shard_auto_keeps_data_parallel_where_it_fits_and_splits_the_model_where_not(
        ip, monkeypatch):
    report = train(ip, SHARDED.replace("epochs=2", "epochs=1"), "--no-progress --shard auto")
    assert report.strategy == "DataParallel" and report.sharding == ()
    assert report.memory_plan.endswith("; --shard auto: data parallel")
    data_peak = float(re.search(r"memory plan: ([\d.e-]+)", report.memory_plan).group(1))

    # A device with a little more than half the data-parallel step's memory: 1x2 does not
    # fit (the activations stay per row), the fewest model columns that do are chosen.
    monkeypatch.setenv("TPU_MAGIC_DEVICE_MEMORY_BYTES", str(int(0.6 * data_peak * 2**30)))
    plain = {}
    exec("import numpy as np, keras\n" + SHARDED, plain)
    from tpu_magic.backends.jax import data

    built, build = [], data.train_pipeline  # the data rows each training input is built for
    monkeypatch.setattr(data, "train_pipeline", lambda *args, **options: built.append(
        data.row_split(options["strategy"]).rows) or build(*args, **options))
    report = train(ip, SHARDED, "--no-progress --shard auto")
    assert ip.user_ns["history"].history["loss"] == pytest.approx(
        plain["history"].history["loss"], rel=1e-4)
    assert report.strategy == "DerivedModelParallel"
    chosen = re.search(r"mesh (\d)x(\d)$", report.memory_plan)
    rows, columns = int(chosen.group(1)), int(chosen.group(2))
    assert rows * columns == 8 and columns > 1 and report.replicas == rows
    # the placement was settled before any input existed: built once, for the mesh's rows
    assert built == [rows] and report.per_replica == report.global_batch // rows
    planned = float(re.search(r"memory plan: ([\d.e-]+)", report.memory_plan).group(1))
    assert planned <= 0.9 * 0.6 * data_peak
    assert report.sharding[0].startswith(f"sharding: mesh {rows}x{columns}")
    per_device, total = _bytes_per_device(ip.user_ns["sharded"], columns)
    assert per_device < 0.75 * total  # resharded: the big kernels are split now

    monkeypatch.setenv("TPU_MAGIC_DEVICE_MEMORY_BYTES", str(2**20))  # 1 MiB: nothing fits
    ip.user_ns.pop("history", None)
    with pytest.raises(UsageError, match=r"even on a 1x8 mesh.*Nothing has run"):
        train(ip, SHARDED, "--no-progress --shard auto")
    assert int(ip.user_ns["sharded"].optimizer.iterations.numpy()) == 0
    assert built == [rows]  # refused before any input was built


def test_lora_adapters_alone_are_saved_small_and_load_back(ip, tmp_path):
    train(ip, _hub_lm(heads=8, **GEMMA), "--no-progress --shard model --mesh 2x4")
    result = ip.run_line_magic("tpu_sync", f"lm --as lm_cpu --save {tmp_path}/gemma --adapters")
    path = tmp_path / "gemma.adapters.h5"
    saved, whole = result.adapters
    assert path.exists() and saved < 0.1 * whole
    assert "saved the adapters alone" in result.summary()
    # issue 32: the copy of a KerasHub task is checked too (a probe of token ids and a mask
    # in the dict it takes; before, "no input shape known")
    assert result.max_abs_diff is not None and result.max_abs_diff < 1e-4
    assert "probe batch of 8" in result.summary()
    assert path.stat().st_size < 0.2 * whole
    import tpu_magic as tm

    ip.run_cell(_hub_lm(heads=8, **GEMMA).split("lm.compile")[0].replace("lm =", "fresh ="))
    fresh = ip.user_ns["fresh"]
    assert tm.load_adapters(fresh, path) == len(fresh.trainable_weights)
    tokens = {"token_ids": ip.user_ns["x"]["token_ids"][:3], "padding_mask": ip.user_ns["x"]["padding_mask"][:3]}
    np.testing.assert_allclose(np.asarray(fresh(tokens)), np.asarray(ip.user_ns["lm_cpu"](tokens)),
                               atol=1e-4)
    with pytest.raises(UsageError, match="has no adapters to save alone"):
        ip.run_cell("dense_only = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])")
        ip.run_line_magic("tpu_sync", f"dense_only --save {tmp_path}/d --adapters")



def test_a_lora_language_models_checkpoints_hold_what_trains_and_resume(ip, tmp_path):
    # issue 32: with a real vocabulary the frozen embedding is most of the model, and
    # enable_lora freezes it with the norms and every kernel: only LoRA's bases were left
    # out (8.68 MB written for 8.78 MB of weights)
    from tpu_magic.backends.jax.checkpoint import ShardWriter
    from tpu_magic.training.checkpoints.orbax_shards import describe_shards

    cell = (_hub_lm(heads=8, **GEMMA).replace("vocabulary_size=512", "vocabulary_size=32768")
            .replace("rs.randint(1, 512", "rs.randint(1, 32768"))
    line = f"--no-progress --shard model --mesh 2x4 --checkpoint {tmp_path} --keep 1"
    report = train(ip, cell.replace("epochs=2", "epochs=1"), line)
    # a model split over the devices: orbax-checkpoint, each shard written where it lives
    written = sorted(tmp_path.glob("ckpt-*"))
    assert [p.suffix for p in written] == [".orbax"]
    saved = describe_shards(written[0], ShardWriter())
    lm = ip.user_ns["lm"]
    whole = sum(int(np.prod(w.shape)) * 4 for w in lm.weights)
    assert not [n for n in saved.weights.names if "embeddings" in n]
    size = sum(f.stat().st_size for f in written[0].rglob("*") if f.is_file())
    # what trains (LoRA's adapters and their Adam slots) is 0.03x the weights; orbax's OCDBT
    # files around it vary from run to run (0.036x to 0.062x measured over nine runs)
    assert size < 0.1 * whole, (size, whole)
    assert any("the checkpoints hold what trains" in n for n in report.notes)
    assert any("shard by shard (orbax-checkpoint)" in n for n in report.notes)
    # a later checkpoint whose shards are damaged is moved aside, and said
    import shutil

    damaged = tmp_path / "ckpt-000002-epoch-0001.orbax"
    shutil.copytree(written[0], damaged)
    # every data file: each process's own (ocdbt.process_0/d), and the merged copy at the top
    # (d/) that orbax-checkpoint 0.12.8 writes and reads from
    data = [f for f in damaged.rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data
    for shard in data:
        shard.write_bytes(shard.read_bytes()[:100])
    # resumed into another mesh (1x8): orbax lays each array out as the model is now
    resumed = train(ip, cell, line.replace("2x4", "1x8") + " --resume")
    assert resumed.history.epoch == [1] and resumed.resumed_from == str(written[0])
    assert (tmp_path / (damaged.name + ".damaged")).is_dir() and not damaged.exists()
    assert any("moved aside to ckpt-000002-epoch-0001.orbax.damaged" in n
               for n in resumed.notes)


def test_a_process_killed_while_orbax_commits_a_checkpoint_resumes_from_the_one_before(tmp_path):
    """In processes of their own (tests/support/orbax_kill_run.py): a real SIGKILL inside orbax's
    commit of epoch 2 (every shard written, the rename not done), then `--resume`."""
    import os
    import subprocess
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(tests / "without_tensorflow"))
    for name in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(name, None)

    def run(*flags):
        done = subprocess.run([sys.executable, str(tests / "support" / "orbax_kill_run.py"), str(tmp_path),
                               *flags], env=env, capture_output=True, text=True, timeout=300)
        said = [line.split() for line in done.stdout.splitlines()]
        return done, {int(w[1]): float(w[2]) for w in said if w[:1] == ["loss"]}, said

    killed, losses, _ = run("--kill-at-epoch", "2")
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "ckpt-000001-epoch-0001.orbax" and "orbax-checkpoint-tmp" in names[1]
    resumed, again, said = run("--resume")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert ["resumed_from", str(tmp_path / "ckpt-000001-epoch-0001.orbax")] in said
    assert sorted(again) == [2, 3] and again[2] == pytest.approx(losses[2], rel=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # --keep 2, the leftover gone
        "ckpt-000002-epoch-0002.orbax", "ckpt-000003-epoch-0003.orbax"]


@pytest.mark.parametrize("flags", ["--plan-for v5e-8", "--shard model --mesh 2x4"])
def test_the_plans_peak_is_within_30_percent_of_the_measured_one(flags):
    """In a process of its own (tests/support/peak_run.py): the 8 simulated devices share its memory,
    so a compiled step's growth of its resident high-water mark, over 8, plus the state a
    device holds, is one device's measured peak."""
    import json
    import os
    import subprocess
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(tests / "without_tensorflow"))
    for name in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS", "TPU_MAGIC_DEVICE_MEMORY_BYTES"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, str(tests / "support" / "peak_run.py"), *flags.split()], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["measured"] == pytest.approx(result["planned"], rel=0.3), result
