"""What each host's run of a cell came to, and one message for all of them: each distinct
error once, with the hosts it happened on and the cell's own line (not folded, as
ipyparallel's `CompositeError` would). Pure: no engines here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HostOutcome:
    """One host's run of a cell (what `engine.run_cell` returns).

    Attributes:
        index: the process index (0 leads: its report and progress are the notebook's).
        host: the host's name.
        error: the exception's type and message (None: the cell ran).
        line: the cell's line the error came through (1 = the first line below the magic),
            and its text; None where it came from tpu_magic's checks.
        report: the cell's `TrainReport` (process 0's is the one shown).
        model_name: the model the cell trained last, for `%tpu_sync`.
    """

    index: int
    host: str
    error: tuple[str, str] | None = None
    line: tuple[int, str] | None = None
    report: Any = None
    model_name: str | None = None
    output: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        return f"host {self.index} ({self.host})"


def failure_message(outcomes: list[HostOutcome]) -> str | None:
    """Each distinct error once, naming its hosts and the cell's line; None if none failed."""
    groups: dict[tuple, list[HostOutcome]] = {}
    for outcome in sorted(outcomes, key=lambda o: o.index):
        if outcome.error is not None:
            groups.setdefault((outcome.error, outcome.line), []).append(outcome)
    if not groups:
        return None
    parts = []
    for ((kind, message), line), hosts in groups.items():
        where = (f"line {line[0]} of the cell, `{line[1].strip()}`: " if line else "")
        names = ", ".join(o.label for o in hosts)
        every = " (every host)" if len(hosts) == len(outcomes) and len(outcomes) > 1 else ""
        said = message if kind == "UsageError" else f"{kind}: {message}"  # ours speak plainly
        parts.append(f"{names}{every}: {where}{said}")
    return "the cell failed on " + "; and on ".join(parts)
