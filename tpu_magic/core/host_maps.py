"""The process's memory maps, kept clear of the system's limit before a fit compiles.

XLA:CPU keeps each compiled program's code in memory maps of its own, released only with
the program, and a process at Linux's `vm.max_map_count` cannot map the next program's
code: XLA cannot allocate it and the process (the notebook's kernel) dies of a
segmentation fault (docs/limits.md). Two things keep maps that nothing uses: a model no
longer referenced keeps its programs until Python's cycle collector frees it (a model, its
layers, Keras's traced functions and tpu_magic's record of it are reference cycles, and the
collector's oldest generation runs seldom when the objects are few and large); and JAX
keeps an executable for every op it ran eagerly at every new shape, for good, in plain
Keras as under tpu_magic, which compiles more programs a model besides.

`relieve(release)`, before each fit: past half the limit it collects (the unreferenced
models' programs freed); still past it, `release` (the backend's `release_compiled`) lets
the framework's kept programs go (they compile again where they run again, or load from
the compile cache) and it collects again. It returns what it found; `MapRelief.warning`
says so when the maps stay high after, what still holds them being the user's live models.
Nothing happens where the process has no `/proc` (not Linux): the limit is Linux's.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

PROC_MAPS = "/proc/self/maps"
MAX_MAPS = "/proc/sys/vm/max_map_count"
# Past this share of the limit a fit collects first: a collection is not free in a large
# session, and half the limit leaves room for a large model's fit, which maps thousands
COLLECT_AT = 0.5
# Still past this share after collecting: the user's live models hold them; said
WARN_AT = 0.8


@dataclass(frozen=True)
class MapUse:
    """Memory maps in use by this process, against the system's limit."""

    count: int
    limit: int

    @property
    def share(self) -> float:
        return self.count / self.limit if self.limit > 0 else 0.0


@dataclass(frozen=True)
class MapRelief:
    """A collection made for the maps: their use before and after it."""

    before: MapUse
    after: MapUse
    released: bool = False  # the framework's own compiled programs let go too

    def warning(self) -> str | None:
        """What to tell the user where collecting left the maps near the limit."""
        if self.after.share < WARN_AT:
            return None
        return (f"this process holds {self.after.count:,} of the {self.after.limit:,} memory "
                f"maps Linux allows it (vm.max_map_count), most of them compiled programs of "
                f"the models still referenced; a compile past the limit crashes the kernel: "
                f"delete the models you no longer need (del model) or restart the kernel")


def map_use(maps: str = PROC_MAPS, limit: str = MAX_MAPS) -> MapUse | None:
    """This process's maps and the limit, or None where either cannot be read."""
    try:
        with open(maps, "rb") as lines:
            count = lines.read().count(b"\n")
        with open(limit) as text:
            most = int(text.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return MapUse(count, most)


def relieve(release: Callable[[], None] = lambda: None,
            read: Callable[[], MapUse | None] = map_use) -> MapRelief | None:
    """Past `COLLECT_AT` of the limit, Python's cycle collector run (the unreferenced models'
    compiled programs freed with them), and where the maps stay past it, `release` (the
    backend's `release_compiled`: the programs its framework keeps for every op it ran)
    and a collection again. Returns the maps before and after, or None where nothing was
    done."""
    before = read()
    if before is None or before.share < COLLECT_AT:
        return None
    gc.collect()
    after = read() or before
    released = after.share >= COLLECT_AT
    if released:
        release()
        gc.collect()
        after = read() or after
    return MapRelief(before, after, released)
