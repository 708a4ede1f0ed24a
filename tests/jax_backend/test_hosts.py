"""Several hosts, rehearsed on this machine (issue 25): `%tpu_connect --simulate 2x4` starts
two ipyparallel engines, each a JAX process of 4 CPU devices, joined into one run with gloo
collectives; the notebook (this suite's shell, itself one process of 8 simulated devices)
sends each `%%tpu_train` cell to both. Every result is compared with the same cell on the
one process of 8 devices."""

import os
import re
import shutil
import threading
import time

import numpy as np
import pytest
from IPython.core.error import UsageError

import tpu_magic
from support.cells import CNN, SHARDED, train

FIT = ("history = cnn.fit(images[:203], y[:203], batch_size=32, epochs=2, shuffle=False)\n"
       "evaluation = cnn.evaluate(images[203:316], y[203:316], return_dict=True)\n"
       "six = cnn.predict(images[:6])\n")


GRAIN_FIT = (
    "import grain\n"
    "def rows(start, stop):\n"
    "    return grain.MapDataset.source(list(range(start, stop))).map(\n"
    "        lambda i: (images[i], y[i])).batch(32)\n"
    "history = cnn.fit(rows(0, 203), epochs=2, validation_data=rows(203, 316))\n"
    "evaluation = cnn.evaluate(rows(203, 316), return_dict=True)\n")
UNSEEDED = CNN.replace("keras.utils.set_random_seed(0)\n", "")
UNSEEDED_DRAW = 1234
# a shuffled fit (Keras's default), then what a later section of the notebook draws
SHUFFLED = ("history = cnn.fit(images[:203], y[:203], batch_size=32, epochs=2)\n"
            "later = np.random.randint(2**31)\nprint('later draw', later)\n")
SHARDED_FIVE = SHARDED + "five = sharded.predict(tokens[:5], verbose=0)\n"
LIMIT = "TPU_MAGIC_DEVICE_MEMORY_BYTES"


def _sharded(ip, expected):
    """The sharded model's runs on this one process, for the hosts to equal: each mesh, and
    `--shard auto` on a device too small for data parallelism."""
    for mesh in ("1x8", "2x4"):
        train(ip, SHARDED_FIVE, f"--no-progress --shard model --mesh {mesh}")
        expected[mesh] = (ip.user_ns["history"].history["loss"], ip.user_ns["five"])
    report = train(ip, SHARDED.replace("epochs=2", "epochs=1"), "--no-progress --shard auto")
    data_peak = float(report.memory_plan.split()[2])  # "memory plan: X of ..." (GiB)
    limit = str(int(0.6 * data_peak * 2**30))
    os.environ[LIMIT] = limit
    try:
        report = train(ip, SHARDED, "--no-progress --shard auto")
    finally:
        del os.environ[LIMIT]
    assert report.strategy == "DerivedModelParallel"
    expected["auto"] = (limit, ip.user_ns["history"].history["loss"], report.memory_plan)


@pytest.fixture(scope="module")
def hosts(ip):
    one = train(ip, CNN + FIT)  # first on this one process of 8 devices
    expected = {"history": ip.user_ns["history"].history, "evaluation": ip.user_ns["evaluation"],
                "six": ip.user_ns["six"], "report": one}
    # an unseeded cell, from the seed the hosts will be given (UNSEEDED_DRAW): what every
    # engine does before its cell
    ip.run_cell(f"keras.utils.set_random_seed({UNSEEDED_DRAW})")
    train(ip, UNSEEDED + FIT)
    expected["unseeded"] = ip.user_ns["history"].history
    train(ip, CNN + SHUFFLED)
    expected["shuffled"] = (ip.user_ns["history"].history, ip.user_ns["later"])
    train(ip, CNN + GRAIN_FIT)  # a dataset: 203 = 6×32 + 11, a short last batch
    expected["grain"] = (ip.user_ns["history"].history, ip.user_ns["evaluation"])
    _sharded(ip, expected)
    started = time.monotonic()
    connected = ip.run_line_magic("tpu_connect", "--simulate 2x4 --no-panel")
    expected["connect_seconds"] = time.monotonic() - started
    yield connected, expected
    ip.run_line_magic("tpu_connect", "--simulate 8 --no-panel")  # back to one process
    assert tpu_magic.session().replicas == 8


