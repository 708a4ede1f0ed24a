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
