#!/usr/bin/env bash
# The project's two commands on a fresh machine:
#   bash dev.sh demo       # set up .venv, run the demo notebook on a simulated 8-core TPU
#   bash dev.sh test       # set up .venv, run the test suite
# and, for CI: bash dev.sh examples   # every example notebook, small settings
#              bash dev.sh wheel      # the built wheel in a clean venv (JAX, no TensorFlow)
#              bash dev.sh docs       # the documentation site (MkDocs) into site/, strict
#              bash dev.sh notebooks  # the site's example pages, executed (commit docs/notebooks/)
# Set-up is idempotent: the venv is made once and `pip install` is quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${TPU_MAGIC_VENV:-.venv}
WHEEL_VENV=$(pwd)/${TPU_MAGIC_WHEEL_VENV:-.venv-wheel}
HERE=$(pwd)

say() { echo "dev.sh: $*"; }

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV and installing tensorflow-cpu, JAX, JupyterLab and the test tools" \
        "(about 2.6 GB; a few minutes the first time, seconds after)"
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  say "pip install -e .[cpu,test,browser,examples,jax,docs] into $VENV"
  # setuptools' build backend boxes an 11-line "Editable installation" notice on every run
  PYTHONWARNINGS="ignore:Editable installation" \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[cpu,test,browser,examples,jax,docs]"
  # KerasHub without tensorflow-text (its only heavy dependency: the full tensorflow wheel);
  # the tests build models from configs and never tokenize. Its other imports are in [test].
  say "pip install keras-hub (no dependencies; they come with [test])"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "keras-hub>=0.20"
  say "set up"
}

