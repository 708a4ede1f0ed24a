"""The README's opening example, run as written (offline: no download in tests)."""

import re

import pytest
from support import TESTS

README = TESTS.parent / "README.md"


def opening_blocks():
    text = README.read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)[:4]


@pytest.mark.quick
def test_the_opening_example_runs_as_written(fresh):
    import tpu_magic

    blocks = opening_blocks()
    assert blocks[0].startswith("%load_ext tpu_magic") and blocks[3].startswith("%tpu_sync")
    for block in blocks:
        code = block.replace('load("mnist")', 'load("mnist", offline=True, samples=600)')
        code = code.replace("--epochs 5", "--epochs 1")  # the same cell, shorter
        fresh.run_cell(code)
    assert fresh.user_ns["model_cpu"] is not None
    report = tpu_magic.workspace().report
    assert report.fits == 1 and report.predictions == (6,)
