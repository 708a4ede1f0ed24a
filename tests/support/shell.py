"""The shell the tests drive: a real InteractiveShell whose `run_cell` re-raises the cell's error."""

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config


class TestingShell(InteractiveShell):
    """A real shell whose `run_cell` re-raises the cell's error (as JupySQL's does)."""

    def run_cell(self, *args, **kwargs):
        result = super().run_cell(*args, **kwargs)
        result.raise_error()
        return result


def testing_shell() -> TestingShell:
    """The process's shell, history off, with tpu_magic loaded."""
    config = Config()
    config.HistoryManager.enabled = False
    shell = TestingShell.instance(config=config)
    shell.run_line_magic("load_ext", "tpu_magic")
    return shell
