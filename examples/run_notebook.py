"""Runs a notebook headless (nbclient) and prints what its cells printed.

    python examples/run_notebook.py examples/quickstart.ipynb [-p EPOCHS=1 ...]

`-p NAME=VALUE` overrides a line `NAME = ...` in the cell tagged `parameters`
(papermill style). Exits 1 if any cell produced an error output, so CI fails.
"""

import argparse
import re
import sys
import time

import nbformat
from nbclient import NotebookClient


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
        return output.get("data", {}).get("text/plain", "") + "\n"
    if output.output_type == "error":
        return "\n".join(output.traceback) + "\n"
    return ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args()
    notebook = nbformat.read(args.notebook, as_version=4)
    set_parameters(notebook, dict(p.split("=", 1) for p in args.parameter))
    start = time.perf_counter()
    client = NotebookClient(notebook, timeout=args.timeout, kernel_name="python3",
                            allow_errors=True, resources={"metadata": {"path": "."}})
    client.execute()
    errors = 0
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            errors += output.output_type == "error"
            text = text_of(output).rstrip()
            if text:
                print(f"[cell {index}] {text}")
    print(f"{args.notebook}: {'FAILED' if errors else 'ok'} in {time.perf_counter() - start:.0f} s"
          f"{f', {errors} cell error(s)' if errors else ''}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
