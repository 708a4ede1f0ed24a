"""`%%tpu_train --checkpoint DIR [--keep K] [--resume]` in this process, on 8 replicas.

The crash tests (SIGKILL while a checkpoint is written, resume in a new process) are
in test_faults.py.
"""

import os

import numpy as np
import pytest
from support.cells import ADAM, train
from IPython.core.error import UsageError

import tpu_magic
from tpu_magic.training.checkpoints.one_file import read_checkpoint

FIT = "model.fit(x[:600], y[:600], batch_size=64, epochs={epochs}, verbose=0)\n"


def weights(ip):
    return [w.copy() for w in ip.user_ns["model"].get_weights()]


def largest_difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def checkpoint_files(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))


def test_every_epoch_is_checkpointed_and_the_last_k_kept(digits, tmp_path):
    report = train(digits, ADAM + FIT.format(epochs=4), f"--no-progress --checkpoint {tmp_path} --keep 3")
    assert len(report.checkpoints) == 4
    assert checkpoint_files(tmp_path) == ["ckpt-000002-epoch-0002.h5", "ckpt-000003-epoch-0003.h5",
                                          "ckpt-000004-epoch-0004.h5"]
    newest = read_checkpoint(tmp_path / "ckpt-000004-epoch-0004.h5")
    assert newest.epoch == 4 and newest.optimizer_class == "Adam"
    model_weights = weights(digits)
    assert largest_difference(newest.weights.arrays, model_weights) == 0
    # Adam: the iteration count, then a momentum and a velocity per weight.
    assert len(newest.optimizer.arrays) == 2 + 2 * len(model_weights)
    assert int(newest.optimizer.arrays[0]) == 4 * 10  # 4 epochs of 10 steps
    assert "checkpoints: 4 written" in report.summary()


def test_resuming_gives_the_weights_of_an_uninterrupted_run(digits, tmp_path):
    train(digits, ADAM + FIT.format(epochs=5))
    straight = weights(digits)

    train(digits, ADAM + FIT.format(epochs=2), f"--no-progress --checkpoint {tmp_path}")
    report = train(digits, ADAM + FIT.format(epochs=5), f"--no-progress --checkpoint {tmp_path} --resume")
    assert report.resumed_from.endswith("ckpt-000002-epoch-0002.h5")
    assert report.epochs == 3
    assert report.history.epoch == [2, 3, 4]
    assert largest_difference(weights(digits), straight) < 1e-5
    assert checkpoint_files(tmp_path)[-1] == "ckpt-000005-epoch-0005.h5"


def test_resume_after_the_last_epoch_restores_the_weights_and_trains_no_more(digits, tmp_path, capsys):
    train(digits, ADAM + FIT.format(epochs=2), f"--no-progress --checkpoint {tmp_path}")
    trained = weights(digits)
    report = train(digits, ADAM + FIT.format(epochs=2), f"--checkpoint {tmp_path} --resume")
    assert report.epochs == 0
    assert largest_difference(weights(digits), trained) == 0
    assert "all 2 are done" in capsys.readouterr().out


def test_resume_with_no_checkpoint_yet_starts_from_the_beginning(digits, tmp_path, capsys):
    report = train(digits, ADAM + FIT.format(epochs=1), f"--checkpoint {tmp_path / 'new'} --resume")
    assert report.resumed_from is None and report.epochs == 1
    assert "yet, training from the start" in capsys.readouterr().out
    assert checkpoint_files(tmp_path / "new") == ["ckpt-000001-epoch-0001.h5"]


def test_existing_checkpoints_without_resume_are_refused_before_anything_runs(digits, tmp_path):
    train(digits, ADAM + FIT.format(epochs=1), f"--no-progress --checkpoint {tmp_path}")
    before = weights(digits)
    with pytest.raises(UsageError, match=r"already holds checkpoints \(the newest after epoch 1\): "
                                         "add --resume"):
        train(digits, FIT.format(epochs=1), f"--no-progress --checkpoint {tmp_path}")
    assert largest_difference(weights(digits), before) == 0
    assert checkpoint_files(tmp_path) == ["ckpt-000001-epoch-0001.h5"]


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(digits, tmp_path, capsys):
    train(digits, ADAM + FIT.format(epochs=2), f"--no-progress --checkpoint {tmp_path}")
    newest = tmp_path / "ckpt-000002-epoch-0002.h5"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    report = train(digits, ADAM + FIT.format(epochs=3), f"--no-progress --checkpoint {tmp_path} --resume")
    out = capsys.readouterr().out
    assert "warning: ckpt-000002-epoch-0002.h5 is unreadable" in out
    assert report.resumed_from.endswith("ckpt-000001-epoch-0001.h5")
    assert report.history.epoch == [1, 2]


