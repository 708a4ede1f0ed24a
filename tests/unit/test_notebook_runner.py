"""The headless notebook runner's noise rule: framework log lines in a cell's output fail
the run (CI runs every example notebook through it)."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "run_notebook", Path(__file__).resolve().parents[2] / "examples" / "run_notebook.py")


def noise():
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NOISE


def test_framework_log_lines_count_as_noise_and_the_users_lines_do_not():
    rule = noise()
    for line in ["WARNING: All log messages before absl::InitializeLog() is called are "
                 "written to STDERR",
                 "I0000 00:00:1795462816.320549    3493 cpu_feature_guard.cc:227] This "
                 "TensorFlow binary is optimized to use available CPU instructions",
                 "oneDNN custom operations are on. You may see slightly different numerical "
                 "results",
                 "W1123 20:01:02.123456  1234 some_file.cc:12] a warning"]:
        assert rule.search(line), line
    for line in ["Epoch 1/2", "loss 0.25, I0000 is my run's name", "accuracy: 0.97"]:
        assert not rule.search(line), line


def test_a_printed_figure_outside_its_stated_range_fails_the_run():
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expect = (r"test accuracy ([0-9.]+)", "0.5", "0.7")
    assert module.out_of_range("CPU copy: test accuracy 0.605 on 300 images", expect) is None
    assert "outside the stated range 0.5-0.7" in module.out_of_range(
        "CPU copy: test accuracy 0.270 on 300 images", expect)
    assert "nothing printed matches" in module.out_of_range("no figure", expect)


def test_a_notebook_run_prints_no_kernel_transport_warning(tmp_path):
    # ipykernel 7 warns "Kernel is running over TCP without encryption" on every TCP start
    import subprocess
    import sys

    import nbformat

    notebook = tmp_path / "one_cell.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")]),
                   notebook)
    runner = Path(__file__).resolve().parents[2] / "examples" / "run_notebook.py"
    done = subprocess.run([sys.executable, str(runner), str(notebook)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    seen = done.stdout + done.stderr
    assert done.returncode == 0 and "[cell 0] 42" in seen, seen
    assert "IPKernelApp" not in seen and "without encryption" not in seen, seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one_cell.ipynb"]  # no socket left
