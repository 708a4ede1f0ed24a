"""Blocks `import tensorflow` in every Python process that has this folder on PYTHONPATH.

Colab's TPU runtimes ship JAX and Keras without TensorFlow; a process started with
`PYTHONPATH=tests/without_tensorflow` behaves like one of them (Keras's own optional
uses of TensorFlow see it as missing). The JAX suite, the compilation-cache runs and
`bash dev.sh examples` use it.
"""

import sys


class NoTensorFlow:
    """A meta path finder that refuses tensorflow and its submodules."""

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ImportError("tensorflow is blocked here, as on Colab's TPU image")
        return None


if not any(isinstance(finder, NoTensorFlow) for finder in sys.meta_path):
    sys.meta_path.insert(0, NoTensorFlow())
