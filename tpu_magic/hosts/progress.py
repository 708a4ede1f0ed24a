"""One live progress bar in the notebook, fed by process 0 of several hosts, and the watch
for a host that holds the others up.

On an engine, `PublishedBar` stands in for tqdm (the cell's `FitProgress` draws on it as on
any bar; every engine draws, even under --no-progress) and publishes its state with
ipyparallel's own data channel (`publish_data`); in the notebook, `MirroredBars` draws the
same bars with a real tqdm class from what process 0 published last, and `StallWatch` reads
what every engine published to find a host the others wait for.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any, Callable, Iterator, Sequence

PUBLISH_EVERY = 0.25  # seconds between an engine's updates (closing and resetting always go)
# The batch bar's name until a fit's first step ends: training.fit.progress.COMPILING, written
# out so that the notebook's process need not import Keras (a unit test keeps them equal).
COMPILING = "compiling…"
_ids = itertools.count()
_state: dict[int, dict] = {}  # this engine's bars of its cell (it runs one at a time)
_where: dict[str, Any] = {"calls": 0, "inside": None}  # Keras calls begun; the one running
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
        _publish(force)


def _publish(force: bool = False) -> None:
    """This engine's bars and where its cell is, to the notebook (at most every
    PUBLISH_EVERY seconds unless `force`)."""
    now = time.monotonic()
    if force or now - _last[0] >= PUBLISH_EVERY:
        _last[0] = now
        from ipyparallel.datapub import publish_data

        publish_data({"bars": dict(_state), **_where, "time": time.time()})


def start_cell() -> None:
    """Forgets the bars of the engine's previous cell (a cell's closed bars stay published
    until the next: the notebook may look only after they closed)."""
    _state.clear()
    _where.update(calls=0, inside=None)


@contextlib.contextmanager
def in_call(name: str) -> Iterator[None]:
    """Around each Keras call of the cell (`TrainingCell`'s `watch`): the notebook learns
    that this engine entered it, and left it, at once (`StallWatch`)."""
    _where.update(calls=_where["calls"] + 1, inside=name)
    _publish(force=True)
    try:
        yield
    finally:
        _where["inside"] = None
        _publish(force=True)


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


class StallWatch:
    """Finds the hosts that hold the others up: `timeout` seconds in which no engine published
    anything new while some are inside a Keras call of the cell (`fit`, `evaluate`,
    `predict`: from there on they wait in collectives for the rest). Not while every host
    runs the cell's own code outside those calls (a download, a model being built), nor
    while every host compiles a first step (minutes on a big model)."""

    def __init__(self, hosts: int, timeout: float, now: float):
        self.timeout = timeout
        self.seen: list[Any] = [None] * hosts
        self.changed = now

    def stuck(self, published: Sequence[Any], now: float) -> list[int]:
        """Indexes of the hosts to name (empty: none is stuck). `published`: each engine's
        last published data, in the hosts' order."""
        states = [p if isinstance(p, dict) else {} for p in published]
        stamps = [state.get("time") for state in states]
        if stamps != self.seen:
            self.seen, self.changed = stamps, now
            return []
        if now - self.changed < self.timeout:
            return []
        inside = [state.get("inside") is not None for state in states]
        if not any(inside):
            return []
        bars = [[bar for _, bar in sorted(state.get("bars", {}).items()) if not bar["closed"]]
                for state in states]
        if all(any(bar["desc"] == COMPILING for bar in open_bars) for open_bars in bars):
            return []
        # how far each got: calls begun, then done with it or not, then epoch and batch
        where = [(state.get("calls", 0), not within, *(bar["n"] for bar in open_bars))
                 for state, within, open_bars in zip(states, inside, bars)]
        return [i for i, at in enumerate(where) if at == min(where)]
