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
    assert len(text.splitlines()) <= 130  # a front door: what it is, three cells, links
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


def test_the_readme_states_speed_in_one_line_and_no_other_figure():
    # measurements live in docs/benchmarks.md, with their machine and method; the README's
    # prose (its cells' outputs aside) states none but the demo's checked accuracy range
    text = (ROOT / "README.md").read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", prose) if p.strip()]
    figure = re.compile(r"\d\s*[×%]|\b0\.\d+|\d+(?:\.\d+)?x\b")
    speed = [p for p in paragraphs if "benchmarks.md" in p]
    assert len(speed) == 1 and speed[0].startswith("**Speed**") and "\n" not in \
        next(line for line in text.splitlines() if line.startswith("**Speed**"))
    stated = [p for p in paragraphs if figure.search(re.sub(r"`[^`]*`", "", p))
              and p not in speed]
    assert all("stated range" in p for p in stated), stated


def undefined_names(text: str) -> list[str]:
    """Names a page's python snippets, run in order as cells, use and never define (magic
    lines left out, `...` read as a placeholder value)."""
    import ast
    import builtins

    cells = ["\n".join(line for line in block.splitlines()
                       if not line.lstrip().startswith(("%", "!")))
             for block in re.findall(r"```python\n(.*?)```", text, re.S)]
    tree = ast.parse("\n".join(cells))
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    used = {node.id for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return sorted(used - bound)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/getting-started.md",
                                  "docs/install.md", "docs/guides/keras-on-jax.md",
                                  "docs/guides/lora-kaggle.md", "docs/guides/doctor.md"])
def test_a_first_pages_snippets_define_every_name_they_use(page):
    assert undefined_names((ROOT / page).read_text()) == []
    assert undefined_names("```python\nmodel.fit(x_train)\n```") == ["model", "x_train"]


def test_a_flags_help_with_angle_brackets_shows_them_on_the_page():
    # `default 1x<devices>` rendered as "default 1x": Markdown took <devices> for a tag
    docs = flags_module()
    table = docs.table("tpu_train")
    row = next(line for line in table.splitlines() if line.startswith("| `--mesh"))
    assert "1x&lt;devices&gt;" in row and not re.search(r"<[a-z]", table.split("\n", 3)[3])
