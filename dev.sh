#!/usr/bin/env bash
# The project's two commands on a fresh machine:
#   bash dev.sh demo   # set up .venv, run the demo notebook on a simulated 8-core TPU
#   bash dev.sh test   # set up .venv, run the test suite
# Set-up is idempotent: the venv is made once and `pip install` is quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${TPU_MAGIC_VENV:-.venv}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[cpu,test]"
}

case "${1:-}" in
  demo)
    setup
    shift
    "$VENV/bin/python" examples/run_notebook.py examples/quickstart.ipynb "$@"
    ;;
  test)
    setup
    shift
    "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: bash dev.sh demo | bash dev.sh test [pytest args]" >&2
    exit 2
    ;;
esac