# The panel's browser test drives Debian's chromium; Playwright's own download is not used.
chromium() {
  if [ -x /usr/bin/chromium ] || [ "${TPU_MAGIC_BROWSER:-}" = skip ]; then
    return
  fi
  local as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo > /dev/null && sudo -n true 2> /dev/null; then
    as_root="sudo -n"
  fi
  if { [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; } && command -v apt-get > /dev/null; then
    say "installing Debian's chromium with apt-get (as root; about 300 MB) for the panel's" \
        "browser test; skip it with TPU_MAGIC_BROWSER=skip"
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null
  else
    echo "dev.sh: /usr/bin/chromium is missing, so the browser test will be skipped" \
         "(install it: sudo apt-get install chromium)"
  fi
}

case "${1:-}" in
  demo)
    # The CIFAR-10 example, small: the offline stand-in's 1,497 training images (sklearn's
    # digits upscaled, no download), 2 epochs; the executed notebook, with its outputs (the
    # loss chart, eight test images and their predicted classes), is saved in executed/. The notebook
    # is seeded (SEED = 0): its CPU copy's test accuracy, 0.727 on this project's machine,
    # must lie in the range the docs quote, 0.65-0.80 (a broken install gets about 0.1).
    setup
    shift
    expect=()  # at its own settings only: `dev.sh demo -p EPOCHS=1` prints another figure
    if [ $# -eq 0 ]; then expect=(--expect 'test accuracy ([0-9.]+)' 0.65 0.80); fi
    say "running examples/cifar10_cnn.ipynb on a simulated 8-core TPU (about a minute)"
    "$VENV/bin/python" examples/run_notebook.py examples/cifar10_cnn.ipynb --save executed \
      -p 'CONNECT="--simulate 8"' -p OFFLINE=True -p SAMPLES=1536 -p EPOCHS=2 "${expect[@]}" "$@"
    ;;
  wheel)
    # What a Colab or Kaggle user installs: the built wheel (not -e), in a clean venv with
    # the [jax] extra and no TensorFlow, running the demo from outside the repository.
    setup
    shift
    rm -rf dist "$WHEEL_VENV"
    say "building the wheel and the sdist (python -m build)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check build
    "$VENV/bin/python" -m build -q --outdir dist . > /dev/null
    wheel=$HERE/$(ls dist/tpu_magic-*.whl)
    say "installing $wheel[jax,examples] into a clean $WHEEL_VENV (no TensorFlow)"
    python3 -m venv "$WHEEL_VENV"
    "$WHEEL_VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$WHEEL_VENV/bin/python" -m pip install -q --disable-pip-version-check \
      "$wheel[jax,examples]" nbclient nbformat ipykernel
    run_dir=$(mktemp -d)
    cp examples/cifar10_cnn.ipynb "$run_dir/"
    (cd "$run_dir" && "$WHEEL_VENV/bin/python" - <<'PY'
import importlib.util, sys
import tpu_magic
assert "site-packages" in tpu_magic.__file__, tpu_magic.__file__
assert importlib.util.find_spec("tensorflow") is None, "the wheel's [jax] install pulled TensorFlow"
import tpu_magic.datasets, tpu_magic.notebook.magics  # package data and subpackages shipped
print("dev.sh: the wheel's tpu_magic is", tpu_magic.__file__)
PY
    )
    (cd "$run_dir" && "$WHEEL_VENV/bin/python" "$HERE/examples/run_notebook.py" \
      cifar10_cnn.ipynb -p 'CONNECT="--simulate 8"' -p OFFLINE=True -p SAMPLES=512 \
      -p EPOCHS=1 "$@")
    ;;
  examples)
    # The classic tutorials twice: with TensorFlow (auto takes it), then as on Colab's TPU
    # image, where TensorFlow cannot be imported (tests/without_tensorflow) and auto takes JAX.
    # Today's workloads once each, where they run: the KerasHub LoRA notebook as on Kaggle
    # (JAX beside tensorflow-cpu), the several-hosts rehearsal as on a TPU VM (no TensorFlow).
    setup
    shift
    tutorials=(examples/cifar10_cnn.ipynb examples/fashion_mnist_cnn.ipynb examples/imdb_lstm.ipynb
               examples/imdb_lstm_static_batch.ipynb examples/mnist_cnn.ipynb)
    small=(-p OFFLINE=True -p SAMPLES=512 -p EPOCHS=1)
    # The executed notebooks, with their outputs, go to executed/tensorflow and executed/jax.
    "$VENV/bin/python" examples/run_notebook.py "${tutorials[@]}" --save executed/tensorflow \
      -p 'CONNECT="--simulate 8"' "${small[@]}" "$@"
    say "KerasHub LoRA as on Kaggle (Keras on JAX, tensorflow-cpu importable)"
    "$VENV/bin/python" examples/run_notebook.py examples/gemma_lora_kaggle.ipynb \
      --save executed/jax -p 'CONNECT="--simulate 8"' "${small[@]}" "$@"
    say "the same tutorials and the hosts rehearsal with TensorFlow blocked (Keras on JAX)"
    PYTHONPATH=tests/without_tensorflow \
      "$VENV/bin/python" examples/run_notebook.py "${tutorials[@]}" --save executed/jax \
      -p 'CONNECT="--simulate 8"' "${small[@]}" "$@"
    PYTHONPATH=tests/without_tensorflow \
      "$VENV/bin/python" examples/run_notebook.py examples/hosts_rehearsal.ipynb \
      --save executed/jax "${small[@]}" "$@"
    ;;
  notebooks)
    # The site's example pages: each example notebook executed at settings where the model
    # visibly learns (many epochs of the offline stand-in data, so a page is the same on any
    # machine and each takes a few minutes on 2 cores; the tutorials on TensorFlow, whose
    # CPU replicas are the quicker there, the LoRA notebook on JAX as on Kaggle, the hosts
    # rehearsal on JAX with TensorFlow blocked), saved with its outputs and its code's hash into
    # docs/notebooks/ (committed; tests/unit/test_example_pages.py fails when an example's
    # code changed after its page was made). `bash dev.sh notebooks mnist_cnn` makes one.
    setup
    shift
    wanted=" ${*:-cifar10_cnn mnist_cnn fashion_mnist_cnn imdb_lstm imdb_lstm_static_batch gemma_lora_kaggle hosts_rehearsal} "
    page() {
      local name=$1
      shift
      if [[ "$wanted" != *" $name "* ]]; then return; fi
      say "docs/notebooks/$name.ipynb ($*)"
      "$VENV/bin/python" examples/run_notebook.py "examples/$name.ipynb" --save docs/notebooks \
        -p OFFLINE=True "$@"
    }
    page cifar10_cnn -p 'CONNECT="--simulate 8"' -p EPOCHS=20
    page mnist_cnn -p 'CONNECT="--simulate 8"' -p EPOCHS=15
    page fashion_mnist_cnn -p 'CONNECT="--simulate 8"' -p EPOCHS=15
    page imdb_lstm -p 'CONNECT="--simulate 8"' -p EPOCHS=6
    page imdb_lstm_static_batch -p 'CONNECT="--simulate 8"' -p EPOCHS=6
    page gemma_lora_kaggle -p 'CONNECT="--simulate 8"'  # KerasHub's guide: 1 epoch
    PYTHONPATH=tests/without_tensorflow page hosts_rehearsal -p EPOCHS=8
    ;;
  docs)
    # The documentation site into site/ (mkdocs build --strict: a broken link or a page
    # missing from the nav fails), with the committed example pages (docs/notebooks/, made by
    # `bash dev.sh notebooks`; nothing is executed here). The site opens from disk
    # (site/index.html: every link names its page's file) as well as from `mkdocs serve`;
    # tests/support/site_check.py checks the built pages' links, and that no build script
    # or machine path is published.
    setup
    shift
    say "building the documentation site (mkdocs build --strict) into site/"
    NO_MKDOCS_2_WARNING=1 "$VENV/bin/python" -m mkdocs build --strict --quiet "$@"
    "$VENV/bin/python" tests/support/site_check.py site
    say "site/index.html (open it from disk, or: $VENV/bin/python -m mkdocs serve)"
    ;;
  test)
    # With no arguments: the quick lane first (-m quick: the unit suite and one cell a
    # backend, a few minutes), so a broken install fails fast, then everything else.
    # With arguments, pytest gets them as they are (`bash dev.sh test -m quick`).
    setup
    chromium
    shift
    if [ $# -eq 0 ]; then
      say "the quick lane (pytest -m quick), then the rest (pytest -m 'not quick')"
      "$VENV/bin/python" -m pytest -m quick
      "$VENV/bin/python" -m pytest -m "not quick"
    else
      "$VENV/bin/python" -m pytest "$@"
    fi
    ;;
  *)
    echo "usage: bash dev.sh demo | bash dev.sh test [pytest args] | bash dev.sh examples |" \
         "bash dev.sh wheel | bash dev.sh docs | bash dev.sh notebooks [NAME ...]" >&2
    exit 2
    ;;
esac
