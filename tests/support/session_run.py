"""A notebook session in a process of its own: each argument is a cell, run in order by a
plain IPython shell (history off), as a user runs them; what the user would see (stdout
and stderr, tracebacks included) goes to stdout. The caller sets the environment (HOME,
KERAS_HOME, TensorFlow blocked, ...): `python tests/support/session_run.py CELL ...`."""

import sys

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config


def main(cells: list[str]) -> int:
    sys.stderr = sys.stdout  # one stream, in the order the user sees it
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    failed = 0
    for cell in cells:
        print(f"--- cell: {cell.splitlines()[0] if cell else ''}", flush=True)
        result = shell.run_cell(cell, store_history=False)
        failed += not result.success
        sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