def test_no_readable_checkpoint_at_all_is_a_usage_error(digits, tmp_path, capsys):
    train(digits, ADAM + FIT.format(epochs=1), f"--no-progress --checkpoint {tmp_path}")
    (tmp_path / "ckpt-000001-epoch-0001.h5").write_bytes(b"not hdf5")
    before = weights(digits)
    capsys.readouterr()
    with pytest.raises(UsageError, match="no checkpoint in .* reads back whole .*moved aside"):
        train(digits, FIT.format(epochs=2).replace("batch_size=64", "batch_size=40"),
              f"--no-progress --checkpoint {tmp_path} --resume")
    assert largest_difference(weights(digits), before) == 0
    # the batch's advice, found as the fit was planned before --resume failed, is said too
    assert "warning: 5 samples per replica (batch_size 40 / 8)" in capsys.readouterr().out


@pytest.mark.parametrize("other, mismatch", [
    ("keras.layers.Dense(16, activation='relu')", r"weights 0 \(.*kernel\) has shape \(64, 16\) in "
                                                   r"the model but \(64, 32\) in the checkpoint"),
    ("keras.layers.Dense(32, activation='relu'), keras.layers.Dense(32)", "the checkpoint has 4 "
                                                                          "weights, the model has 6"),
])
def test_a_checkpoint_of_another_architecture_names_the_mismatch(digits, tmp_path, other, mismatch):
    train(digits, ADAM + FIT.format(epochs=1), f"--no-progress --checkpoint {tmp_path}")
    other_model = ADAM.replace("keras.layers.Dense(32, activation=\"relu\")", other)
    train(digits, other_model)
    before = weights(digits)
    with pytest.raises(UsageError, match="cannot resume from ckpt-000001-epoch-0001.h5: it was "
                                         f"written for another model \\({mismatch}"):
        train(digits, FIT.format(epochs=2), f"--no-progress --checkpoint {tmp_path} --resume")
    assert largest_difference(weights(digits), before) == 0


def test_another_optimizer_is_a_mismatch_too(digits, tmp_path):
    train(digits, ADAM + FIT.format(epochs=1), f"--no-progress --checkpoint {tmp_path}")
    train(digits, ADAM.replace("Adam(0.01)", "RMSprop(0.01)"))
    with pytest.raises(UsageError, match="the checkpoint's optimizer is Adam, the model's is RMSprop"):
        train(digits, FIT.format(epochs=2), f"--no-progress --checkpoint {tmp_path} --resume")


def test_an_unusable_directory_is_refused_before_the_cell_runs(digits, tmp_path):
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("x")
    train(digits, ADAM)
    digits.user_ns.pop("ran", None)
    with pytest.raises(UsageError, match=f"--checkpoint {in_the_way}/ckpt: cannot write there "
                                         r"\(.*\)\. Choose a directory you can write to"):
        train(digits, "ran = True\n" + FIT.format(epochs=1), f"--checkpoint {in_the_way}/ckpt")
    assert "ran" not in digits.user_ns


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_directory_is_refused(digits, tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="cannot write there"):
            train(digits, ADAM + FIT.format(epochs=1), f"--checkpoint {tmp_path}")
    finally:
        tmp_path.chmod(0o700)


def test_a_full_disk_stops_training_with_the_state_intact(digits, tmp_path, monkeypatch):
    from tpu_magic.training.checkpoints import store as checkpoint

    real_write = checkpoint.write_file

    def full_after_epoch_1(path, epoch, *args):
        if epoch == 1:
            return real_write(path, epoch, *args)
        with open(path, "wb") as handle:
            handle.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_file", full_after_epoch_1)
    with pytest.raises(UsageError, match=r"the checkpoint after epoch 2 could not be written to .*"
                                         r"ckpt-000002-epoch-0002\.h5 \(No space left on device\)\. "
                                         r"Training stopped; the model keeps its weights and "
                                         r"ckpt-000001-epoch-0001\.h5 is intact"):
        train(digits, ADAM + FIT.format(epochs=5), f"--no-progress --checkpoint {tmp_path}")
    assert os.listdir(tmp_path) == ["ckpt-000001-epoch-0001.h5"]  # no temporary left behind
    assert read_checkpoint(tmp_path / "ckpt-000001-epoch-0001.h5").epoch == 1
    model = digits.user_ns["model"]
    assert int(model.optimizer.iterations.numpy()) == 2 * 10  # two whole epochs learned
    monkeypatch.undo()
    report = train(digits, ADAM + FIT.format(epochs=3), f"--no-progress --checkpoint {tmp_path} --resume")
    assert report.history.epoch == [1, 2]


def test_a_directory_gone_mid_training_stops_with_the_epoch_and_resume(digits, tmp_path):
    directory = tmp_path / "drive"
    digits.run_cell(f"""
import shutil
class LoseTheMount(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            shutil.rmtree({str(directory)!r})
""")
    # the checkpoint of epoch 2 is written before the callback removes the directory
    with pytest.raises(UsageError, match=r"the checkpoint after epoch 3 could not be written: "
                                         r"the --checkpoint directory .*drive is gone .* the model "
                                         r"keeps its weights.* re-run the cell with --resume"):
        train(digits, ADAM + "model.fit(x[:600], y[:600], batch_size=64, epochs=4, verbose=0, "
                             "callbacks=[LoseTheMount()])",
              f"--no-progress --checkpoint {directory}")
    model = digits.user_ns["model"]
    assert int(model.optimizer.iterations.numpy()) == 3 * 10  # three whole epochs learned
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_an_epoch_stopped_by_ctrl_c_gets_no_checkpoint(digits, tmp_path):
    digits.run_cell("""
import os, signal
class PressCtrlC(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == 13:
            os.kill(os.getpid(), signal.SIGINT)
""")
    with pytest.raises(KeyboardInterrupt):
        train(digits, ADAM + "model.fit(x[:600], y[:600], batch_size=64, epochs=4, "
                             "callbacks=[PressCtrlC()])", f"--no-progress --checkpoint {tmp_path}")
    report = tpu_magic.workspace().report
    assert report.interrupted
    assert checkpoint_files(tmp_path) == ["ckpt-000001-epoch-0001.h5"]
    assert "epoch 2 was stopped early, so it has no checkpoint" in " ".join(report.notes)


