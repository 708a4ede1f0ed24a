"""The site's example pages (docs/notebooks/, executed notebooks committed with their outputs,
made by `bash dev.sh notebooks`) are outputs of the examples' code as it is now, at settings
where the model learns, and show a reader nothing of the machine that made them. CI also
runs every example again at small settings (`bash dev.sh examples`)."""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "notebooks"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _module(ROOT / "examples" / "run_notebook.py")
site_check = _module(ROOT / "tests" / "support" / "site_check.py")
IN_NAV = re.findall(r"notebooks/(\w+)\.ipynb", (ROOT / "mkdocs.yml").read_text())


def test_every_example_has_a_page_in_the_site():
    examples = sorted(p.stem for p in (ROOT / "examples").glob("*.ipynb"))
    assert sorted(IN_NAV) == examples
    assert sorted(p.stem for p in PAGES.glob("*.ipynb")) == examples


@pytest.mark.parametrize("name", IN_NAV)
def test_an_example_page_is_made_from_its_examples_code_as_it_is_now(name):
    page = nbformat.read(PAGES / f"{name}.ipynb", as_version=4)
    made = page.metadata.get("tpu_magic", {})
    now = runner.code_sha256(nbformat.read(ROOT / "examples" / f"{name}.ipynb", as_version=4))
    assert made.get("code_sha256") == now, (
        f"docs/notebooks/{name}.ipynb was made from other code than examples/{name}.ipynb's: "
        f"run `bash dev.sh notebooks {name}` and commit the page")


@pytest.mark.parametrize("name", IN_NAV)
def test_an_example_page_ran_at_learning_settings_and_shows_no_error_or_machine_path(name):
    page = nbformat.read(PAGES / f"{name}.ipynb", as_version=4)
    parameters = page.metadata["tpu_magic"]["parameters"]
    # CI's runs are of 1 epoch. The LoRA notebook trains 1, as KerasHub's guide does: offline
    # its small Gemma has random weights, so its page shows the plan, the check, the speed
    # and the adapters, not learning
    assert int(parameters.get("EPOCHS", "1")) >= (1 if name == "gemma_lora_kaggle" else 4), \
        parameters
    shown, pictures = [], 0
    for cell in page.cells:
        for output in cell.get("outputs", []):
            assert output.output_type != "error", f"{name}: {output.get('ename')}"
            shown.append(runner.text_of(output))
            pictures += any(kind.startswith("image/") for kind in output.get("data", {}))
    text = "\n".join(shown)
    assert not site_check.MACHINE_PATH.search(text), site_check.MACHINE_PATH.search(text)
    assert not runner.NOISE.search(text)
    assert pictures >= 1  # the loss chart at least


def test_a_machine_path_is_told_from_the_paths_a_page_may_show():
    finds = site_check.MACHINE_PATH.search
    for path in ["/root/.cache/tpu_magic", "saved to /tmp/tmpab12/x.h5", "/home/ada/work",
                 "/work/main/tpu_magic"]:
        assert finds(path), path
    for path in ["~/.cache/tpu_magic/jax", "/kaggle/working/lora", "lora/gemma.adapters.h5",
                 "/content/drive/MyDrive", "https://keras.io/api/"]:
        assert not finds(path), path
