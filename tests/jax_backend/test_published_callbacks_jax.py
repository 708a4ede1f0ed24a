"""Keras's callbacks as their docstrings and the keras-io guides use them, on Keras's JAX backend:
each cell runs plainly on one device and through `%%tpu_train` on 8 simulated devices from the
same seed (`support.same`), and what the callback decided (the epoch it stopped at, the rates
it set, the weights it kept or restored, the files it wrote) must be plain Keras's.

Sources: the callbacks' docstrings in keras/src/callbacks/ (Keras 3.15), guides/
writing_your_own_callbacks.py and examples/keras_recipes/sklearn_metric_callbacks.py
(keras-team/keras-io), in our own words on small synthetic data. `shuffle=False` throughout:
both runs see the same batches in the same order.
"""

import csv
import math

import numpy as np
import pytest

from support.cells import train
from support.same import (both, imports, plainly, run_cell, same_history, same_values,
                          same_weights)

ROWS = """
x = np.random.RandomState(0).rand(203, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 3, 203)
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


def both_at(ip, tmp_path, setup, cell, line="--no-progress"):
    """`support.same.both`, each run writing under a folder of its own (`{out}` in the cell)."""
    runs = {}
    for name in ("plain", "magic"):
        runs[name] = tmp_path / name
        runs[name].mkdir()
    plain = plainly(setup, cell.replace("{out}", str(runs["plain"])))
    run_cell(ip, imports() + setup)
    report = train(ip, cell.replace("{out}", str(runs["magic"])), line)
    return plain, ip.user_ns, report, runs


# keras.callbacks.EarlyStopping: validation loss with patience, a first epoch it may not stop
# at (start_from_epoch) and the best weights restored; Adam at 0.05 overfits within 12 epochs.
def test_early_stopping_restores_the_best_weights_at_the_same_epoch(ip):
    plain, ours, _ = both(ip, ROWS, MODEL + f"""
stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=1e-3,
                                        restore_best_weights=True, start_from_epoch=1)
history = model.fit({FIT}, epochs=12, validation_data=(x_val, y_val), callbacks=[stopper])
stopped, best = stopper.stopped_epoch, stopper.best_epoch
""")
    assert (ours["stopped"], ours["best"]) == (plain["stopped"], plain["best"])
    assert 0 < plain["stopped"] < 11  # it did stop early
    same_history(plain, ours)
    same_weights(plain, ours)


# keras.callbacks.ReduceLROnPlateau: the docstring's factor 0.2, patience, min_lr, and a
# cooldown; the rate each epoch is in the logs.
def test_reduce_lr_on_plateau_sets_the_same_rates(ip):
    plain, ours, _ = both(ip, ROWS, MODEL + f"""
reduce_lr = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.2, patience=1,
                                              min_lr=0.001, cooldown=1)
history = model.fit({FIT}, epochs=8, validation_data=(x_val, y_val), callbacks=[reduce_lr])
rate = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
""")
    assert plain["history"].history["learning_rate"][-1] < 0.05  # it did reduce
    same_history(plain, ours)
    assert ours["rate"] == pytest.approx(plain["rate"])
    same_weights(plain, ours)


# keras.callbacks.LearningRateScheduler: the docstring's schedule, the rate kept for the first
# epochs and then multiplied by exp(-0.1) each epoch.
def test_learning_rate_scheduler_from_the_docstring(ip):
    plain, ours, _ = both(ip, ROWS, MODEL.replace("Adam(0.05)", "SGD(0.1)") + f"""
import math
def scheduler(epoch, lr):
    if epoch < 2:
        return lr
    return lr * math.exp(-0.1)
callback = keras.callbacks.LearningRateScheduler(scheduler)
history = model.fit({FIT}, epochs=5, callbacks=[callback])
rate = round(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)), 5)
""")
    assert plain["rate"] == pytest.approx(0.1 * math.exp(-0.3), abs=1e-5)
    assert ours["rate"] == plain["rate"]
    same_history(plain, ours)
    same_weights(plain, ours)



# keras.callbacks.ModelCheckpoint: the docstring's whole-model variant, the best epoch by
# val_accuracy saved as .keras; loaded in a later plain cell, it predicts as plain Keras's.
def test_model_checkpoint_keeps_the_best_model_and_it_loads_in_a_later_cell(ip, tmp_path):
    cell = MODEL + f"""
checkpoint = keras.callbacks.ModelCheckpoint("{{out}}/best.keras", monitor="val_accuracy",
                                             mode="max", save_best_only=True)
