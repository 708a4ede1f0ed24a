"""Where JAX's compilation cache goes, and how the report words what it did (pure)."""

import pytest

from tpu_magic.backends.jax.compile_cache import CompileCounts, choose_directory, version_key

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


def test_the_note_writes_a_directory_in_the_home_folder_from_tilde():
    # a published notebook showed /root/.cache/...: the machine's, not the reader's
    choice = choose_directory(None, {"HOME": "/home/ada"}, VERSIONS, is_dir=lambda d: False)
    assert choice.note(home="/home/ada") == (f"compiled programs are cached in "
                                             f"~/.cache/tpu_magic/jax/{KEY} (it survives a "
                                             "kernel restart on this machine)")
    assert "/home/adam/x" in choose_directory("/home/adam/x", {}, VERSIONS).note(home="/home/ada")
