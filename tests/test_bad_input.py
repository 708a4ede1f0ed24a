"""Random argument strings for every magic: the only outcomes are success or a `UsageError`.

Hypothesis builds lines from the magics' own flags, numbers (huge, negative, NaN),
quotes and random words. Calls that would need a real TPU or the network (probing a
TPU name or a remote host) are replaced by a fake that says no TPU answers; random
paths stay relative, inside a temporary working directory.
"""

import os

import pytest
from cells import train
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import tpu_magic
from tpu_magic import connect as connect_module
from tpu_magic.errors import ConnectError

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
