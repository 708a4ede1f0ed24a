#!/usr/bin/env bash
# The project's two commands on a fresh machine:
#   bash dev.sh demo       # set up .venv, run the demo notebook on a simulated 8-core TPU
#   bash dev.sh test       # set up .venv, run the test suite
# and, for CI: bash dev.sh examples   # every example notebook, small settings
# Set-up is idempotent: the venv is made once and `pip install` is quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${TPU_MAGIC_VENV:-.venv}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[cpu,test,browser,examples,jax]"
}

# The panel's browser test drives Debian's chromium; Playwright's own download is not used.
chromium() {
  if [ -x /usr/bin/chromium ]; then
    return
  fi
  local as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo > /dev/null && sudo -n true 2> /dev/null; then
    as_root="sudo -n"
  fi
  if { [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; } && command -v apt-get > /dev/null; then
    echo "dev.sh: installing chromium with apt (for the panel's browser test)"
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null
  else
    echo "dev.sh: /usr/bin/chromium is missing, so the browser test will be skipped" \
         "(install it: sudo apt-get install chromium)"
  fi
}

case "${1:-}" in
  demo)
    # The CIFAR-10 example, small: 1,536 stand-in images (no download), 2 epochs.
    setup
    shift
    "$VENV/bin/python" examples/run_notebook.py examples/cifar10_cnn.ipynb \
      -p 'CONNECT="--simulate 8"' -p OFFLINE=True -p SAMPLES=1536 -p EPOCHS=2 "$@"
    ;;
  examples)
    # Every notebook twice: with TensorFlow (auto takes it), then as on Colab's TPU image,
    # where TensorFlow cannot be imported (tests/without_tensorflow) and auto takes JAX.
    setup
    shift
    "$VENV/bin/python" examples/run_notebook.py examples/*.ipynb \
      -p 'CONNECT="--simulate 8"' -p OFFLINE=True -p SAMPLES=512 -p EPOCHS=1 "$@"
    echo "dev.sh: the same notebooks with TensorFlow blocked (Keras on JAX, no backend named)"
    PYTHONPATH=tests/without_tensorflow \
      "$VENV/bin/python" examples/run_notebook.py examples/*.ipynb \
      -p 'CONNECT="--simulate 8"' -p OFFLINE=True -p SAMPLES=512 -p EPOCHS=1 "$@"
    ;;
  test)
    setup
    chromium
    shift
    "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: bash dev.sh demo | bash dev.sh test [pytest args] | bash dev.sh examples" >&2
    exit 2
    ;;
esac
