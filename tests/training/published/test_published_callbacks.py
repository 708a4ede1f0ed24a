"""Keras's callbacks as their docstrings use them, on TensorFlow's 8 mirrored replicas beside
plain Keras on one device from the same seed (`support.same`): what each callback decided
(the epoch it stopped at, the rates it set, the weights it restored, the files it wrote) must
be plain Keras's. The JAX side, with more of them, is
tests/jax_backend/test_published_callbacks_jax.py.

Sources: the callbacks' docstrings in keras/src/callbacks/ (Keras 3.15), in our own words on
small synthetic data; `shuffle=False` throughout.
"""

import numpy as np
import pytest

from support.cells import train
from support.same import (both, imports, plainly, run_cell, same_history, same_values,
                          same_weights)

ROWS = """
x = np.random.RandomState(0).rand(192, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 3, 192)
x_val = np.random.RandomState(2).rand(61, 8).astype("float32")
y_val = np.random.RandomState(3).randint(0, 3, 61)
"""
MODEL = """
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3, activation="softmax")])
model.compile(keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
"""
FIT = "x, y, batch_size=32, shuffle=False, verbose=0"


def both_at(ip, tmp_path, setup, cell):
    """`support.same.both`, each run writing under a folder of its own (`{out}` in the cell)."""
    runs = {}
    for name in ("plain", "magic"):
        runs[name] = tmp_path / name
        runs[name].mkdir()
    plain = plainly(setup, cell.replace("{out}", str(runs["plain"])))
    run_cell(ip, imports() + setup)
    train(ip, cell.replace("{out}", str(runs["magic"])))
    return plain, ip.user_ns, runs


# keras.callbacks.EarlyStopping and ReduceLROnPlateau together (the guides pair them):
# validation loss, patience, the best weights restored, the rate reduced on a plateau.
def test_early_stopping_and_reduce_lr_on_plateau_decide_as_plain_keras(sim8):
    plain, ours, _ = both(sim8, ROWS, MODEL + f"""
stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=3,
                                        restore_best_weights=True)
reduce_lr = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.2, patience=1,
                                              min_lr=0.001)
history = model.fit({FIT}, epochs=10, validation_data=(x_val, y_val),
                    callbacks=[stopper, reduce_lr])
stopped, best = stopper.stopped_epoch, stopper.best_epoch
""")
    assert (ours["stopped"], ours["best"]) == (plain["stopped"], plain["best"])
    assert plain["history"].history["learning_rate"][-1] < 0.05
    same_history(plain, ours)
    same_weights(plain, ours)


# keras.callbacks.ModelCheckpoint: the docstring's weights-only variant, every epoch to its
# own file named by the epoch; the second epoch's weights loaded into a fresh model in a later
# plain cell predict as plain Keras's.
def test_model_checkpoint_of_each_epochs_weights_loads_in_a_later_cell(sim8, tmp_path):
    cell = MODEL + f"""
checkpoint = keras.callbacks.ModelCheckpoint("{{out}}/ckpt-{{epoch:02d}}.weights.h5",
                                             save_weights_only=True)
history = model.fit({FIT}, epochs=3, callbacks=[checkpoint])
"""
    plain, ours, runs = both_at(sim8, tmp_path, ROWS, cell)
    assert sorted(p.name for p in runs["magic"].iterdir()) == \
        sorted(p.name for p in runs["plain"].iterdir()) == \
        ["ckpt-01.weights.h5", "ckpt-02.weights.h5", "ckpt-03.weights.h5"]
    later = ("second = keras.models.clone_model(model)\n"
             "second.load_weights({path!r})\n"
             "predicted = second.predict(x_val[:9], verbose=0)\n")
    exec(later.format(path=str(runs["plain"] / "ckpt-02.weights.h5")), plain)
    run_cell(sim8, later.format(path=str(runs["magic"] / "ckpt-02.weights.h5")))
    same_values(plain, ours, "predicted")
    same_history(plain, ours)


# keras.callbacks.BackupAndRestore: the docstring's session. A callback interrupts the fit at
# epoch 4 (the cell fails with the user's own RuntimeError); the same fit in the next cell
# resumes from the backup and runs the epochs left.
def test_backup_and_restore_resumes_after_a_failed_cell(sim8, tmp_path):
    setup = ROWS + """
class InterruptingCallback(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 4:
            raise RuntimeError("Interrupting!")
""" + MODEL.replace("Adam(0.05)", "SGD(0.05)")
    interrupted = f"""
callback = keras.callbacks.BackupAndRestore(backup_dir="{{out}}/backup")
model.fit({FIT}, epochs=7, callbacks=[callback, InterruptingCallback()])
"""
    resumed = f"history = model.fit({FIT}, epochs=7, callbacks=[callback])\n"
    plain = plainly(setup, "")
    with pytest.raises(RuntimeError, match="Interrupting!"):
        exec(interrupted.replace("{out}", str(tmp_path / "plain")), plain)
    exec(resumed, plain)
    run_cell(sim8, imports() + setup)
    with pytest.raises(RuntimeError, match="^Interrupting!$"):
        train(sim8, interrupted.replace("{out}", str(tmp_path / "magic")))
    train(sim8, resumed)
    assert len(sim8.user_ns["history"].history["loss"]) == \
        len(plain["history"].history["loss"]) == 3
    same_history(plain, sim8.user_ns)
    same_weights(plain, sim8.user_ns)


# keras.callbacks.TerminateOnNaN with a keras.callbacks.LambdaCallback counting the batches: a
# sample with an infinite feature (in one replica's part of the third batch) turns the loss
# into NaN there, and training ends at that batch, as in plain Keras.
def test_terminate_on_nan_stops_at_the_same_batch(sim8):
    plain, ours, _ = both(sim8, ROWS + "x_bad = x.copy()\nx_bad[70, 3] = np.inf\n", MODEL + """
seen = []
counting = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
history = model.fit(x_bad, y, batch_size=32, shuffle=False, verbose=0, epochs=3,
                    callbacks=[keras.callbacks.TerminateOnNaN(), counting])
""")
    assert ours["seen"] == plain["seen"] == [0, 1, 2]
    assert np.isnan(ours["history"].history["loss"]).all()
    assert len(ours["history"].history["loss"]) == len(plain["history"].history["loss"])


# keras.callbacks.LearningRateScheduler (the docstring's exponential decay after the first
# epochs) with keras.callbacks.CSVLogger writing the epochs' logs.
def test_learning_rate_scheduler_with_a_csv_logger(sim8, tmp_path):
    cell = MODEL.replace("Adam(0.05)", "SGD(0.1)") + f"""
import math
def scheduler(epoch, lr):
    return lr if epoch < 2 else lr * math.exp(-0.1)
callbacks = [keras.callbacks.LearningRateScheduler(scheduler),
             keras.callbacks.CSVLogger("{{out}}/training.log")]
history = model.fit({FIT}, epochs=4, callbacks=callbacks)
rate = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
"""
    plain, ours, runs = both_at(sim8, tmp_path, ROWS, cell)
    assert ours["rate"] == pytest.approx(plain["rate"]) == pytest.approx(0.1 * np.exp(-0.2))
    same_history(plain, ours)
    rows = {run: np.genfromtxt(runs[run] / "training.log", delimiter=",", names=True)
            for run in runs}
    assert rows["magic"].dtype.names == rows["plain"].dtype.names
    for name in rows["plain"].dtype.names:
        np.testing.assert_allclose(rows["magic"][name], rows["plain"][name], rtol=1e-4)