def test_the_seed_cnn_on_two_hosts_equals_one_process_of_eight_devices(ip, hosts):
    connected, expected = hosts
    summary = connected.summary()
    assert "2 hosts × 4 devices = 8 devices" in summary and "host 1 (" in summary
    # what the notebook is connected to, as after any connect
    assert tpu_magic.session() is connected
    assert (connected.replicas, connected.target) == (8, "hosts:2x4")
    for name in ("history", "evaluation", "six"):
        ip.user_ns.pop(name, None)
    report = train(ip, CNN + FIT + "print('rows predicted', len(six))")
    assert "history" not in ip.user_ns  # the cell ran on the hosts, not here
    assert report.replicas == 8 and report.global_batch == 32 and report.predictions == (6,)
    for key, values in expected["history"].items():  # a partial last batch: 203 = 6×32 + 11
        assert report.history.history[key] == pytest.approx(values, rel=1e-5), key
    for key, value in expected["evaluation"].items():
        assert report.evaluations[0][key] == pytest.approx(value, rel=1e-5), key
    outputs = tpu_magic.hosts_outputs()
    assert len(outputs) == 2 and all("rows predicted 6" in text for text in outputs.values())

    sync = ip.run_line_magic("tpu_sync", "")  # process 0's model, a CPU model here
    copy = ip.user_ns["cnn_cpu"]
    assert sync.as_name == "cnn_cpu" and "gathered from 2 hosts" in sync.summary()
    np.testing.assert_allclose(copy.predict(ip.user_ns["images"][:6], verbose=0),
                               expected["six"], atol=1e-5)
    mine = copy.evaluate(ip.user_ns["images"][203:316], ip.user_ns["y"][203:316],
                         return_dict=True, verbose=0, batch_size=113)
    assert mine["loss"] == pytest.approx(expected["evaluation"]["loss"], abs=1e-5)

    # A model of the notebook's under the same name is never sent: the hosts keep theirs.
    ip.run_cell("cnn = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])")
    train(ip, "print('input shape', cnn.input_shape)")
    assert all("input shape (None, 16, 16, 1)" in text
               for text in tpu_magic.hosts_outputs().values())


def test_each_host_runs_the_same_steps_an_execution(ip, hosts):
    # each host would time its own steps: K chosen alone could differ between them, and
    # hosts running different programs abort in their collectives (gloo: "Received data
    # size doesn't match expected size", a host lost mid-suite)
    report = train(ip, CNN + "history = cnn.fit(images[:512], y[:512], batch_size=8, "
                             "epochs=1, verbose=0)")
    assert report.execution.k == 1 and "on several hosts" in report.execution.why, \
        report.execution


def test_an_error_on_a_cell_line_names_the_line_and_the_hosts_once(ip, hosts):
    cell = "scale = 2\nlimit = scale * 3\nmissing = undefined_here + limit\n"
    with pytest.raises(UsageError) as raised:
        train(ip, cell)
    message = str(raised.value)
    assert message.count("NameError") == 1  # one error, said once for both hosts
    assert "host 0 (" in message and "host 1 (" in message and "(every host)" in message
    assert "line 3 of the cell, `missing = undefined_here + limit`" in message
    assert "name 'undefined_here' is not defined" in message
    with pytest.raises(UsageError, match=r"host 0 .*host 1 .*\(every host\): batch_size 30 is not divisible by 8 "):
        train(ip, CNN + "cnn.fit(images[:64], y[:64], batch_size=30)")  # tpu_magic's own check


