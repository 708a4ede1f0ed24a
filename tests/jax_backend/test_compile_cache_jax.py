"""JAX's file cache, as tpu_magic turns it on: an entry is written whole or not at all (a
process ended mid-write left a cut entry, on which a later process crashed reading it)."""

import pytest

from tpu_magic.backends.jax import compile_cache


def test_a_cache_entry_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from jax._src import lru_cache

    compile_cache._writes_whole()
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    cache.put("one", b"x" * 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one-cache"]
    assert cache.get("one") == b"x" * 1000
    written = type(cache.path).write_bytes

    def cut(path, data):  # the process ends halfway through the write
        written(path, data[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(type(cache.path), "write_bytes", cut)
    with pytest.raises(KeyboardInterrupt):
        cache.put("two", b"y" * 1000)
    monkeypatch.undo()
    assert cache.get("two") is None  # no cut entry to read back