def test_leftovers_of_a_dead_writer_are_removed(digits, tmp_path):
    leftover = tmp_path / ".ckpt-000001-epoch-0001.h5.999999999.tmp"
    leftover.write_bytes(b"half")
    train(digits, ADAM + FIT.format(epochs=1), f"--no-progress --checkpoint {tmp_path} --resume")
    assert not leftover.exists()


@pytest.mark.parametrize("line, message", [
    ("--resume", "--resume works with --checkpoint DIR"),
    ("--keep 3", "--keep works with --checkpoint DIR"),
    ("--checkpoint ckpt --keep 0", "--keep 0 must be 1 or more"),
])
def test_checkpoint_flag_mistakes_are_usage_errors(digits, tmp_path, monkeypatch, line, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=message):
        train(digits, ADAM + FIT.format(epochs=1), line)


LORA = """
keras.utils.set_random_seed(4)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2048, activation="relu"),
                          keras.layers.Dense(2048, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
for layer in model.layers[:2]:
    layer.enable_lora(4)
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
"""


def test_a_lora_model_checkpoints_its_adapters_only_and_resumes_exactly(digits, tmp_path):
    train(digits, LORA + FIT.format(epochs=2))
    straight = weights(digits)

    report = train(digits, LORA + FIT.format(epochs=1), f"--no-progress --checkpoint {tmp_path}")
    written = tmp_path / "ckpt-000001-epoch-0001.h5"
    saved = read_checkpoint(written)
    model = digits.user_ns["model"]
    assert saved.adapters_only and len(saved.weights.arrays) < len(model.weights)
    bases = {layer._kernel.path for layer in model.layers[:2]}
    assert not bases & set(saved.weights.names)  # the frozen bases stay out
    full = sum(w.numpy().nbytes for w in model.weights)
    assert written.stat().st_size < 0.05 * full  # adapters, their Adam slots, the head
    assert any("the checkpoints hold what trains" in n for n in report.notes)

    report = train(digits, LORA + FIT.format(epochs=2), f"--no-progress --checkpoint {tmp_path} "
                                                        "--resume")
    assert report.history.epoch == [1]
    assert largest_difference(weights(digits), straight) < 1e-5


FROZEN_EMBEDDING = """
keras.utils.set_random_seed(4)
rows = np.random.RandomState(0)
ids = rows.randint(1, 20000, (256, 12))
labels = rows.randint(0, 2, 256)
embedding = keras.layers.Embedding(20000, 32)  # the vocabulary dominates, as in a real one
model = keras.Sequential([keras.Input((12,), dtype="int32"), embedding,
                          keras.layers.GlobalAveragePooling1D(),
                          keras.layers.BatchNormalization(), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dropout(0.1), keras.layers.Dense(1, activation="sigmoid")])
embedding.trainable = False
model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy")
model.fit(ids, labels, batch_size=64, epochs={epochs}, verbose=0)
"""


def test_a_frozen_layer_stays_out_of_checkpoints_and_resume_is_exact(digits, tmp_path):
    # issue 32: checkpoints left out LoRA's bases only; every weight of a frozen layer never
    # changes either (here a frozen embedding that is 99 % of the model)
    train(digits, FROZEN_EMBEDDING.format(epochs=3))
    straight = weights(digits)

    report = train(digits, FROZEN_EMBEDDING.format(epochs=2),
                   f"--no-progress --checkpoint {tmp_path}")
    written = tmp_path / "ckpt-000002-epoch-0002.h5"
    saved = read_checkpoint(written)
    model = digits.user_ns["model"]
    assert saved.adapters_only
    assert not [n for n in saved.weights.names if "embedding" in n]
    # what changes stays in: the BatchNorm statistics of a trainable layer, Dropout's seed
    assert [n for n in saved.weights.names if "moving_mean" in n]
    assert [n for n in saved.weights.names if "seed_generator_state" in n]
    full = sum(w.numpy().nbytes for w in model.weights)
    assert written.stat().st_size < 0.05 * full
    assert any("the checkpoints hold what trains" in n for n in report.notes)

    report = train(digits, FROZEN_EMBEDDING.format(epochs=3),
                   f"--no-progress --checkpoint {tmp_path} --resume")
    assert report.history.epoch == [2]
    assert largest_difference(weights(digits), straight) < 1e-5
