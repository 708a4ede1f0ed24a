"""A `%%tpu_train` cell's code, compiled and run as IPython runs a cell: `!cmd` and `%magic`
lines made Python, compiled under IPython's cache name (a traceback shows the cell's own
lines), executed in the user's namespace, and Ctrl-C's traceback ending at the cell's line.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def cell_work(shell: Any, cell: str) -> Iterator[Any]:
    """The cell as a `training.cell.CellCode`, compiled; an interrupt raised while the block
    runs keeps only the traceback's frames down to the cell's line."""
    from tpu_magic.training.cell import CellCode

    code = shell.transform_cell(cell)  # names are then read from this code
    filename = shell.compile.cache(code, running_cell_number(shell), raw_code=cell)
    compiled = shell.compile(code, filename, "exec")

    def execute() -> None:
        __tracebackhide__ = True  # noqa: F841
        # The cell's own exceptions reach the user unchanged (run_cell swallows them).
        exec(compiled, shell.user_global_ns, shell.user_ns)

    try:
        yield CellCode(execute, code)
    except KeyboardInterrupt as exc:
        # Ctrl-C ended the cell as it ends any cell; the traceback ends at the cell's line.
        raise exc.with_traceback(ending_in(exc.__traceback__, filename)) from None


def ending_in(traceback: Any, filename: str) -> Any:
    """`traceback` cut after its last frame in `filename` (the cell), where it has one."""
    last, entry = None, traceback
    while entry is not None:
        if entry.tb_frame.f_code.co_filename == filename:
            last = entry
        entry = entry.tb_next
    if last is not None:
        last.tb_next = None
    return traceback


def running_cell_number(shell: Any) -> int:
    """The number of the cell running now, as its `In[N]`: IPython counts the next cell up
    before it runs one, so its own count is one ahead (`run_cell_magic` called outside a
    cell has no running cell: the count as it is)."""
    running = getattr(shell.displayhook, "exec_result", None)
    number = getattr(running, "execution_count", None)
    return shell.execution_count if number is None else number
