"""Random argument strings for every magic: the only outcomes are success or a `UsageError`.

Hypothesis builds lines from the magics' own flags, numbers (huge, negative, NaN),
quotes and random words. Calls that would need a real TPU or the network (probing a
TPU name or a remote host) are replaced by a fake that says no TPU answers; random
paths stay relative, inside a temporary working directory.
"""

import os
import re

import numpy as np
import pytest
from support.cells import train
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import tpu_magic
from tpu_magic.connecting import connect as connect_module
from tpu_magic.core.errors import ConnectError

NUMBERS = st.one_of(st.integers(-3, 3), st.integers(-(10**12), 10**12),
                    st.sampled_from(["8", "0", "-1", "1e9", "nan", "inf", "-inf", "0.001", "1e-300",
                                     "9" * 30, "0x10"]))
WORDS = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\~\x00"),
                max_size=12)
QUOTING = st.sampled_from(['"', "'", '"a b"', "'unclosed", "--", "-", "=", "--=", "{x}", "$y"])


def lines(flags):
    """Half the lines are the magic's own flags in any order (mostly valid), half anything."""
    token = st.one_of(st.sampled_from(flags), NUMBERS.map(str), WORDS, QUOTING)
    return st.one_of(st.lists(st.sampled_from(flags), max_size=4).map(" ".join),
                     st.lists(token, max_size=6).map(" ".join))


FUZZ = settings(max_examples=int(os.environ.get("TPU_MAGIC_FUZZ_EXAMPLES", 40)), deadline=None,
                derandomize="TPU_MAGIC_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def succeeds_or_usage_error(run):
    try:
        run()
    except UsageError as exc:
        assert str(exc), "a UsageError says what was wrong"
        event("UsageError")  # --hypothesis-show-statistics shows how often each outcome came
    else:
        event("success")


@pytest.fixture
def no_tpu_anywhere(monkeypatch):
    """Probing a TPU (a name, a remote host) would use the network: no TPU answers."""
    def no_answer(chosen, timeout, probe_tf):
        raise ConnectError(f"(test) nothing answers at {chosen.address}")

    monkeypatch.setattr(connect_module, "_probe_node", no_answer)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("in the way")
    return tmp_path


@FUZZ
@given(line=lines(["auto", "cpu", "gpu", "local", "my-tpu", "grpc://127.0.0.1:1", "grpc://",
                   "--simulate", "--simulate 8", "--timeout", "--timeout 0.5", "--check",
                   "--no-panel", "-h", "--bogus"]))
def test_tpu_connect_with_any_line(sim8, no_tpu_anywhere, line):
    succeeds_or_usage_error(lambda: sim8.run_line_magic("tpu_connect", line))
    assert tpu_magic.session() is not None  # a failed connect keeps the session it had


TRAIN_CELL = """
fz.fit(xs, ys, batch_size=16, epochs=1, verbose=0)
fz.predict(xs, verbose=0)
"""


@FUZZ
@given(line=lines(["--batch-size", "--batch-size 8", "--epochs", "--scale-lr",
                   "--steps-per-execution", "--checkpoint", "--checkpoint ckpt",
                   "--checkpoint a_file/ckpt", "--keep", "--keep 0", "--resume", "--no-progress",
                   "--help"]))
def test_tpu_train_with_any_line(sim8, in_tmp, line):
    sim8.run_cell("""
import keras, numpy as np
xs = np.random.rand(20, 4).astype("float32"); ys = np.random.rand(20, 1).astype("float32")
fz = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
fz.compile("sgd", "mse")
""")
    succeeds_or_usage_error(lambda: sim8.run_cell_magic("tpu_train", line, TRAIN_CELL))


@FUZZ
@given(line=lines(["fz", "fz_cpu", "missing", "--as", "--as copy", "--as 1bad", "--as class",
                   "--save", "--save w", "--save a_file/w", "--save .weights.h5"]))
def test_tpu_sync_with_any_line(digits, in_tmp, line):
    if "fz" not in digits.user_ns:
        train(digits, """
fz = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
fz.compile("sgd", "mse")
fz.fit(x[:32], np.eye(10)[y[:32]], batch_size=16, verbose=0)
""")
    succeeds_or_usage_error(lambda: digits.run_line_magic("tpu_sync", line))


def test_a_cell_with_no_model_runs_and_reports_nothing_trained(sim8, capsys):
    report = train(sim8, "total = sum(range(10))")
    assert sim8.user_ns["total"] == 45
    assert report.fits == 0 and report.model_name is None
    with pytest.raises(UsageError, match="nothing trained yet"):
        sim8.run_line_magic("tpu_sync", "")


# -- inputs that do not agree, no inputs, cells as people write them -------------------------

@pytest.mark.parametrize("call, named", [
    ("model.fit(x[:200], y[:256], batch_size=64)", ["x has 200", "y has 256"]),
    ("model.fit(x[:200], y[:100], batch_size=64)", ["x has 200", "y has 100"]),
    ("model.fit(x[:64], y[:64], sample_weight=np.ones(60), batch_size=64)",
     ["x has 64", "y has 64", "sample_weight has 60"]),
    ("model.fit(x[:64], y[:64], batch_size=64, validation_data=(x[:64], y[:32]))",
     ["fit's validation_data", "x has 64", "y has 32"]),
    ("model.evaluate(x[:64], y[:65])", ["evaluate", "x has 64", "y has 65"]),
    ("two.fit([x[:200], x[:256]], y[:200], batch_size=64)", ["x[0] has 200", "x[1] has 256"]),
])
def test_arrays_of_different_lengths_are_refused_before_anything_trains(digits, call, named):
    from support.cells import DENSE

    train(digits, DENSE + """
a, b = keras.Input((64,)), keras.Input((64,))
two = keras.Model([a, b], keras.layers.Dense(10, activation="softmax")(keras.layers.Add()([a, b])))
two.compile("sgd", "sparse_categorical_crossentropy")
two.fit([x[:64], x[:64]], y[:64], batch_size=64, verbose=0)
""")
    model = digits.user_ns["two" if call.startswith("two") else "model"]
    before = [w.copy() for w in model.get_weights()]
    steps = int(model.optimizer.iterations.numpy())
    with pytest.raises(UsageError, match="different lengths") as error:
        train(digits, call)
    for words in named:
        assert words in str(error.value)
    assert "Data cardinality is ambiguous" in str(error.value)
    assert int(model.optimizer.iterations.numpy()) == steps
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))