def test_an_unseeded_cell_builds_the_same_model_on_every_host(ip, hosts, capsys, monkeypatch):
    # issue 32: a model built without a seed (what nearly every notebook does) failed on
    # every host: each process drew its own weights ("not the same on each process")
    from tpu_magic.hosts import run

    # the notebook's draw for this cell, known so that one process can repeat it
    monkeypatch.setattr(run, "_draw_seed", lambda: UNSEEDED_DRAW)
    assert UNSEEDED != CNN
    report = train(ip, UNSEEDED + FIT)
    assert report.replicas == 8 and report.evaluations
    for key, values in hosts[1]["unseeded"].items():  # as one process of 8 devices
        assert report.history.history[key] == pytest.approx(values, rel=1e-5), key
    # the notes process 0 said are said here too: the report under the cell counts them
    said = capsys.readouterr().out
    assert report.notes and all(note in said for note in report.notes)
    ip.run_line_magic("tpu_sync", "cnn --as unseeded_cpu")
    copy = ip.user_ns["unseeded_cpu"]  # process 0's weights: the ones every host trained
    again = copy.evaluate(ip.user_ns["images"][203:316], ip.user_ns["y"][203:316],
                          return_dict=True, verbose=0)
    for key, value in report.evaluations[-1].items():
        assert again[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_a_shuffled_fit_on_hosts_draws_as_one_process(ip, hosts):
    # issue 55: each host draws the order from its own NumPy generator, as plain Keras does
    # (every host seeded alike), and leaves it where one process leaves it
    report = train(ip, CNN + SHUFFLED)
    history, later = hosts[1]["shuffled"]
    for key, values in history.items():
        assert report.history.history[key] == pytest.approx(values, rel=1e-5), key
    assert all(f"later draw {later}" in text for text in tpu_magic.hosts_outputs().values())


def test_a_dataset_on_hosts_gives_one_processs_numbers(ip, hosts):
    # issue 32: every host read the whole dataset and fed it as its own part, so each
    # global batch held every sample once per host. Now each host keeps its own rows of
    # every batch (a short last batch, whole on every device), in the dataset's order.
    report = train(ip, CNN + GRAIN_FIT)
    history, evaluation = hosts[1]["grain"]
    for key, values in history.items():  # validation too
        assert report.history.history[key] == pytest.approx(values, rel=1e-5), key
    for key, value in evaluation.items():
        assert report.evaluations[0][key] == pytest.approx(value, rel=1e-5), key


def test_a_cell_calling_open_and_the_shells_own_names_uses_each_hosts_own(ip, hosts, tmp_path):
    # issue 50: the notebook's namespace holds IPython's own `open` (and `exit`, `get_ipython`,
    # `In`): sent to the hosts, `open` failed on every host ("NameError: name 'io_open' is not
    # defined"). Each host keeps its own; a value the user binds to such a name is sent.
    cell = ("import jax\n"
            f"path = {str(tmp_path)!r} + f'/host{{jax.process_index()}}.txt'\n"
            "with open(path, 'w') as f:\n"
            "    f.write('written on ' + type(get_ipython()).__name__)\n"
            "print('read back:', open(path).read(), callable(exit), len(In) > 0)\n")
    train(ip, cell)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host0.txt", "host1.txt"]
    outputs = tpu_magic.hosts_outputs()
    shell = type(ip).__name__  # the notebook's, which no host may use
    assert all("read back: written on " in text and shell not in text and "True True" in text
               for text in outputs.values()), outputs
    ip.run_cell("def open(path, mode='r'):\n    return 'the users own open'")
    try:
        train(ip, "print('opened:', open('nothing-here'))")
    finally:
        ip.run_cell("del open")
    assert all("opened: the users own open" in text
               for text in tpu_magic.hosts_outputs().values())


KERASHUB_INPUTS = """
import grain
keras.utils.set_random_seed(4)
rs = np.random.RandomState(3)
lengths = rs.randint(3, 13, 128)
padding_mask = np.arange(12)[None, :] < lengths[:, None]
token_ids = np.where(padding_mask, rs.randint(1, 2000, (128, 12)), 0).astype("int32")
labels = rs.randint(0, 2, 128)
ids = keras.Input((12,), dtype="int32", name="token_ids")
mask = keras.Input((12,), dtype="bool", name="padding_mask")
pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(2000, 16)(ids), mask=mask)
classifier = keras.Model({"token_ids": ids, "padding_mask": mask}, keras.layers.Dense(2)(pooled))
classifier.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rows = grain.MapDataset.source(list(range(128))).map(
    lambda i: ({"token_ids": token_ids[i], "padding_mask": padding_mask[i]}, labels[i])).batch(32)
classifier.fit(rows, epochs=2)
"""


def test_kerashub_dict_inputs_on_hosts_get_tokens_per_second_of_real_tokens(ip, hosts):
    # issue 32: KerasHub's inputs (token_ids and padding_mask) on several hosts: the real
    # tokens of the whole batch, not of one host's rows
    report = train(ip, KERASHUB_INPUTS)
    lengths = np.random.RandomState(3).randint(3, 13, 128)  # as the cell draws them
    per_row = lengths[:32].mean()  # the first batch's real tokens a row
    assert report.samples_per_second and report.replicas == 8
    assert report.tokens_per_second == pytest.approx(report.samples_per_second * per_row)
    assert "tokens/s (real tokens, padding left out)" in report.summary()


# Dense layers with LoRA, named so that a model built here has the hosts' variable paths
LORA = """
keras.utils.set_random_seed(0)
adapted = keras.Sequential([keras.Input(images.shape[1:]), keras.layers.Flatten(),
                            keras.layers.Dense(32, activation="relu", name="hidden"),
                            keras.layers.Dense(10, name="logits")], name="adapted")
for layer in adapted.layers[1:]:
    layer.enable_lora(2)
adapted.compile("adam", "sparse_categorical_crossentropy")
"""


def test_adapters_alone_are_saved_from_the_hosts_and_load_back(ip, hosts, tmp_path):
    # issue 56: `%tpu_sync --adapters` on several hosts saved every weight (the flag never
    # reached the hosts' branch)
    train(ip, LORA + "adapted.fit(images[:203], y[:203], batch_size=32, epochs=1)")
    report = ip.run_line_magic("tpu_sync", f"adapted --save {tmp_path / 'lora'} --adapters")
    saved, whole = report.adapters
    assert report.path == str(tmp_path / "lora.adapters.h5") and saved < 0.5 * whole
    assert not list(tmp_path.glob("*.weights.h5"))
    # the same model built here from the seed, the adapters loaded: the hosts' trained model
    ip.user_ns["path"] = report.path
    ip.run_cell(LORA + "import tpu_magic\nloaded = tpu_magic.load_adapters(adapted, path)")
    assert ip.user_ns["loaded"] == 6  # each Dense layer's lora_kernel_a, _b and bias
    for mine, theirs in zip(ip.user_ns["adapted"].get_weights(),
                            ip.user_ns[report.as_name].get_weights()):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)


