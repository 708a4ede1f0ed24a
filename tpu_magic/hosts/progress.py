"""One live progress bar in the notebook, fed by process 0 of several hosts.

On an engine, `PublishedBar` stands in for tqdm (the cell's `FitProgress` draws on it as on
any bar) and publishes its state with ipyparallel's own data channel (`publish_data`);
in the notebook, `MirroredBars` draws the same bars with a real tqdm class from what
process 0 published last.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

PUBLISH_EVERY = 0.25  # seconds between an engine's updates (closing and resetting always go)
_ids = itertools.count()
_state: dict[int, dict] = {}  # this engine's bars of its cell (it runs one at a time)
_last = [0.0]


class PublishedBar:
    """A tqdm-like bar whose state goes to the notebook (see the module)."""

    def __init__(self, total: Any = None, desc: str = "", unit: str = "it", **_: Any):
        self.id, self.total, self.desc, self.unit = next(_ids), total, desc, unit
        self.n, self.postfix, self.closed = 0, {}, False
        self._publish(force=True)

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        self.desc = desc
        self._publish()

    def reset(self, total: Any = None) -> None:
        self.n, self.total = 0, total
        self._publish(force=True)

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = {**dict(ordered_dict or {}), **kwargs}
        self._publish()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._publish()

    def refresh(self) -> None:
        self._publish()

    def close(self) -> None:
        self.closed = True
        self._publish(force=True)

    def _publish(self, force: bool = False) -> None:
        _state[self.id] = {"total": self.total, "desc": self.desc, "unit": self.unit,
                           "n": self.n, "postfix": {k: str(v) for k, v in self.postfix.items()},
                           "closed": self.closed}
        now = time.monotonic()
        if force or now - _last[0] >= PUBLISH_EVERY:
            _last[0] = now
            from ipyparallel.datapub import publish_data

            publish_data({"bars": dict(_state), "time": time.time()})


def start_cell() -> None:
    """Forgets the bars of the engine's previous cell (a cell's closed bars stay published
    until the next: the notebook may look only after they closed)."""
    _state.clear()


class MirroredBars:
    """The notebook's bars, drawn from what an engine published (`show`)."""

    def __init__(self, bar_class: Callable[..., Any] | None):
        self.bar_class = bar_class
        self.bars: dict[int, Any] = {}
        self.done: set[int] = set()

    def show(self, published: Any) -> None:
        if self.bar_class is None or not isinstance(published, dict):
            return
        for key, state in sorted(published.get("bars", {}).items()):
            if key in self.done:
                continue
            bar = self.bars.get(key)
            if bar is None:
                bar = self.bars[key] = self.bar_class(total=state["total"], desc=state["desc"],
                                                      unit=state["unit"])
            if bar.total != state["total"]:
                bar.reset(total=state["total"])
            bar.set_description(state["desc"], refresh=False)
            bar.set_postfix(state["postfix"], refresh=False)
            bar.update(state["n"] - bar.n)
            if state["closed"]:
                bar.close()
                self.done.add(key)

    def close(self) -> None:
        for key, bar in self.bars.items():
            if key not in self.done:
                bar.close()
