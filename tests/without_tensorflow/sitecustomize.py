"""Hides `tensorflow` from every Python process that has this folder on PYTHONPATH.

Colab's TPU runtimes ship JAX and Keras without TensorFlow; a process started with
`PYTHONPATH=tests/without_tensorflow` behaves like one of them: `import tensorflow` raises
`ModuleNotFoundError`, and `importlib.util.find_spec("tensorflow")` is None, as when it is
not installed (libraries that probe for it so, e.g. etils, which JAX's compilation cache
uses once grain is installed, then leave it alone instead of failing). The JAX suite, the
compilation-cache runs and `bash dev.sh examples` use it.
"""

import sys


def _hidden(name):
    return name == "tensorflow" or name.startswith("tensorflow.")


class NoTensorFlow:
    """Wraps a meta path finder so that it finds no tensorflow module."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if _hidden(name):
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [f if isinstance(f, NoTensorFlow) else NoTensorFlow(f) for f in sys.meta_path]
