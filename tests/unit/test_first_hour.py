"""The first minutes in a notebook, without TensorFlow, Keras or JAX imported: what can be
answered at once is answered at once (this suite fails if anything heavy was imported)."""

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "tpu_magic")
    return ip


def test_sync_with_nothing_trained_answers_without_importing_a_framework(shell):
    with pytest.raises(UsageError, match="nothing trained yet: run a %%tpu_train cell"):
        shell.run_line_magic("tpu_sync", "")
    shell.user_ns["not_a_model"] = 3
    with pytest.raises(UsageError, match="'not_a_model' is a int, not a Keras model"):
        shell.run_line_magic("tpu_sync", "not_a_model")


@pytest.mark.parametrize("env, menu", [
    ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "Settings > Accelerator > TPU VM v5e-8"),
    ({"COLAB_RELEASE_TAG": "x"}, "Runtime > Change runtime type > a TPU"),
    ({}, "In Colab: Runtime > Change runtime type"),
])
def test_no_tpu_names_the_platforms_own_menu(env, menu):
    from tpu_magic.core.target import no_tpu_fix

    text = no_tpu_fix(env)
    assert text.startswith("No TPU is attached") and menu in text
    if env:  # one platform's menu, not the other's
        assert ("Kaggle" in text) != ("Colab" in text)


def test_a_runtimes_own_stderr_stays_out_of_the_cell(capfd):
    import os

    from tpu_magic.backends.jax import _native_stderr_kept

    with _native_stderr_kept() as said:
        os.write(2, b"E0000 could not determine TPU accelerator type\n=== Source Location Trace\n")
    os.write(2, b"after\n")
    assert said() == "=== Source Location Trace"
    assert capfd.readouterr().err == "after\n"
