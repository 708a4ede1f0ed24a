"""What is one per process, written here and nowhere else.

A notebook's kernel is one process, and the frameworks under it keep per-process state
that no shell or thread can have a copy of:

- **the connection** (`Connection`): TensorFlow's and JAX's runtimes hold one set of
  devices per process; every notebook shell in it trains on the same one. `%tpu_connect`
  replaces it (refused while any shell's panel job trains).
- **the hosts** (`hosts.cluster.Hosts`): the ipyparallel engines a notebook trains on, one
  a host; `%tpu_connect --hosts/--simulate HxD` replaces them.
- **TensorFlow's TPU system**: TensorFlow initializes one TPU system per process and cannot
  take a second address without a restart.
- **TensorFlow's mirrored strategies**: one per device set. A second strategy over the same
  devices restarts the collective instance keys, and its first all-reduce fails ("Shape
  mismatch in the collective instance") against shapes the runtime cached.
- **environment variables a framework reads once, at import** (`KERAS_BACKEND`,
  `XLA_FLAGS`, `PJRT_NPROC`, `TF_CPP_MIN_LOG_LEVEL`): set before the import they steer,
  recorded with the reason in `ENVIRONMENT_SET`.

Only the notebook's thread writes these (connects, and the magics before a framework is
imported); a panel job reads them.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

_lock = threading.Lock()
_connection: Any = None
_hosts: Any = None
_tpu_system: str | None = None
_strategies: dict[tuple[str, ...], Any] = {}
ENVIRONMENT_SET: dict[str, str] = {}  # variable → why tpu_magic set it


def connection() -> Any:
    """The process's `Connection`, or None before `%tpu_connect`."""
    return _connection


def set_connection(new: Any) -> None:
    """Replaces the process's connection (a connect, or None to forget it)."""
    global _connection
    with _lock:
        _connection = new


def hosts() -> Any:
    """The process's several-hosts connection (`hosts.cluster.Hosts`), or None: the engines
    a notebook drives are one set per kernel, like its devices."""
    return _hosts


def set_hosts(new: Any) -> None:
    global _hosts
    with _lock:
        _hosts = new


def tpu_system() -> str | None:
    """The TPU address TensorFlow initialized in this process, if any."""
    return _tpu_system


def set_tpu_system(address: str | None) -> None:
    global _tpu_system
    with _lock:
        _tpu_system = address


def strategy_for(devices: tuple[str, ...], make: Callable[[], Any]) -> Any:
    """The process's strategy over `devices`, made by `make` the first time."""
    with _lock:
        if devices not in _strategies:
            _strategies[devices] = make()
        return _strategies[devices]


def set_environment(name: str, value: str, why: str, keep_users: bool = False) -> None:
    """Sets an environment variable a framework reads at import, recording why.

    Args:
        keep_users: leave a value the user set (the user's choice stands).
    """
    if keep_users and name in os.environ:
        return
    os.environ[name] = value
    ENVIRONMENT_SET[name] = why