history = model.fit({FIT}, epochs=4, validation_data=(x_val, y_val), callbacks=[checkpoint])
best_accuracy = checkpoint.best
"""
    plain, ours, _, runs = both_at(ip, tmp_path, ROWS, cell)
    assert ours["best_accuracy"] == pytest.approx(plain["best_accuracy"])
    later = ("best = keras.models.load_model({path!r})\n"
             "predicted = best.predict(x_val[:9], verbose=0)\n")
    exec(later.format(path=str(runs["plain"] / "best.keras")), plain)
    run_cell(ip, later.format(path=str(runs["magic"] / "best.keras")))
    same_values(plain, ours, "predicted")


# keras.callbacks.BackupAndRestore: the docstring's session. A callback interrupts the fit at
# epoch 4 (the cell fails with the user's own RuntimeError); the same fit in the next cell
# resumes from the backup and runs the 6 epochs left.
def test_backup_and_restore_resumes_after_a_failed_cell(ip, tmp_path):
    setup = ROWS + """
class InterruptingCallback(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 4:
            raise RuntimeError("Interrupting!")
""" + MODEL.replace("Adam(0.05)", "SGD(0.05)")
    interrupted = f"""
callback = keras.callbacks.BackupAndRestore(backup_dir="{{out}}/backup")
model.fit({FIT}, epochs=10, callbacks=[callback, InterruptingCallback()])
"""
    resumed = f"history = model.fit({FIT}, epochs=10, callbacks=[callback])\n"
    plain = plainly(setup, "")
    with pytest.raises(RuntimeError, match="Interrupting!"):
        exec(interrupted.replace("{out}", str(tmp_path / "plain")), plain)
    exec(resumed, plain)
    run_cell(ip, imports() + setup)
    with pytest.raises(RuntimeError, match="^Interrupting!$"):
        train(ip, interrupted.replace("{out}", str(tmp_path / "magic")))
    train(ip, resumed)
    assert len(ip.user_ns["history"].history["loss"]) == len(plain["history"].history["loss"]) == 6
    same_history(plain, ip.user_ns)
    same_weights(plain, ip.user_ns)


# keras.callbacks.CSVLogger: the epochs' logs written as CSV, appended by a second fit (whose
# missing validation columns Keras writes as NA).
def test_csv_logger_writes_the_same_rows(ip, tmp_path):
    cell = MODEL + f"""
logger = keras.callbacks.CSVLogger("{{out}}/training.log", append=True)
model.fit({FIT}, epochs=2, validation_data=(x_val, y_val), callbacks=[logger])
model.fit({FIT}, epochs=3, initial_epoch=2, callbacks=[logger])
"""
    _, _, _, runs = both_at(ip, tmp_path, ROWS, cell)

    def rows(run):
        with open(runs[run] / "training.log") as f:
            return list(csv.reader(f))

    theirs, mine = rows("plain"), rows("magic")
    assert len(mine) == len(theirs) == 4  # a header, 2 epochs, then 1 appended
    for a, b in zip(theirs, mine):
        assert len(a) == len(b)
        for p, q in zip(a, b):
            try:
                assert float(q) == pytest.approx(float(p), rel=1e-4, abs=1e-6)
            except ValueError:
                assert q == p


# keras.callbacks.TerminateOnNaN: a sample with an infinite feature turns the loss into NaN
# in the third batch; training ends there, as in plain Keras.
def test_terminate_on_nan_stops_at_the_same_batch(ip):
    plain, ours, _ = both(ip, ROWS + "x_bad = x.copy()\nx_bad[70, 3] = np.inf\n", MODEL + """
seen = []
class Batches(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        seen.append(batch)
history = model.fit(x_bad, y, batch_size=32, shuffle=False, verbose=0, epochs=3,
                    callbacks=[keras.callbacks.TerminateOnNaN(), Batches()])
""")
    assert ours["seen"] == plain["seen"] == [0, 1, 2]
    assert np.isnan(ours["history"].history["loss"]).all()
    assert len(ours["history"].history["loss"]) == len(plain["history"].history["loss"])


# keras.callbacks.LambdaCallback: the docstring's per-batch and per-epoch logging into lists.
def test_lambda_callback_logs_the_same_batches_and_epochs(ip):
    plain, ours, _ = both(ip, ROWS, MODEL + f"""
batch_losses, epoch_ends, ended = [], [], []
logging = keras.callbacks.LambdaCallback(
    on_train_batch_end=lambda batch, logs: batch_losses.append((batch, logs["loss"])),
    on_epoch_end=lambda epoch, logs: epoch_ends.append((epoch, logs["accuracy"])),
    on_train_end=lambda logs: ended.append(True))
history = model.fit({FIT}, epochs=2, callbacks=[logging])
""")
    assert len(ours["batch_losses"]) == len(plain["batch_losses"]) == 14
    for name in ("batch_losses", "epoch_ends"):
        same_values(plain, ours, name)
    assert ours["ended"] == [True]


# guides/writing_your_own_callbacks.py: EarlyStoppingAtMinLoss, which keeps the best weights
# itself (get_weights / set_weights) and stops after `patience` epochs without a new minimum.
def test_the_guides_early_stopping_at_min_loss(ip):
    plain, ours, _ = both(ip, ROWS + """
class EarlyStoppingAtMinLoss(keras.callbacks.Callback):
    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        self.best_weights = None

    def on_train_begin(self, logs=None):
        self.wait, self.stopped_epoch, self.best = 0, 0, np.inf

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("val_loss")
        if np.less(current, self.best):
            self.best, self.wait = current, 0
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                self.model.set_weights(self.best_weights)
""", MODEL + f"""
stopper = EarlyStoppingAtMinLoss(patience=1)
history = model.fit({FIT}, epochs=15, validation_data=(x_val, y_val), callbacks=[stopper])
stopped = stopper.stopped_epoch
""")
    assert ours["stopped"] == plain["stopped"] > 0
    same_history(plain, ours)
    same_weights(plain, ours)


# guides/writing_your_own_callbacks.py: CustomLearningRateScheduler over the guide's
# LR_SCHEDULE table (epoch, rate), setting `model.optimizer.learning_rate` each epoch.
def test_the_guides_custom_learning_rate_scheduler(ip):
    plain, ours, _ = both(ip, ROWS + """
LR_SCHEDULE = [(2, 0.05), (4, 0.01), (5, 0.005)]

def lr_schedule(epoch, lr):
    if epoch < LR_SCHEDULE[0][0] or epoch > LR_SCHEDULE[-1][0]:
        return lr
    for i in range(len(LR_SCHEDULE)):
        if epoch == LR_SCHEDULE[i][0]:
            return LR_SCHEDULE[i][1]
    return lr

class CustomLearningRateScheduler(keras.callbacks.Callback):
    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule
        self.rates = []

    def on_epoch_begin(self, epoch, logs=None):
        lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        scheduled_lr = self.schedule(epoch, lr)
        self.model.optimizer.learning_rate = scheduled_lr
        self.rates.append(scheduled_lr)
""", MODEL.replace("Adam(0.05)", "SGD(0.1)") + f"""
scheduler = CustomLearningRateScheduler(lr_schedule)
history = model.fit({FIT}, epochs=6, callbacks=[scheduler])
rates = scheduler.rates
""")
    assert ours["rates"] == pytest.approx(plain["rates"])
    assert plain["rates"][-1] == pytest.approx(0.005)
    same_history(plain, ours)
    same_weights(plain, ours)


# keras.callbacks.SwapEMAWeights: an optimizer keeping an exponential moving average of the
# weights (use_ema), evaluated with the average during validation.
def test_swap_ema_weights_validates_with_the_average(ip):
    plain, ours, _ = both(ip, ROWS, MODEL.replace(
        "Adam(0.05)", "Adam(0.05, use_ema=True, ema_momentum=0.9)") + f"""
history = model.fit({FIT}, epochs=3, validation_data=(x_val, y_val),
                    callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)])
""")
    same_history(plain, ours)
    same_weights(plain, ours)


# examples/keras_recipes/sklearn_metric_callbacks.py: a callback that predicts the validation
# set at each epoch's end (a predict inside fit) and scores it with scikit-learn.
def test_a_callback_scoring_its_own_predictions_with_scikit_learn(ip):
    plain, ours, _ = both(ip, ROWS + """
from sklearn.metrics import roc_auc_score

class RocAucCallback(keras.callbacks.Callback):
    def __init__(self, x_val, y_val):
        super().__init__()
        self.x_val, self.y_val, self.scores = x_val, y_val, []

    def on_epoch_end(self, epoch, logs=None):
        probabilities = self.model.predict(self.x_val, verbose=0)
        score = roc_auc_score(self.y_val, probabilities, multi_class="ovr")
        self.scores.append(score)
        logs["val_roc_auc"] = score
""", MODEL + f"""
scoring = RocAucCallback(x_val, y_val)
history = model.fit({FIT}, epochs=3, callbacks=[scoring])
scores = scoring.scores
""")
    assert len(ours["scores"]) == 3
    same_values(plain, ours, "scores")
    same_history(plain, ours)
