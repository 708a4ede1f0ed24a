"""JAX's persistent compilation cache: two processes sharing one (the pure rules are in
tests/unit/backends/jax/test_compile_cache.py)."""

import json
import subprocess
import sys
from pathlib import Path

from support import TESTS
from support.jax_process import blocked_env, require_jax

HERE = TESTS


def _run(out: Path, cache: Path) -> dict:
    env = blocked_env(TPU_MAGIC_COMPILE_CACHE=str(cache))
    run = subprocess.run([sys.executable, str(HERE / "support" / "compile_cache_run.py"), str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_second_process_loads_the_compiled_programs_from_the_cache(tmp_path):
    require_jax()
    cache = tmp_path / "cache"
    first = _run(tmp_path / "first.json", cache)
    second = _run(tmp_path / "second.json", cache)
    for run in (first, second):  # auto chose JAX: TensorFlow is blocked, as on Colab's TPU image
        assert run["backend"] == "jax" and not run["tensorflow_imported"]
        assert any(f"cached in {cache}" in note for note in run["notes"])
    assert first["misses"] > 0 and first["hits"] == 0
    assert "programs compiled and cached" in first["summary"]
    assert second["hits"] >= first["misses"] and second["misses"] == 0
    assert "from cache" in second["summary"]
    # loading a program is far quicker than compiling it (measured: 2.1 s against 0.05 s)
    assert second["xla_compile_seconds"] < 0.5 * first["xla_compile_seconds"]
    print(f"\ncompile: first {first['xla_compile_seconds']:.2f} s ({first['misses']} programs), "
          f"second {second['xla_compile_seconds']:.2f} s from cache ({second['hits']})")
