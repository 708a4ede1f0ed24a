"""Pay once (issue 57): a fresh model's first fit compiles exactly the programs it runs, each
once. The memory plan compiles the train step from abstract inputs and the fit runs that
executable; K is chosen from the steps that train and its group compiled once (on a thread
of its own); the first-step check's one-device step once. Counted from JAX's own log of
its compiles (`jax_log_compiles`), by program and argument types."""

import logging
import re

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
