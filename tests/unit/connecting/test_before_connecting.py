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

    from tpu_magic.backends.jax.connect import _native_stderr_kept

    with _native_stderr_kept() as said:
        os.write(2, b"E0000 could not determine TPU accelerator type\n=== Source Location Trace\n")
    os.write(2, b"after\n")
    assert said() == "=== Source Location Trace"
    assert capfd.readouterr().err == "after\n"


class _JaxStartedWith:
    """JAX as a failed TPU probe leaves it: started, its CPU split into `n` devices."""

    def __init__(self, n):
        self.n = n

    def devices(self, kind):
        return [object()] * self.n


def test_after_a_failed_tpu_probe_the_rehearsal_advice_is_a_line_that_works_next():
    # issue 34: the advice was `%tpu_connect --simulate 8`, which then failed ("JAX already
    # started with 1") and dropped --backend jax
    from tpu_magic.backends.jax.connect import _rehearsal_from_here
    from tpu_magic.core.target import no_tpu_fix

    fix = no_tpu_fix({"COLAB_RELEASE_TAG": "x"}, _rehearsal_from_here(_JaxStartedWith(1)))
    assert "`%tpu_connect --simulate 8`" not in fix
    assert ("To rehearse without a TPU: restart the runtime (JAX started here with 1 CPU "
            "device, and it splits the CPU only once), then `%tpu_connect --backend jax "
            "--simulate 8` before anything uses JAX.") in fix
    ready = no_tpu_fix({}, _rehearsal_from_here(_JaxStartedWith(8)))
    assert ready.endswith("To rehearse without a TPU: `%tpu_connect --backend jax --simulate 8`.")