@pytest.mark.parametrize("call", ["model.fit(x[:0], y[:0], batch_size=64)",
                                  "model.evaluate(x[:0], y[:0])"])
def test_no_samples_to_fit_or_evaluate_is_a_usage_error(digits, call):
    from support.cells import DENSE

    train(digits, DENSE)
    with pytest.raises(UsageError, match="got 0 samples .*check the slice"):
        train(digits, call)


def test_predict_of_no_samples_returns_no_rows(digits):
    from support.cells import DENSE

    train(digits, DENSE + "out = model.predict(x[:0])")
    assert digits.user_ns["out"].shape == (0, 10)


def test_a_cells_own_error_shows_its_line_and_no_tpu_magic_frames(digits):
    from IPython.utils.capture import capture_output

    cell = "%%tpu_train --no-progress\nfirst = 1\nsecond = 2\nraise ValueError('my own mistake')\n"
    with capture_output() as shown, pytest.raises(ValueError, match="my own mistake"):
        digits.run_cell(cell)
    assert "raise ValueError('my own mistake')" in plain(shown.stdout)  # the source line, not "<string>"
    assert "Could not get source" not in plain(shown.stdout)
    assert "tpu_magic/" not in plain(shown.stdout)


def test_shell_and_magic_lines_in_a_cell_do_not_hide_the_model_it_names(digits):
    from support.cells import DENSE

    digits.run_cell(DENSE)  # built outside the strategy: the cell must name it to rewrap it
    report = train(digits, "!echo hello from the shell\n"
                           "%time model.fit(x[:64], y[:64], batch_size=64, verbose=0)\n")
    assert report.fits == 1 and report.rewrapped == ("model",)


