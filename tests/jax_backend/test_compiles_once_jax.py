"""Pay once (issue 57): a fresh model's first fit compiles exactly the programs it runs, each
once. The memory plan compiles the train step from abstract inputs and the fit runs that
executable; K is chosen from the steps that train and its group compiled once (on a thread
of its own); the first-step check's one-device step once. Counted from JAX's own log of
its compiles (`jax_log_compiles`), by program and argument types. And what the choices
hold on the devices: no copy of the model's state, only the staged batches beside plain
Keras's step (the peak of live arrays, sampled as the fit runs)."""

import contextlib
import logging
import re
import threading
import time

import numpy as np
from support.cells import train

SETUP = """
import numpy as np, keras
rs = np.random.RandomState(0)
x = rs.rand(4096, 16).astype("float32")
y = rs.randint(0, 5, 4096)
"""
CELL = """
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(5, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x, y, batch_size=32, epochs=3, validation_data=(x[:256], y[:256]), verbose=0)
"""
STEPS = ("train_step", "scanned", "test_step", "predict_step")


class Compiles(logging.Handler):
    """JAX's "Compiling jit(NAME) with global shapes and types (...)" lines, as (name,
    types)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.found: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Compiling (?:jit\()?([\w<>]+)\)? with global shapes and types (.*?)\. ",
                         record.getMessage())
        if found:
            self.found.append((found.group(1), found.group(2)))


def test_a_fresh_models_first_fit_compiles_each_program_it_runs_once(ip):
    import jax  # here: a test module that imports JAX starts it before the suite connects

    ip.run_cell(SETUP)
    compiles = Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(compiles)
    jax.config.update("jax_log_compiles", True)
    try:
        report = train(ip, CELL)
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(compiles)
    steps = [(name, types) for name, types in compiles.found if name in STEPS]
    names = [name for name, _ in steps]
    # the fit's step (the memory plan compiled it: the same executable) and the check's
    # one-device step, which takes the same global types (the log does not name layouts);
    # a group of K steps where K rose above one, and the validation's: each once
    assert names.count("train_step") == 2, steps
    twice = [key for key in set(steps) if steps.count(key) > 1 and key[0] != "train_step"]
    assert not twice, steps
    assert report.execution.k == 1 or "scanned" in names, (report.execution, steps)


# a model whose state (weights and Adam's two slots: 3 x 4.2 MB) dwarfs a batch (512 x 512
# floats, 1 MB): a copy of the state, as K's measurement once made, would show at once
WIDE = """
keras.utils.set_random_seed(5)
wide = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                         keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
wide.compile(keras.optimizers.Adam(1e-3),
             keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = wide.fit(rows, labels, batch_size=512, epochs=2, verbose=0)
"""
ROWS = """
rows = np.random.RandomState(0).rand(4096, 512).astype("float32")
labels = np.random.RandomState(1).randint(0, 10, 4096)
"""


class LiveArrays:
    """The most bytes the devices hold in live JAX arrays above those held when entered,
    sampled every millisecond on a thread of its own: each device's buffers once (a
    replicated array's on each device; a view of one of them, as NumPy's reading of an
    array makes, not again)."""

    def __enter__(self) -> "LiveArrays":
        import jax

        def live() -> int:
            held = {}
            try:
                for array in jax.live_arrays():
                    for shard in array.addressable_shards:
                        data = shard.data
                        held[shard.device.id, data.unsafe_buffer_pointer()] = data.nbytes
            except Exception:  # noqa: BLE001 - an array freed while it is read
                return 0
            return sum(held.values())

        self.base, self.peak, self._stop = live(), 0, threading.Event()

        def sample() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, live() - self.base)
                time.sleep(0.001)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_a_fit_holds_plain_keras_state_and_step_and_only_its_staged_batches_beside(ip):
    from support.same import imports, plainly

    with LiveArrays() as plain:
        plainly(ROWS, WIDE, data_parallel=True)  # plain Keras over the same 8 devices
    state = 3 * 4 * (512 * 1024 + 1024 + 1024 * 512 + 512 + 512 * 10 + 10)
    assert plain.peak > 8 * state, (plain.peak, state)  # the state, on each of 8 devices
    ip.run_cell(imports() + ROWS)
    with LiveArrays() as ours:
        report = train(ip, WIDE, "--no-progress --verify off")
    k = report.execution.k
    staged = 2 * k * 512 * (512 + 1) * 4  # the running group's batches and the next's
    # a second copy of the state (12.6 MB) would not fit under this; batches and the
    # metrics' scalars do
    assert ours.peak <= plain.peak + staged + 0.1 * state, (ours.peak, plain.peak, k)
    # the first-step check (8 devices against one) runs the first steps again on one device
    # from a copy of the state before them: one copy of the state there, and no more (its
    # step is given that copy to write its new state in; on the CPU the copy put on the
    # device is the host copy's own memory, so the step's new state is that one copy)
    with LiveArrays() as checked:
        report = train(ip, WIDE)
    # "first step" or "first K steps": K is chosen from the first steps' times
    assert "the same as on one device (distributed vs one device" in report.summary(), \
        report.summary()
    staged = 2 * report.execution.k * 512 * (512 + 1) * 4
    assert checked.peak <= plain.peak + state + staged + 0.1 * state, \
        (checked.peak, plain.peak, report.execution.k)


def test_the_checks_step_compiled_before_the_first_step_holds_no_copy_of_the_state(
        ip, monkeypatch):
    # Where its compile is done when the first step begins, the check's one-device step
    # runs then, from the model's own buffers on the first device, and returns its update's
    # sizes: no copy of the state beside the model's (after the step it starts from a copy
    # of the state before it: the test above). Here that compile is waited for, so the
    # step runs so however the machine's threads are scheduled
    from support.same import imports, plainly
    from tpu_magic.backends.jax import parity

    def ready(self, types):
        found = self._ahead.get(types)
        if found is not None:
            found.wait()
        return True

    ran = []
    update = parity.one_device_update
    monkeypatch.setattr(parity._Reference, "ready", ready)
    monkeypatch.setattr(parity, "one_device_update",
                        lambda *a, **k: ran.append(update(*a, **k)) or ran[-1])
    cell = WIDE.replace("batch_size=512", "batch_size=256")  # a setup not compared yet
    with LiveArrays() as plain:
        plainly(ROWS, cell, data_parallel=True)
    state = 3 * 4 * (512 * 1024 + 1024 + 1024 * 512 + 512 + 512 * 10 + 10)
    ip.run_cell(imports() + ROWS)
    with LiveArrays() as checked:
        report = train(ip, cell)
    assert "the same as on one device (distributed vs one device" in report.summary(), \
        report.summary()
    assert len(ran) == 1 and ran[0] is not None, ran
    staged = 2 * report.execution.k * 256 * (512 + 1) * 4
    assert checked.peak <= plain.peak + staged + 0.1 * state, \
        (checked.peak, plain.peak, report.execution.k)


# a frozen base (4.2 MB) under a small trainable head, as a LoRA fine-tune has: the check's
# one-device step reads the base from the model's own buffers on the first device
FROZEN = """
keras.utils.set_random_seed(6)
base = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                         keras.layers.Dense(512, activation="relu")])
base.trainable = False
tuned = keras.Sequential([base, keras.layers.Dense(10)])
tuned.compile(keras.optimizers.Adam(1e-3),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = tuned.fit(rows, labels, batch_size=512, epochs=1, verbose=0)
"""


def test_the_checks_step_holds_no_second_copy_of_a_frozen_base(ip):
    # Its step returned every non-trainable value, and a frozen layer's weights came back
    # as new buffers: a second copy of the whole base on that device (the small Gemma LoRA
    # cell on 8 devices: 1.72x plain Keras's peak); now it returns nothing for them
    from support.same import imports, plainly

    with LiveArrays() as plain:
        plainly(ROWS, FROZEN, data_parallel=True)
    frozen = 4 * (512 * 1024 + 1024 + 1024 * 512 + 512)
    head = 3 * 4 * (512 * 10 + 10)  # its weights and Adam's two slots
    assert plain.peak > 8 * frozen, (plain.peak, frozen)
    ip.run_cell(imports() + ROWS)
    with LiveArrays() as checked:
        report = train(ip, FROZEN)
    assert "the same as on one device (distributed vs one device" in report.summary(), \
        report.summary()
    staged = 2 * report.execution.k * 512 * (512 + 1) * 4
    assert checked.peak <= plain.peak + head + staged + 0.25 * frozen, \
        (checked.peak, plain.peak, report.execution.k)


# activations dwarf the state: 8,192 rows through two layers of 512 (the state 4.8 MB, the
# step's temporaries for the whole batch on one device 84 MB, a device's share 10.5 MB;
# XLA:CPU reports next to none under 1,024 rows)
ACTIVE = """
many = np.random.RandomState(2).rand(16384, 512).astype("float32")
kinds = np.random.RandomState(3).randint(0, 10, 16384)
keras.utils.set_random_seed(7)
deep = keras.Sequential([keras.Input((512,)), keras.layers.Dense(512, activation="relu"),
                         keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
deep.compile(keras.optimizers.Adam(1e-3),
             keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = deep.fit(many, kinds, batch_size=8192, epochs=1, verbose=0)
"""


def test_the_checks_step_holds_a_devices_share_of_the_activations_not_the_whole_batchs(ip):
    # The check ran the global batch on one device: on 8 chips, 8 times a device's
    # activations beside the model's state there, so a step the memory plan fits to a
    # device split could not be checked (out of memory). Now its step runs the batch as
    # the devices' shares, micro-batches with the whole batch's numbers
    import jax
    from support.same import imports
    from tpu_magic.core import record

    ip.run_cell(imports() + ROWS)
    report = train(ip, ACTIVE)
    assert "the same as on one device (distributed vs one device" in report.summary(), \
        report.summary()
    deep = ip.user_ns["deep"]
    state = tuple([v.value for v in group] for group in (
        deep.trainable_variables, deep.non_trainable_variables,
        deep.optimizer.variables, deep.metrics_variables))
    rows, labels = ip.user_ns["many"], ip.user_ns["kinds"].astype("int32")

    def temporaries(n):  # plain Keras's step on one device for n rows
        compiled = jax.jit(deep.train_step).lower(state, (rows[:n], labels[:n])).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole, share = temporaries(8192), temporaries(1024)
    assert whole > 4 * share, (whole, share)
    weights = 4 * sum(int(np.prod(v.shape)) for v in deep.trainable_variables)
    checks = [found.memory_analysis().temp_size_in_bytes
              for found in record.of(deep).reference._compiled.values()]
    assert checks, "the check's step was not compiled ahead"
    # a device's share, beside the gradients it adds up over the shares, one share's, the
    # optimizer's update and (returning its update's sizes, not a state written over the
    # one it was given) the new weights it measures (the whole batch's were 8 times the share)
    assert all(temp <= share + 5 * weights for temp in checks), (checks, share, whole)


LORA_LM = """
import keras_hub
rs = np.random.RandomState(3)
ids = rs.randint(1, 1024, (48, 17))
lm_x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((48, 16), bool)}
lm_y = ids[:, 1:]
keras.utils.set_random_seed(4)
backbone = keras_hub.models.GemmaBackbone(vocabulary_size=1024, num_layers=2,
    num_query_heads=4, num_key_value_heads=1, hidden_dim=32, intermediate_dim=48, head_dim=8)
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
backbone.enable_lora(rank=4)
lm.compile(optimizer=keras.optimizers.Adam(1e-3),
           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
           weighted_metrics=["accuracy"])
lm.fit(lm_x, lm_y, batch_size=8, epochs=1, verbose=0)
"""


def test_the_checks_step_compiles_beside_the_memory_plans_and_not_again_where_it_agreed(
        ip, monkeypatch):
    # KerasHub's task makes a grain dataset of the arrays itself, which Keras reads only
    # after the first step's hook. The check's one-device step was compiled after that
    # step, on the critical path, then beside the steps (on a CPU, competing with them:
    # the small Gemma on 8 devices, 9 s beside the fit against 1.9 s for the distributed
    # step alone). Now it starts from the plan's first batch before the memory plan
    # compiles the distributed step, the two compiles side by side; and the same cell run
    # again, its setup agreed, compiles no one-device step (it did: the check learnt the
    # setup only after the first step, for an input Keras reads itself)
    from tpu_magic.backends.jax import parity
    from tpu_magic.backends.jax.loop import programs

    events = []
    ahead, plan = parity.one_device_ahead, programs.Programs.abstract_train

    def spied(model, batch, *parts):
        events.append(("check", [np.shape(a) for a in jax_leaves(batch)]))
        return ahead(model, batch, *parts)

    def planned(self, *args, **kwargs):
        events.append(("plan", None))
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(parity, "one_device_ahead", spied)
    monkeypatch.setattr(programs.Programs, "abstract_train", planned)
    with logged_compiles() as compiles:
        report = train(ip, LORA_LM)
    assert report.parity is not None and report.parity.update_difference is not None, \
        report.parity
    # before the plan, from the first batch's shapes: token ids, padding mask and targets
    assert [kind for kind, _ in events[:2]] == ["check", "plan"], events
    assert len(events[0][1]) >= 3 and all(shape == (8, 16) for shape in events[0][1]), events
    # the distributed step (the plan's, run by the fit) and the one-device step, once each
    assert [name for name, _ in compiles.found].count("train_step") == 2, compiles.found
    with logged_compiles() as again:
        report = train(ip, LORA_LM)
    assert report.parity is not None and "agreed" in report.parity.why, report.parity
    assert [name for name, _ in again.found].count("train_step") <= 1, again.found


@contextlib.contextmanager
def logged_compiles():
    """JAX's log of the programs compiled inside, as `Compiles`."""
    import jax

    compiles = Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(compiles)
    jax.config.update("jax_log_compiles", True)
    try:
        yield compiles
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(compiles)


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_the_check_compares_once_its_step_has_compiled_while_the_fit_goes_on(ip, monkeypatch):
    # The memory plan compiles the distributed step before the fit, so its first step is
    # quick, and a check that waited there for its own one-device compile put that compile
    # on the cell's critical path (the tutorials' CNN on 8 devices: 1.2 of its 1.6 s). Here
    # that compile cannot end before the fit's fourth batch: the first step is still the one
    # compared, and the fit went on meanwhile (waiting, it would hold the fit at its first
    # batch and the compile would never see the fourth).
    from tpu_magic.backends.jax import parity

    fourth, waited = threading.Event(), []
    beside = parity.Beside

    def late(model, work):
        def after_the_fourth_batch():
            waited.append(fourth.wait(30))
            return work()

        return beside(model, after_the_fourth_batch)

    monkeypatch.setattr(parity, "Beside", late)
    ip.run_cell(SETUP)
    ip.user_ns["fourth"] = fourth
    # a model of its own: a setup that agreed earlier in the session is not checked again
    cell = CELL.replace("Dense(32", "Dense(24").replace(
        "verbose=0)", "verbose=0, callbacks=[keras.callbacks.LambdaCallback("
                                      "on_train_batch_end=lambda b, logs: b >= 3 and "
                                      "fourth.set())])")
    report = train(ip, cell)
    assert waited == [True]
    assert report.parity is not None and report.parity.agrees, report.parity
    assert report.parity.steps == 1 and report.history.history["loss"], report.parity
