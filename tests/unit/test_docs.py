"""The documentation stays true to the code: every flag of every magic is on its reference
page, every page the site's nav names exists, and the README's links lead somewhere.
(`bash dev.sh docs`, in CI, builds the site with `mkdocs build --strict`.)"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def flags_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_flags", ROOT / "docs" / "flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("magic", ["tpu_connect", "tpu_train", "tpu_sync"])
def test_every_flag_of_a_magic_is_on_its_reference_page_as_its_help_says(magic):
    docs = flags_module()
    page = ROOT / "docs" / "reference" / docs.PAGES[magic]
    text = page.read_text()
    assert docs.table(magic) in text, (f"{page.name}'s flags differ from %{magic}'s help: "
                                       "run `python docs/flags.py`")
    from tpu_magic.notebook.magics import TpuMagics

    for action in getattr(TpuMagics, magic).parser._actions:
        for flag in action.option_strings:
            if flag != "-h":
                assert f"`{flag}" in text, flag


def test_every_page_in_the_nav_exists():
    nav = re.findall(r":\s+([\w/.-]+\.(?:md|ipynb))\s*$|^\s+- ([\w/.-]+\.md)\s*$",
                     (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = [a or b for a, b in nav]
    assert len(pages) > 15
    for page in pages:
        if page.startswith("notebooks/"):  # executed by `dev.sh examples`, copied by `dev.sh docs`
            assert (ROOT / "examples" / Path(page).name).exists(), page
        else:
            assert (ROOT / "docs" / page).exists(), page


def test_the_readme_is_short_and_its_links_lead_somewhere():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link


def test_the_doctor_guide_shows_what_the_doctor_prints():
    import os
    import subprocess
    import sys

    from tpu_magic.core.target import read_machine_signs

    guide = (ROOT / "docs" / "guides" / "doctor.md").read_text()
    shown = re.search(r"```text\n(The runtime doctor\n.*?)```", guide, re.S).group(1)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLAB_", "KAGGLE_"))} | {"COLAB_RELEASE_TAG": "release-colab"}
    printed = subprocess.run([sys.executable, "-m", "tpu_magic.connecting.doctor", "--tpu"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT,
                             env=env).stdout
    # the installed versions are this machine's; every other line is what the doctor says
    def same(text):
        return [line for line in text.splitlines() if not line.startswith("  installed: ")]

    signs = read_machine_signs()
    if signs.tpu_vm or signs.gpu_devices:
        pytest.skip("the guide's example is a machine without a TPU or GPU")
    assert same(shown) == same(printed), printed