def plain(text):
    """Terminal output without its colour codes."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


# -- help that teaches -------------------------------------------------------------------------

@pytest.mark.parametrize("lookup", ["%%tpu_train?", "%tpu_train?", "%tpu_connect?", "%tpu_sync?"])
def test_every_help_lookup_shows_usage_and_an_example(ip, lookup):
    from IPython.utils.capture import capture_output

    with capture_output() as shown:
        ip.run_cell(lookup)
    text = plain(shown.stdout)
    assert "Object `" not in text and "not found" not in text
    name = lookup.strip("%?")
    assert "Examples" in text and f"%{name} [--" in text  # the usage line, then an example
    if "tpu_train" in lookup:
        assert "--batch-size" in text and "%%tpu_train --epochs 5" in text


def test_tpu_train_typed_as_a_line_magic_says_where_it_goes(ip):
    with pytest.raises(UsageError, match=r"%%tpu_train is a cell magic: put `%%tpu_train "
                                         r"\[flags\]` on the first line of the cell"):
        ip.run_line_magic("tpu_train", "--epochs 1")


@pytest.mark.parametrize("magic, line, hint", [
    ("tpu_train", "--batchsize 64", "--batchsize: did you mean --batch-size?"),
    ("tpu_train", "--epoch 2 --checkpiont d", "--checkpiont: did you mean --checkpoint?"),
    ("tpu_connect", "--simlate 8", "--simlate: did you mean --simulate?"),
    ("tpu_sync", "--svae w.weights.h5", "--svae: did you mean --save?"),
])
def test_a_mistyped_flag_gets_the_nearest_one(sim8, magic, line, hint):
    with pytest.raises(UsageError) as error:
        if magic == "tpu_train":
            sim8.run_cell_magic(magic, line, "ran = True")
        else:
            sim8.run_line_magic(magic, line)
    assert hint in str(error.value) and "for every flag and an example" in str(error.value)
    assert "ran" not in sim8.user_ns


@pytest.mark.parametrize("line, words", [
    ("--shard model", "--shard model needs Keras on JAX: .*`%tpu_connect --backend jax`"),
    ("--mesh 2x4", "--shard model needs Keras on JAX"),
    ("--shard model --mesh 3x3", "3×3 is not the 8 devices here; use one of 8x1, 4x2, 2x4, 1x8"),
    ("--shard data --mesh 2x4", "--mesh 2x4 lays out the model over its columns"),
    ("--shard pipeline", "--shard 'pipeline': use data"),
])
def test_shard_flags_on_tensorflow_are_refused_before_the_cell_runs(sim8, line, words):
    sim8.user_ns.pop("ran", None)
    with pytest.raises(UsageError, match=words):
        sim8.run_cell_magic("tpu_train", line, "ran = True")
    assert "ran" not in sim8.user_ns


def test_shard_auto_on_tensorflow_says_it_trains_data_parallel(digits):
    """`--shard auto` is not refused on TensorFlow (data parallel is a fine answer), but
    the report says that is what it chose and why, rather than ignoring the flag."""
    from support.cells import DENSE

    report = train(digits, DENSE + "model.fit(x[:256], y[:256], batch_size=64, verbose=0)",
                   "--no-progress --shard auto")
    assert report.memory_plan == ("--shard auto: data parallel (MirroredStrategy); Keras on "
                                  "this backend plans no memory and lays out no model "
                                  "columns: that needs Keras on JAX")
    assert report.memory_plan in str(report)


def test_a_magic_line_with_a_trailing_comment_works_as_in_python(sim8):
    result = sim8.run_line_magic("tpu_connect", "--simulate 8 --no-panel   # rehearse a v2-8")
    assert result.replicas == 8
    with pytest.raises(UsageError, match="could not read its arguments"):
        sim8.run_line_magic("tpu_connect", "'unbalanced # not a comment")


def test_an_error_in_a_training_cell_names_that_cell(sim8, capsys):
    # issue 34: IPython counts the next cell up before it runs one, and the traceback named
    # the cell after the one that failed (In[3] shown as Cell In[4])
    number = sim8.execution_count
    with pytest.raises(ZeroDivisionError):
        sim8.run_cell("%%tpu_train --no-progress\nfine = 1\nbroken = 1 / 0\n", store_history=True)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # the colours off
    assert f"Cell In[{number}], line 2" in shown, shown
    assert f"Cell In[{number + 1}]" not in shown
