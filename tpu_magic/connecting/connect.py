"""Connecting to an accelerator: the distribution strategy for a `Target`.

`connect()` validates everything it can before TensorFlow or JAX is imported, bounds
every network step (see `probe`), chooses the backend (see `backends`), lets that
backend connect, and returns a `ConnectResult`. It keeps one `Connection` per process
(`tpu_magic.session()`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tpu_magic import backends
from tpu_magic.connecting import doctor, probe
from tpu_magic.backends import choose_backend, configured_keras_backend, imported_keras_backend, \
    importable_modules, keras_json, later_sessions_note, select
from tpu_magic.core.deps import installed_versions
from tpu_magic.core.errors import AddressError, ConnectError, MissingDependencyError
from tpu_magic.core import process
from tpu_magic.core.session import Connection, session
from tpu_magic.core.target import MachineSigns, Target, parse_grpc_address, \
    no_tpu_fix, read_machine_signs, resolve_target

MAX_SIMULATED = 256


@dataclass(frozen=True)
class ConnectResult:
    """The outcome of `%tpu_connect`."""

    target: str
    kind: str
    replicas: int
    strategy_name: str
    simulated: bool
    reason: str
    devices: tuple[str, ...]
    seconds: float
    reused: bool = False
    notes: tuple[str, ...] = ()
    check: Any = None  # a `DeviceCheck` with --check
    backend: str = "tf"
    framework: str = "TensorFlow"

    def summary(self) -> str:
        what = (
            f"simulated {self.replicas}-core TPU on the CPU" if self.simulated
            else f"{self.kind.upper()} {self.target}" if self.kind == "tpu"
            else self.kind.upper()
        )
        head = "Reusing the connection" if self.reused else "Connected"
        lines = [
            f"{head}: {what} — {self.strategy_name}"
            f" (Keras on {self.framework}), {self.replicas} "
            f"replica{'s' if self.replicas != 1 else ''} ({self.seconds:.2f} s)",
            f"  why: {self.reason}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        if self.check is not None:
            lines.append(self.check.summary())
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython display
        p.text(self.summary())


def connect(
    target: str = "auto",
    *,
    simulate: int | None = None,
    timeout: float = 30.0,
    backend: str = "auto",
    compile_cache: str | None = None,
    env: Mapping[str, str] | None = None,
    signs: MachineSigns | None = None,
    probe_tf: Callable[[str, float], int] = probe.probe_tf_connect,
) -> ConnectResult:
    """Connects to the accelerator named by `target` and makes it the session.

    Args:
        target: "auto", "local", "grpc://HOST:PORT", a TPU name, "gpu" or "cpu".
        simulate: split the CPU into this many logical devices and replicate over them.
        timeout: seconds a TPU node may take to answer.
        backend: the Keras backend, "tf", "jax" or "auto" (see `backends.choose_backend`).
        compile_cache: JAX's persistent compilation cache: a directory, "off", or None to
            choose one that outlives the process (see `backends.jax.compile_cache`); JAX only.
        env: environment to decide `auto` from (default `os.environ`).
        signs: machine signs for `auto` (default: read from this machine).
        probe_tf: the bounded TensorFlow connect check for TPU nodes.

    Returns:
        A `ConnectResult`.

    Raises:
        AddressError: a malformed target or option.
        ConnectError: the accelerator cannot be reached or set up.
        MissingDependencyError: TensorFlow is not installed.

    A connect that fails says, after its own reason, what the runtime doctor finds (see
    `doctor`): the known traps of this runtime, each with its fix.
    """
    env = os.environ if env is None else env
    signs = read_machine_signs() if signs is None else signs
    try:
        return _connect(target, simulate, timeout, backend, compile_cache, env, signs, probe_tf)
    except (ConnectError, MissingDependencyError) as exc:
        wants_tpu = simulate is None and target.strip().lower() not in ("auto", "cpu", "gpu")
        findings = doctor.diagnose(doctor.read_runtime(signs.tpu_vm, bool(signs.gpu_devices), env),
                                   backend=None if backend == "auto" else backend,
                                   wants_tpu=wants_tpu)
        said = doctor.report(findings, str(exc))
        if not said:
            raise
        raise type(exc)(str(exc) + said) from None


def _connect(target: str, simulate: int | None, timeout: float, backend: str,
             compile_cache: str | None, env: Mapping[str, str], signs: MachineSigns,
             probe_tf: Callable[[str, float], int]) -> ConnectResult:
    """`connect` with its environment and machine signs read."""
    start = time.monotonic()
    if not timeout > 0:
        raise AddressError(f"--timeout {timeout:g} must be a positive number of seconds, e.g. 30")
    if simulate is not None:
        if not 1 <= simulate <= MAX_SIMULATED:
            raise AddressError(
                f"--simulate {simulate} must be between 1 and {MAX_SIMULATED}, e.g. --simulate 8"
            )
        if target.strip().lower() not in ("auto", "cpu"):
            raise AddressError(
                f"--simulate rehearses on the CPU, so it takes no target ({target!r}): "
                f"use `%tpu_connect --simulate {simulate}`"
            )
        chosen = Target("cpu", None, f"--simulate {simulate}: {simulate} logical CPU devices")
    if simulate is None:
        chosen = resolve_target(target, env, signs)
    installed = installed_versions()
    # a KERAS_BACKEND tpu_magic set itself (`%load_ext`, an earlier connect) is not the user's
    users = {k: v for k, v in env.items()
             if not (k == "KERAS_BACKEND" and k in process.ENVIRONMENT_SET)}
    importable = importable_modules()
    choice = choose_backend(backend, imported_keras_backend(), users, signs.tpu_vm,
                            installed, importable, configured_keras_backend(env))
    chosen_backend = backends.get(choice.backend)
    if choice.reason != "the default":
        chosen = Target(chosen.kind, chosen.address, f"{chosen.reason}; Keras on "
                        f"{chosen_backend.label} ({choice.reason})", chosen.notes)

    current = session()
    if current is not None and current.backend.name == choice.backend and \
            _same(current, chosen, simulate):
        return _result(current, chosen, start, reused=True)
    # Everything that can be told without a framework is told before one is imported: an
    # import here would fix Keras's backend for the process, and later connects with it.
    refused = chosen_backend.refuses(chosen, simulate)
    if refused:
        raise ConnectError(refused)
    if chosen.kind == "tpu" and backends.tensorflow_took_a_jax_tpu(choice, signs.tpu_vm,
                                                                   installed):
        raise ConnectError(imported_first(choice.backend, env))
    select(choice)
    new, chosen = chosen_backend.connect(
        chosen, simulate, explicit_gpu=target.strip().lower() == "gpu",
        compile_cache=compile_cache, env=env,
        probe_node=lambda node: _probe_node(node, timeout, probe_tf))
    process.set_connection(new)
    # read after connecting: Keras writes keras.json, with its default, on its first import
    later = later_sessions_note(choice.backend, users, configured_keras_backend(env),
                                importable, keras_json(env, shown=True))
    if later:
        chosen = Target(chosen.kind, chosen.address, chosen.reason, chosen.notes + (later,))
    return _result(new, chosen, start)


def imported_first(backend: str, env: Mapping[str, str]) -> str:
    """Keras was imported with TensorFlow before `%tpu_connect` on a TPU VM where only JAX
    has the TPU runtime (Kaggle's image: jax[tpu] beside tensorflow-cpu)."""
    restart = {"Kaggle": "Run > Restart & clear cell outputs",
               "Colab": "Runtime > Restart session"}.get(doctor.notebook_service(env) or "",
                                                         "restart the runtime")
    return ("keras was imported with the TensorFlow backend before %tpu_connect, and on this "
            "TPU VM only JAX can use the TPU (TensorFlow here has no TPU runtime). Restart "
            f"({restart}), then run `%load_ext tpu_magic` and `%tpu_connect` first, before "
            "`import keras` or `import tensorflow`: Keras then runs on JAX.")


def _probe_node(chosen: Target, timeout: float, probe_tf: Callable[[str, float], int]) -> int:
    """The bounded checks of a remote TPU: TCP first (fails fast), then TensorFlow's connect."""
    if chosen.address.lower().startswith("grpc://"):
        host, port = parse_grpc_address(chosen.address)
        probe.probe_tcp(host, port, timeout)
    return probe_tf(chosen.address, timeout)


def check_target(
    target: str,
    timeout: float = 30.0,
    *,
    env: Mapping[str, str] | None = None,
    signs: MachineSigns | None = None,
    probe_tf: Callable[[str, float], int] = probe.probe_tf_connect,
) -> str:
    """Whether `target` could be connected to, without connecting (the panel's Check button).

    Returns:
        One line saying what answered and how to connect to it.

    Raises:
        AddressError: a malformed target.
        ConnectError: nothing usable answers there.
    """
    text = target.strip() or "auto"
    if not timeout > 0:
        raise AddressError(f"timeout {timeout:g} must be a positive number of seconds, e.g. 30")
    signs = read_machine_signs() if signs is None else signs
    chosen = resolve_target(text, os.environ if env is None else env, signs)
    start = time.monotonic()
    if chosen.is_tpu_node:
        cores = _probe_node(chosen, timeout, probe_tf)
        return (f"{chosen.address} answers: a TPU with {cores} cores "
                f"({time.monotonic() - start:.1f} s). Connect: %tpu_connect {chosen.address}")
    if chosen.kind == "tpu":
        if not signs.tpu_vm:
            raise ConnectError(no_tpu_fix(os.environ if env is None else env))
        return "this is a TPU VM (local TPU found). Connect: %tpu_connect local"
    if chosen.kind == "gpu":
        if not signs.gpu_devices:
            raise ConnectError("this machine has no GPU device files (/dev/nvidia*): in Colab "
                               "choose Runtime > Change runtime type > a GPU")
        return f"GPU found ({', '.join(signs.gpu_devices[:3])}). Connect: %tpu_connect gpu"
    if text.lower() == "auto":
        return f"auto chooses the CPU: {chosen.reason}. Connect: %tpu_connect"
    return "the CPU is always there. Connect: %tpu_connect cpu"


def _same(current: Connection, chosen: Target, simulate: int | None) -> bool:
    if simulate is not None:
        return current.simulated and current.replicas == simulate
    return not current.simulated and current.target == chosen.label


def _result(s: Connection, chosen: Target, start: float, reused: bool = False) -> ConnectResult:
    return ConnectResult(
        target=s.target, kind=s.kind, replicas=s.replicas,
        strategy_name=s.strategy_name, simulated=s.simulated,
        reason=chosen.reason, devices=s.devices, seconds=time.monotonic() - start,
        reused=reused, notes=chosen.notes, backend=s.backend.name, framework=s.backend.label,
    )