def test_checkpoints_are_written_once_and_every_host_resumes(ip, hosts, tmp_path):
    cell = CNN + "cnn.fit(images[:203], y[:203], batch_size=32, epochs={epochs})"
    first = train(ip, cell.format(epochs=1), f"--no-progress --checkpoint {tmp_path}")
    # several processes: one orbax checkpoint, to which every host writes its part
    assert [p.name for p in sorted(tmp_path.glob("ckpt-*"))] == \
        [os.path.basename(p) for p in first.checkpoints]
    assert len(first.checkpoints) == 1 and first.checkpoints[0].endswith(".orbax")
    again = train(ip, cell.format(epochs=2), f"--no-progress --checkpoint {tmp_path} --resume")
    assert again.resumed_from == first.checkpoints[0] and len(again.checkpoints) == 1
    assert len(list(tmp_path.glob("ckpt-*.orbax"))) == 2


@pytest.mark.parametrize("mesh", ["1x8", "2x4"])
def test_a_model_sharded_across_the_hosts_equals_one_process(ip, hosts, mesh):
    # issue 32: a slice of two or more hosts (v5e-16, v5p-16) lays a model out over a mesh
    # whose model columns (1x8) or data rows (2x4) span the processes
    loss, five = hosts[1][mesh]
    report = train(ip, SHARDED_FIVE,
                   f"--no-progress --shard model --mesh {mesh} --plan-for v5e-8")
    assert report.history.history["loss"] == pytest.approx(loss, rel=1e-4)
    assert report.replicas == int(mesh[0]) and report.global_batch == 32
    assert report.sharding[0].startswith(f"sharding: mesh {mesh} (data × model)")
    per_device, total = (float(v) for v in re.search(
        r"weights ([\d.]+) MiB per device of ([\d.]+) MiB", report.sharding[0]).groups())
    assert per_device < total / 2  # split across the hosts' devices, not copied to each
    assert " of 16 GiB per TPU v5e device (weights " in report.memory_plan  # per chip
    sync = ip.run_line_magic("tpu_sync", "sharded --as sharded_cpu")  # gathered from both
    assert "gathered from 2 hosts" in sync.summary()
    copy = ip.user_ns["sharded_cpu"]
    np.testing.assert_allclose(copy.predict(ip.user_ns["tokens"][:5], verbose=0), five,
                               atol=1e-4)


