"""Bounded reachability checks for a TPU node, before TensorFlow sees the address.

Once `tf.config.experimental_connect_to_cluster` is called on a dead address it
retries for ever, Ctrl-C does nothing, and TensorFlow stays frozen process-wide even
if the call ran in a thread. So an address is first tried
with a plain TCP connect, then TensorFlow's own connect runs in a short-lived
subprocess with a deadline; the kernel connects in-process only when both worked.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

from tpu_magic.core.errors import ConnectError

# TensorFlow's import alone takes seconds; it is not counted against --timeout.
IMPORT_DEADLINE_S = 120.0

_CONNECT_SCRIPT = """
import sys
import tensorflow as tf
print("imported", flush=True)
resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=sys.argv[1])
tf.config.experimental_connect_to_cluster(resolver)
print("devices", len(tf.config.list_logical_devices("TPU")), flush=True)
"""


def probe_tcp(host: str, port: int, timeout: float) -> float:
    """Opens and closes a TCP connection.

    Returns:
        Seconds the connect took.

    Raises:
        ConnectError: refused, unreachable, or no answer within `timeout`.
    """
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        raise ConnectError(
            f"TPU node {host}:{port} refused the connection: nothing listens there. "
            "Check the address (TPU nodes listen on port 8470), or on a TPU VM use "
            "`%tpu_connect local`."
        ) from None
    except (socket.timeout, TimeoutError):
        raise ConnectError(
            f"TPU node {host}:{port} did not answer within {timeout:g} s. Check that the TPU "
            "is running and reachable from this runtime, or raise --timeout."
        ) from None
    except OSError as exc:
        raise ConnectError(f"TPU node {host}:{port} cannot be reached: {exc}") from None
    return time.monotonic() - start


def probe_tf_connect(address: str, timeout: float, python: str = sys.executable) -> int:
    """Runs TensorFlow's cluster connect in a subprocess that is killed at a deadline.

    Args:
        address: what `TPUClusterResolver(tpu=...)` gets.
        timeout: seconds allowed for the connect, counted after TensorFlow imported.
        python: the interpreter to run.

    Returns:
        The number of TPU devices the subprocess saw.

    Raises:
        ConnectError: the connect failed or did not finish in time.
    """
    proc = subprocess.Popen(
        [python, "-c", _CONNECT_SCRIPT, address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    try:
        line = _read_line(proc, IMPORT_DEADLINE_S)
        if line != "imported":
            raise ConnectError(_failure(address, proc, "TensorFlow could not start"))
        line = _read_line(proc, timeout)
        if line is None and proc.poll() is None:
            raise ConnectError(
                f"TPU at {address} accepted the connection but TensorFlow's connect did not "
                f"finish within {timeout:g} s: it is not a TPU, or it is busy or broken. "
                "Check the address, or raise --timeout."
            )
        if not line or not line.startswith("devices "):
            raise ConnectError(_failure(address, proc, "TensorFlow could not connect"))
        return int(line.split()[1])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _read_line(proc: subprocess.Popen, timeout: float) -> str | None:
    """One line of the subprocess's stdout, or None at EOF or the deadline."""
    ready, _, _ = select.select([proc.stdout], [], [], max(timeout, 0.0))
    if not ready:
        return None
    raw = proc.stdout.readline()
    return raw.decode(errors="replace").strip() or None


def _failure(address: str, proc: subprocess.Popen, what: str) -> str:
    try:
        proc.wait(timeout=5)
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
    except subprocess.TimeoutExpired:
        err = []
    last = err[-1] if err else "no error text"
    return f"{what} for TPU {address}: {last}"
