"""The built site's check (tests/support/site_check.py, run by `bash dev.sh docs`): it finds a
link to a folder (what breaks a site opened from disk), a published script and a machine
path, and passes a site without them."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("site_check",
                                              ROOT / "tests" / "support" / "site_check.py")
site_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(site_check)


def page(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<html><body>{body}</body></html>")


def test_a_site_whose_links_name_files_passes(tmp_path):
    page(tmp_path / "index.html", '<a href="guides/doctor.html#on-its-own">doctor</a>'
                                  '<a href="https://keras.io/">Keras</a><a href="#top">top</a>')
    page(tmp_path / "guides" / "doctor.html", '<a href="../index.html">home</a> ~/.cache/x')
    assert site_check.problems(tmp_path) == []
    assert site_check.main([str(tmp_path)]) == 0


def test_folder_links_scripts_and_machine_paths_are_found(tmp_path):
    page(tmp_path / "index.html", '<a href="getting-started/">start</a><a href="gone.html">x</a>'
                                  "<pre>cached in /root/.cache/tpu_magic/jax</pre>")
    page(tmp_path / "getting-started" / "index.html", "start")
    (tmp_path / "flags.py").write_text("print()")
    found = site_check.problems(tmp_path)
    assert len(found) == 4, found
    assert any("links to a folder" in line and "getting-started/" in line for line in found)
    assert any("missing file: gone.html" in line for line in found)
    assert any("flags.py: a build script is published" in line for line in found)
    assert any("machine's own path (/root/" in line for line in found)
    assert site_check.main([str(tmp_path)]) == 1