def test_a_sharded_model_on_hosts_checkpoints_shard_by_shard_and_resumes(ip, hosts, tmp_path):
    # issue 32: each process writes its own shards (orbax-checkpoint), never gathering the
    # model into one; a write cut short never counts
    line = f"--no-progress --shard model --mesh 1x8 --checkpoint {tmp_path}"
    first = train(ip, SHARDED.replace("epochs=2", "epochs=1"), line)
    written = sorted(tmp_path.glob("ckpt-*"))
    assert [p.name for p in written] == [os.path.basename(p) for p in first.checkpoints]
    assert written[0].suffix == ".orbax"
    for process in (0, 1):  # the embedding and kernels are split over both hosts' devices
        part = written[0] / f"ocdbt.process_{process}"
        assert sum(f.stat().st_size for f in part.rglob("*") if f.is_file()) > 2**20
    assert any("MiB by process 0, " in n and "MiB by process 1" in n for n in first.notes)

    # a write a killed process left (orbax's temporary directory) never counts
    (tmp_path / "ckpt-000002-epoch-0002.orbax.orbax-checkpoint-tmp-17").mkdir()
    again = train(ip, SHARDED, line + " --resume")
    assert again.resumed_from == str(written[0])
    assert not list(tmp_path.glob("*orbax-checkpoint-tmp*"))
    loss, _ = hosts[1]["1x8"]  # the second epoch, as one process's two-epoch run
    assert again.history.history["loss"] == pytest.approx(loss[1:], rel=1e-4)
    assert [os.path.basename(p) for p in again.checkpoints] == ["ckpt-000002-epoch-0002.orbax"]

    # a later checkpoint damaged on one host only (process 1's shards): process 0 reads its
    # own shards whole, yet every host agrees the checkpoint is unusable; it is moved aside
    # and said, and the cell resumes from the one before (it used to end in orbax's barrier)
    damaged = tmp_path / "ckpt-000003-epoch-0003.orbax"
    shutil.copytree(tmp_path / "ckpt-000002-epoch-0002.orbax", damaged)
    for shard in (damaged / "ocdbt.process_1" / "d").iterdir():
        shard.write_bytes(shard.read_bytes()[:100])
    third = train(ip, SHARDED.replace("epochs=2", "epochs=3"), line + " --resume")
    assert third.resumed_from == str(tmp_path / "ckpt-000002-epoch-0002.orbax")
    assert len(third.history.history["loss"]) == 1  # the third epoch alone
    assert (tmp_path / (damaged.name + ".damaged")).is_dir() and not damaged.exists()
    assert any("unreadable on another host" in n and f"moved aside to {damaged.name}.damaged"
               in n for n in third.notes), third.notes


