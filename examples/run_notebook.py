"""Runs notebooks headless (nbclient) and prints what their cells printed.

    python examples/run_notebook.py examples/cifar10_cnn.ipynb [more.ipynb ...] [-p EPOCHS=1 ...]
        [--save DIR]

`-p NAME=VALUE` overrides a line `NAME = ...` in the cell tagged `parameters`
(papermill style; the value is Python source, e.g. -p 'CONNECT="--simulate 8"').
`--save DIR` writes each executed notebook, with its outputs (pictures included), to DIR,
with the hash of the code it ran from (`code_sha256`, before `-p`) and the parameters in its
metadata (`tpu_magic`): tests/unit/test_example_pages.py tells from it whether a committed
executed notebook is older than its example. Each kernel runs in a fresh temporary folder
(what a notebook writes beside itself goes there and is removed).
Exits 1 if any cell of any notebook produced an error output, or framework log noise
(absl, oneDNN, TensorFlow's C++ info lines) reached a cell's output, so CI fails.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError
from traitlets.config import Config


def set_parameters(notebook, overrides):
    cells = [c for c in notebook.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    for name, value in overrides.items():
        pattern = re.compile(rf"^{re.escape(name)}\s*=.*$", re.MULTILINE)
        if not cells or not pattern.search(cells[0].source):
            sys.exit(f"no parameter {name!r} in the notebook's `parameters` cell")
        cells[0].source = pattern.sub(f"{name} = {value}", cells[0].source)


def text_of(output):
    if output.output_type == "stream":
        return output.text
    if output.output_type in ("execute_result", "display_data"):
        data = output.get("data", {})
        if "application/vnd.jupyter.widget-view+json" in data:
            return "(widgets: the tpu_magic panel or a progress bar)\n"
        return data.get("text/plain", "") + "\n"
    if output.output_type == "error":
        return "\n".join(output.traceback) + "\n"
    return ""


# Lines the frameworks print on their own, which a notebook user should never see.
NOISE = re.compile(r"absl::InitializeLog|cpu_feature_guard|oneDNN custom operations|"
                   r"This TensorFlow binary is optimized|^[IW]\d{4} \d\d:\d\d:\d\d", re.M)


def out_of_range(printed, expect):
    """Why a figure the notebook printed misses its stated range (None: it is in it).
    `expect`: (a pattern with one number group, low, high)."""
    pattern, low, high = expect
    found = re.search(pattern, printed)
    if found is None:
        return f"nothing printed matches {pattern!r}"
    value = float(found.group(1))
    if not float(low) <= value <= float(high):
        return f"{found.group(0)!r}: {value} is outside the stated range {low}-{high}"
    return None


def code_sha256(notebook):
    """The hash of a notebook's code cells as written, in order (the parameters cell
    included): what its outputs are outputs of."""
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    return hashlib.sha256(json.dumps(code).encode()).hexdigest()


def kernel_config(sockets):
    """The kernel's channels as Unix sockets in the folder `sockets` (Windows has none: TCP
    there): over TCP, ipykernel 7 prints `[IPKernelApp] WARNING | Kernel is running over TCP
    without encryption` on every start, into the run's log."""
    if os.name == "nt":
        return Config()
    return Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets, "kernel")}})


def run(path, overrides, timeout, save=None, expect=None):
    """Executes one notebook; prints its outputs; returns the number of error outputs
    (framework log noise in an output counts as one, and so does a figure outside the
    range `expect` states, see `out_of_range`, and a kernel that died)."""
    notebook = nbformat.read(path, as_version=4)
    code = code_sha256(notebook)
    set_parameters(notebook, overrides)
    start = time.perf_counter()
    folder, died = tempfile.mkdtemp(prefix="tpu_magic-run-"), False
    work, sockets = os.path.join(folder, "work"), os.path.join(folder, "kernel")
    os.mkdir(work)
    os.mkdir(sockets)
    try:
        client = NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                allow_errors=True, resources={"metadata": {"path": work}},
                                config=kernel_config(sockets))
        client.execute()
    except DeadKernelError:  # the outputs so far are printed, and the run fails
        died = True
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    errors, printed = 0, []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            errors += output.output_type == "error"
            text = text_of(output).rstrip()
            if text:
                print(f"[cell {index}] {text}")
                printed.append(text)
            if output.output_type == "stream" and NOISE.search(output.text):
                errors += 1
                print(f"[cell {index}] framework log noise in the cell's output (above)")
    if died:
        errors += 1
        print(f"{path}: the kernel died")
    missed = out_of_range("\n".join(printed), expect) if expect else None
    if missed:
        errors += 1
        print(f"{path}: {missed}")
    if save is not None:
        notebook.metadata["tpu_magic"] = {"code_sha256": code, "parameters": overrides}
        Path(save).mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, Path(save) / Path(path).name)
        print(f"executed notebook saved: {Path(save) / Path(path).name}")
    print(f"{path}: {'FAILED' if errors else 'ok'} in {time.perf_counter() - start:.0f} s"
          f"{f', {errors} cell error(s)' if errors else ''}", flush=True)
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument("--save", metavar="DIR", help="write the executed notebooks to DIR")
    parser.add_argument("--expect", nargs=3, metavar=("PATTERN", "LOW", "HIGH"),
                        help="a figure the notebook prints (PATTERN's group 1) must lie in "
                             "[LOW, HIGH], e.g. --expect 'test accuracy ([0-9.]+)' 0.5 0.7")
    args = parser.parse_args()
    # each kernel runs in a temporary folder: a relative PYTHONPATH entry (dev.sh's
    # tests/without_tensorflow) is made absolute, so it still means what it meant here
    paths = os.environ.get("PYTHONPATH", "")
    if paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p
                                                   for p in paths.split(os.pathsep))
    overrides = dict(p.split("=", 1) for p in args.parameter)
    failed = [path for path in args.notebooks
              if run(path, overrides, args.timeout, args.save, args.expect)]
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
