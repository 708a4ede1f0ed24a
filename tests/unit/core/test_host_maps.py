"""The memory maps before a fit (`core.host_maps`): collected past half of Linux's limit, said
when they stay high after; nothing where they cannot be read."""

import gc

from tpu_magic.core import host_maps
from tpu_magic.core.host_maps import MapRelief, MapUse, map_use, relieve


def test_maps_are_read_from_proc_and_nothing_is_read_without_it(tmp_path):
    maps, limit = tmp_path / "maps", tmp_path / "max_map_count"
    maps.write_text("a\nb\nc\n")
    limit.write_text("65530\n")
    assert map_use(str(maps), str(limit)) == MapUse(3, 65530)
    assert map_use(str(tmp_path / "none"), str(limit)) is None
    limit.write_text("")
    assert map_use(str(maps), str(limit)) is None


def test_below_half_the_limit_nothing_is_collected_or_released(monkeypatch):
    done = []
    monkeypatch.setattr(gc, "collect", lambda: done.append("collect"))
    assert relieve(lambda: done.append("release"), lambda: MapUse(32_000, 65_530)) is None
    assert relieve(lambda: done.append("release"), lambda: None) is None
    assert done == []


def test_past_half_the_limit_a_collection_runs_and_releases_only_what_it_leaves(monkeypatch):
    done = []
    monkeypatch.setattr(gc, "collect", lambda: done.append("collect"))
    reads = iter([MapUse(40_000, 65_530), MapUse(9_000, 65_530)])
    relief = relieve(lambda: done.append("release"), lambda: next(reads))
    assert done == ["collect"]
    assert relief == MapRelief(MapUse(40_000, 65_530), MapUse(9_000, 65_530), released=False)
    assert relief.warning() is None
    done.clear()
    reads = iter([MapUse(40_000, 65_530), MapUse(38_000, 65_530), MapUse(3_000, 65_530)])
    relief = relieve(lambda: done.append("release"), lambda: next(reads))
    assert done == ["collect", "release", "collect"]
    assert relief == MapRelief(MapUse(40_000, 65_530), MapUse(3_000, 65_530), released=True)


def test_what_stays_high_after_is_said_with_what_to_do():
    still = MapRelief(MapUse(60_000, 65_530), MapUse(55_000, 65_530), released=True)
    assert "55,000 of the 65,530 memory maps" in still.warning()
    assert "del model" in still.warning()
    assert MapRelief(MapUse(60_000, 65_530), MapUse(52_000, 65_530)).warning() is None
    assert host_maps.COLLECT_AT < host_maps.WARN_AT < 1