def test_shard_auto_on_hosts_chooses_as_one_process(ip, hosts):
    limit, loss, plan = hosts[1]["auto"]
    cell = (f"import os\nos.environ[{LIMIT!r}] = {limit!r}  # a small device, on each host\n"
            "try:\n" + "".join(f"    {line}\n" for line in SHARDED.strip().splitlines())
            + f"finally:\n    del os.environ[{LIMIT!r}]\n")
    report = train(ip, cell, "--no-progress --shard auto")
    assert report.strategy == "DerivedModelParallel"
    assert report.memory_plan.split(";")[-1] == plan.split(";")[-1]  # the same mesh chosen
    assert report.history.history["loss"] == pytest.approx(loss, rel=1e-4)


def test_a_host_killed_mid_fit_ends_the_cell_naming_it_and_the_next_connect_works(ip, hosts):
    from tpu_magic.core import process

    victim = process.hosts().engines[1]
    # what the process writes itself (XLA's and Python's last words go there): shown
    slow = (CNN + "import os, time, jax\n"
            "class Slow(keras.callbacks.Callback):\n"
            "    def on_train_batch_end(self, batch, logs=None):\n"
            "        if batch == 0 and jax.process_index() == 1:\n"
            "            os.write(2, b'host one was here\\n')\n"
            "        time.sleep(0.2)\n"
            "cnn.fit(images[:512], y[:512], batch_size=64, epochs=50, callbacks=[Slow()])\n")
    killer = threading.Timer(12.0, os.kill, (victim.pid, 9))
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(UsageError, match=rf"host 1 \({victim.host}\) ended mid-cell") as ended:
            train(ip, slow)
        said = str(ended.value)
        assert "wrote last:" in said and "host one was here" in said, said
    finally:
        killer.cancel()
    assert time.monotonic() - started < 12.0 + 10.0  # found at once, not after a collective times out
    assert process.hosts() is None  # the connection ended with its hosts
    started = time.monotonic()
    with pytest.raises(UsageError, match="--hosts nosuch: no ipyparallel cluster answered "
                                         "within 3 s"):
        ip.run_line_magic("tpu_connect", "--hosts nosuch --timeout 3 --no-panel")
    assert time.monotonic() - started < 3 + 10
    again = ip.run_line_magic("tpu_connect", "--simulate 2x2 --no-panel")
    assert "2 hosts × 2 devices" in again.summary()
    report = train(ip, CNN + "cnn.fit(images[:64], y[:64], batch_size=16, epochs=1)")
    assert report.replicas == 4 and report.epochs == 1


def test_a_host_stuck_outside_the_step_is_named_within_the_timeout_and_the_next_connect_works(
        ip, hosts):
    # issue 32: an engine alive but busy for ever (or hung) held the others in the step's
    # collective, and the cell waited with them for ever
    from tpu_magic.core import process

    ip.run_line_magic("tpu_connect", "--simulate 2x2 --timeout 8 --no-panel")
    stuck = (CNN + "import jax, time\n"
             "if jax.process_index() == 1:\n"
             "    time.sleep(3600)  # busy for ever, after the model is built\n"
             "cnn.fit(images[:64], y[:64], batch_size=16, epochs=1)\n")
    started = time.monotonic()
    with pytest.raises(UsageError, match=r"host 1 \(.*\) made no progress for 8 s, while the "
                                         r"other hosts waited for it inside the step"):
        train(ip, stuck)
    assert time.monotonic() - started < 8 + 30
    assert process.hosts() is None  # stopped: the next connect starts anew
    ip.run_line_magic("tpu_connect", "--simulate 2x2 --no-panel")
    report = train(ip, CNN + "cnn.fit(images[:64], y[:64], batch_size=16, epochs=1)")
    assert report.replicas == 4 and report.epochs == 1
