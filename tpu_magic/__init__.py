"""tpu_magic: train the Keras model in a notebook cell on the accelerator you have.

`%load_ext tpu_magic` registers `%tpu_connect`, `%%tpu_train` and `%tpu_sync`.
Importing this package is cheap: TensorFlow, Keras, JAX and ipywidgets are
imported by the functions that need them, on first connect.
"""

from tpu_magic.core.session import Connection
from tpu_magic.core.session import current as session
from tpu_magic.notebook.workspace import Workspace, workspace

__all__ = ["Connection", "Workspace", "session", "workspace", "load_adapters", "hosts_outputs",
           "load_ipython_extension", "unload_ipython_extension"]
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """Registers the magics (`%load_ext tpu_magic`), keeps TensorFlow's C++ log lines out
    of the notebook should anything import TensorFlow before `%tpu_connect`, and libraries'
    notes on their own settings out of every cell (`notebook.quiet`), and where
    TensorFlow cannot be imported, makes JAX Keras's backend (said in one line), so that
    `import keras` may come before `%tpu_connect`."""
    from tpu_magic.backends import default_keras_to_jax
    from tpu_magic.notebook.magics import register
    from tpu_magic.notebook.quiet import drop_library_notes, quiet_native_logs

    register(ipython)
    quiet_native_logs()
    drop_library_notes()
    said = default_keras_to_jax()
    if said:
        print(said)


def unload_ipython_extension(ipython):
    """Removes the magics (`%unload_ext tpu_magic`)."""
    from tpu_magic.notebook.magics import unregister
    from tpu_magic.notebook.quiet import keep_library_notes

    unregister(ipython)
    keep_library_notes()


def load_adapters(model, path):
    """Puts LoRA adapters saved by `%tpu_sync MODEL --save PATH --adapters` into `model`
    (built from the same preset, LoRA enabled with the same rank); returns how many
    variables were loaded."""
    from tpu_magic.training.sync.adapters import load_adapters as load

    return load(model, path)


def hosts_outputs():
    """What every host printed in the last `%%tpu_train` cell on several hosts, by host
    (`{"host 0 (name)": text, ...}`); empty without such a connection."""
    from tpu_magic.core import process

    hosts = process.hosts()
    return dict(hosts.outputs) if hosts is not None else {}
