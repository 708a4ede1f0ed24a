"""What runs on each engine (an IPython kernel of its own, one a host): joining the JAX run,
the cell through the engine's own `%%tpu_train` (so every rule of one host holds on each),
and the trained model's state for `%tpu_sync`. The notebook calls these through
ipyparallel (`hosts.run`); they import what they need on the engine."""

from __future__ import annotations

import dataclasses
import linecache
import os
import socket
import types
from typing import Any

import numpy as np

from tpu_magic.hosts.outcome import HostOutcome

PROGRESS_VARIABLE = "TPU_MAGIC_PUBLISH_PROGRESS"  # on an engine: bars go to the notebook


def coordinator_address() -> str:
    """This host's name and a free port on it: where process 0 coordinates the JAX run."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return f"{socket.gethostname()}:{probe.getsockname()[1]}"


def join(index: int, count: int, coordinator: str, local_devices: int | None,
         timeout: float, notebook_pid: int | None = None,
         controller_pid: int | None = None) -> dict:
    """Joins the JAX run as process `index` of `count` and loads tpu_magic in this engine.

    `notebook_pid`, `controller_pid`: the notebook's process and the cluster's controller,
    for engines the notebook started (`--simulate HxD`): such an engine ends when the
    notebook's process does, and ends the controller (see `end_with_parent`).

    Returns:
        {"index", "host", "pid", "devices"}: for the connect summary and the liveness checks.
    """
    from IPython import get_ipython

    from tpu_magic.backends.jax.processes import join_processes
    from tpu_magic.core import process

    if notebook_pid is not None:
        end_with_parent(notebook_pid, controller_pid)

    process.set_environment(PROGRESS_VARIABLE, "1", "this engine's bars are drawn in the "
                            "notebook (hosts.progress)")
    connection = join_processes(coordinator, count, index, local_devices, timeout)
    shell = get_ipython()
    if shell is not None:
        shell.run_line_magic("load_ext", "tpu_magic")
    import jax

    return {"index": index, "host": socket.gethostname(), "pid": os.getpid(),
            "devices": jax.local_device_count(), "global": connection.replicas}


def end_with_parent(parent: int, controller: int | None = None, every: float = 1.0) -> bool:
    """Ends this engine's process when `parent`, the notebook's kernel that started it, is
    gone, and asks the cluster's `controller` (its pid; the kernel started it too) to end:
    a kernel killed (a restart, a runner's shutdown past its wait) runs no clean-up of its
    own, and its engines (each a process holding JAX and Keras) and controller would live
    on, their parent pid 1. Watched by a daemon thread; returns whether it watches (only where `parent` is this
    engine's parent, as for the local engines of `--simulate HxD`)."""
    import signal
    import threading
    import time

    if os.getppid() != parent:
        return False

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        if controller is not None and _is_ipyparallel(controller):
            try:
                os.kill(controller, signal.SIGTERM)  # it ends its schedulers itself
            except OSError:
                pass
        os._exit(0)  # the nanny ipyparallel gives an engine sees it go, and ends too

    threading.Thread(target=watch, name="tpu_magic-end-with-notebook", daemon=True).start()
    return True


def _is_ipyparallel(pid: int) -> bool:
    """Whether `pid` is still one of ipyparallel's processes (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"ipyparallel" in cmdline.read()
    except OSError:
        return False


def run_cell(line: str, cell: str, seed: int | None = None) -> HostOutcome:
    """`%%tpu_train line` with `cell` on this engine; its error, if any, with the cell's line.

    `seed`: the same on every host, drawn afresh for each cell by the notebook. Every process
    starts the cell from it (Python's, NumPy's and Keras's random state), so a model the cell
    builds without a seed, its Dropout and the cell's own random data are alike on every host,
    as one process of all the devices would have them (otherwise each process draws its own
    weights, and JAX refuses them: "passed to device_put is not the same on each process")."""
    from IPython import get_ipython
    import jax

    from tpu_magic.hosts import progress

    if seed is not None:
        import keras

        keras.utils.set_random_seed(seed)
    progress.start_cell()
    index, host = jax.process_index(), socket.gethostname()
    try:
        report = get_ipython().run_cell_magic("tpu_train", line, cell)
    except BaseException as exc:  # noqa: BLE001 - every error goes back to the notebook
        return HostOutcome(index, host, error=(type(exc).__name__, str(exc)),
                           line=cell_line(exc.__traceback__, cell))
    if getattr(report, "history", None) is not None:  # its logs, not the model it refers to
        report = dataclasses.replace(
            report, history=types.SimpleNamespace(history=dict(report.history.history)))
    return HostOutcome(index, host, report=report,
                       model_name=getattr(report, "model_name", None))


def cell_line(traceback: Any, cell: str) -> tuple[int, str] | None:
    """The last frame of a traceback that is a line of `cell` (its number counts from the
    line below the magic), or None."""
    lines = cell.splitlines()
    found = None
    while traceback is not None:
        number = traceback.tb_lineno
        text = linecache.getline(traceback.tb_frame.f_code.co_filename, number)
        if 0 < number <= len(lines) and text.strip() and text.strip() == lines[number - 1].strip():
            found = (number, lines[number - 1])
        traceback = traceback.tb_next
    return found


def model_state(name: str) -> dict:
    """The model `name` of this engine's namespace: its Keras config and weights, on process
    0. Called on every engine at once: a weight sharded across the hosts (`--shard model`
    with a mesh that spans them) is gathered whole, which takes every process; the others
    answer only that they took part."""
    from IPython import get_ipython
    import jax
    import keras
    from jax.experimental import multihost_utils

    model = get_ipython().user_ns.get(name)
    if not isinstance(model, keras.Model):
        return {"missing": True}
    weights = [np.asarray(value) if value.is_fully_addressable else
               multihost_utils.process_allgather(value, tiled=True)
               for value in (v.value for v in model.weights)]
    if jax.process_index() != 0:
        return {"gathered": True}
    from tpu_magic.core.variables import changing_weights

    changing = {id(v) for v in changing_weights(model)}  # what `--adapters` saves
    return {"config": keras.saving.serialize_keras_object(model),
            "weights": weights, "class": type(model).__name__,
            "paths": [v.path for v in model.weights],
            "changing": [i for i, v in enumerate(model.weights) if id(v) in changing]}
