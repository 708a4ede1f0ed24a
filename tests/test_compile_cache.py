"""JAX's persistent compilation cache: where it goes (pure), and two processes sharing one."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_magic.compile_cache import CompileCounts, choose_directory, version_key

HERE = Path(__file__).parent
VERSIONS = {"jax": "0.7.2", "jaxlib": "0.7.2", "libtpu": "0.0.21"}
KEY = "jax-0.7.2_jaxlib-0.7.2_libtpu-0.0.21"


@pytest.mark.parametrize("setting, env, dirs, directory, why", [
    # Colab with Drive mounted: survives a restart and a new VM
    (None, {"HOME": "/root"}, {"/content/drive/MyDrive"},
     f"/content/drive/MyDrive/tpu_magic_cache/{KEY}", "mounted Drive"),
    # Kaggle
    (None, {"HOME": "/root", "ISTPUVM": "1"}, {"/kaggle/working"},
     f"/kaggle/working/tpu_magic_cache/{KEY}", "/kaggle/working"),
    # anywhere else: the user's cache folder
    (None, {"HOME": "/home/ada"}, set(), f"/home/ada/.cache/tpu_magic/jax/{KEY}", "kernel restart"),
    (None, {"HOME": "/home/ada", "XDG_CACHE_HOME": "/scratch/c"}, set(),
     f"/scratch/c/tpu_magic/jax/{KEY}", "kernel restart"),
    # chosen: --compile-cache DIR, TPU_MAGIC_COMPILE_CACHE, or off
    ("/data/cc", {"HOME": "/root"}, {"/kaggle/working"}, f"/data/cc/{KEY}", "you chose"),
    (None, {"TPU_MAGIC_COMPILE_CACHE": "/data/env"}, set(), f"/data/env/{KEY}", "you chose"),
    ("off", {"TPU_MAGIC_COMPILE_CACHE": "/data/env"}, set(), None, "turned off"),
    (None, {"TPU_MAGIC_COMPILE_CACHE": "OFF"}, set(), None, "turned off"),
    # the user's own JAX setting is kept as it is
    (None, {"JAX_COMPILATION_CACHE_DIR": "/mine"}, {"/kaggle/working"}, "/mine", "already given"),
])
def test_where_the_cache_goes(setting, env, dirs, directory, why):
    choice = choose_directory(setting, env, VERSIONS, is_dir=lambda d: d in dirs)
    assert choice.directory == directory and why in choice.reason
    assert (choice.directory or "off") in choice.note()


def test_each_version_set_has_its_own_folder():
    assert version_key({"jax": "0.10.2", "jaxlib": "0.10.2"}) == "jax-0.10.2_jaxlib-0.10.2_libtpu-none"
    assert version_key({"jax": "0.7.2+local/x"}).startswith("jax-0.7.2_local_x")


@pytest.mark.parametrize("counts, text", [
    (CompileCounts(13, 0, 0.051), "XLA compile 0.05 s, from cache (13 programs)"),
    (CompileCounts(0, 13, 2.14), "XLA compile 2.14 s, 13 programs compiled and cached"),
    (CompileCounts(12, 1, 0.9), "XLA compile 0.90 s, 1 program compiled and cached, 12 from cache"),
    (CompileCounts(0, 0, 0.0), None),
])
def test_the_reports_words(counts, text):
    assert counts.describe() == text
    assert CompileCounts(5, 2, 1.5) - CompileCounts(1, 2, 0.5) == CompileCounts(4, 0, 1.0)


def _run(out: Path, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE / "without_tensorflow"),
               TPU_MAGIC_COMPILE_CACHE=str(cache))
    env.pop("KERAS_BACKEND", None)
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, str(HERE / "compile_cache_run.py"), str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_second_process_loads_the_compiled_programs_from_the_cache(tmp_path):
    if importlib.util.find_spec("jax") is None:
        if os.environ.get("TPU_MAGIC_JAX") == "required":
            pytest.fail("TPU_MAGIC_JAX=required but jax is not installed: pip install -e '.[jax]'")
        pytest.skip("jax is not installed (pip install -e '.[jax]')")
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
