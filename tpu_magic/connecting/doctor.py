"""The runtime doctor: known traps of today's TPU, GPU and notebook images, each with its fix.

Pure logic over a `Runtime` (the environment, the installed and imported packages, the
machine's signs); `read_runtime` gathers one from this process without importing anything
heavy. `%tpu_connect --check` prints the findings, and a failed connect appends them to
its message. On its own, `python -m tpu_magic.connecting.doctor [--tpu] [--backend tf|jax]`
(in a notebook, `examine()`) prints what it looked at and what it found. The traps come from
the runtimes' published package lists and issue threads: keras-team/keras#19423 (the
backend is fixed when keras is imported), jax-ml/jax#13260 (TensorFlow imported first takes
the TPU from JAX), jax-ml/jax#10192 (a libtpu lock held by another process), and JAX's GPU
memory preallocation (75 % by default) beside TensorFlow.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

LIBTPU_LOCK = "/tmp/libtpu_lockfile"


@dataclass(frozen=True)
class Runtime:
    """What the doctor looks at.

    Attributes:
        env: the environment variables.
        installed: installed distributions and their versions.
        imported: which of "tensorflow", "jax", "keras" this process has imported.
        keras_backend: the backend of an imported keras ("tensorflow", "jax"), else None.
        tpu_vm: whether the machine shows TPU VM signs.
        gpu: whether the machine shows GPU device files.
        lock_holder: the process holding libtpu's lock file, e.g. "pid 4242 (python3)".
        keras_by_us: tpu_magic itself chose Keras's backend in this process (an earlier
            `%tpu_connect`), so no import of the user's fixed it.
    """

    env: Mapping[str, str] = field(default_factory=dict)
    installed: Mapping[str, str] = field(default_factory=dict)
    imported: frozenset[str] = frozenset()
    keras_backend: str | None = None
    tpu_vm: bool = False
    gpu: bool = False
    lock_holder: str | None = None
    keras_by_us: bool = False


@dataclass(frozen=True)
class Finding:
    """One trap found, and the one thing to do about it."""

    situation: str
    fix: str

    def __str__(self) -> str:
        return f"{self.situation}: {self.fix}"


def diagnose(runtime: Runtime, backend: str | None = None, wants_tpu: bool = False
             ) -> tuple[Finding, ...]:
    """The traps this runtime shows.

    Args:
        runtime: the facts (see `Runtime`).
        backend: the backend chosen or asked for ("tf" or "jax"), if known.
        wants_tpu: whether the user asked for a TPU (`local`, a TPU name or address).
    """
    return (_backend_traps(runtime, backend) + _tpu_traps(runtime, backend, wants_tpu)
            + _gpu_traps(runtime))


def _backend_traps(runtime: Runtime, backend: str | None) -> tuple[Finding, ...]:
    """Keras started on another backend than the one asked for."""
    found = []
    wanted_keras = {"tf": "tensorflow", "jax": "jax"}.get(backend or "")
    if runtime.keras_backend and wanted_keras and runtime.keras_backend != wanted_keras and \
            runtime.keras_by_us:
        found.append(Finding(
            f"an earlier %tpu_connect in this process started Keras on {runtime.keras_backend} "
            "(Keras fixes its backend when it is first imported)",
            "restart the runtime to use another backend; run the %tpu_connect you want first"))
    elif runtime.keras_backend and wanted_keras and runtime.keras_backend != wanted_keras:
        found.append(Finding(
            f"keras was imported with the {runtime.keras_backend} backend before %tpu_connect "
            "(Keras fixes its backend on import)",
            "restart the runtime and run `%load_ext tpu_magic` and `%tpu_connect` before "
            "`import keras`"))
    return tuple(found)


def _tpu_traps(runtime: Runtime, backend: str | None, wants_tpu: bool) -> tuple[Finding, ...]:
    """What keeps the TPU from this process: TensorFlow beside JAX, libtpu's lock, no TPU."""
    found = []
    env, installed = runtime.env, runtime.installed
    if runtime.tpu_vm and "tensorflow-tpu" in installed and "jax" in installed:
        found.append(Finding(
            f"tensorflow-tpu {installed['tensorflow-tpu']} is installed beside JAX on a TPU VM; "
            "whichever starts first takes the TPU",
            "`pip uninstall -y tensorflow-tpu` (Keras reaches the TPU through JAX; "
            "tensorflow-cpu beside JAX is fine)"))
    elif runtime.tpu_vm and "tensorflow" in installed and "jax" in installed:
        found.append(Finding(
            f"the full tensorflow {installed['tensorflow']} is installed beside JAX on a TPU VM, "
            "and can claim the TPU",
            "`pip uninstall -y tensorflow && pip install tensorflow-cpu` (TensorFlow for data "
            "pipelines only, as on Kaggle's TPU image)"))
    if runtime.tpu_vm and backend == "jax" and "tensorflow" in runtime.imported \
            and "tensorflow-cpu" not in installed:
        found.append(Finding(
            "TensorFlow was imported before JAX started and may hold the TPU",
            "restart the runtime and run `%tpu_connect` before importing tensorflow"))
    if runtime.lock_holder:
        found.append(Finding(
            f"libtpu's lock {LIBTPU_LOCK} is held by another process, {runtime.lock_holder}: "
            "only one process can use the TPU",
            f"end that process (`kill {runtime.lock_holder.split()[1]}`, or shut down the "
            "other notebook's kernel), or restart the runtime"))
    if wants_tpu and not runtime.tpu_vm:
        where = notebook_service(env)
        if where:
            found.append(Finding(
                f"no TPU is attached to this {where} runtime",
                "Runtime > Change runtime type > TPU, then run the notebook again"
                if where == "Colab" else
                "Settings > Accelerator > TPU VM v5e-8 (or v6e-8), then run the notebook again"))
    return tuple(found)


def _gpu_traps(runtime: Runtime) -> tuple[Finding, ...]:
    """JAX and TensorFlow on one GPU."""
    found = []
    env, installed = runtime.env, runtime.installed
    if runtime.gpu and "jax" in installed and any(
            n in installed for n in ("tensorflow", "tensorflow-tpu")) and \
            "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env and \
            env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() != "false":
        found.append(Finding(
            "JAX and TensorFlow share this GPU, and JAX takes 75 % of its memory when it starts",
            "set `XLA_PYTHON_CLIENT_MEM_FRACTION=0.5` (or `XLA_PYTHON_CLIENT_PREALLOCATE=false`) "
            "in the environment before JAX starts, e.g. `%env XLA_PYTHON_CLIENT_MEM_FRACTION=0.5` "
            "first in the notebook"))
    return tuple(found)


def notebook_service(env: Mapping[str, str]) -> str | None:
    """"Colab" or "Kaggle" where the environment says so, else None."""
    if "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env:
        return "Colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        return "Kaggle"
    return None


def read_runtime(tpu_vm: bool, gpu: bool, env: Mapping[str, str] | None = None,
                 installed: Mapping[str, str] | None = None) -> Runtime:
    """This process's `Runtime` (imports nothing heavy); `installed` where already read."""
    from tpu_magic.backends import imported_keras_backend
    from tpu_magic.core import process
    from tpu_magic.core.deps import installed_versions

    return Runtime(env=dict(os.environ if env is None else env),
                   installed=installed_versions() if installed is None else installed,
                   imported=frozenset(m for m in ("tensorflow", "jax", "keras") if m in sys.modules),
                   keras_backend=imported_keras_backend(), tpu_vm=tpu_vm, gpu=gpu,
                   lock_holder=lock_holder(),
                   keras_by_us="KERAS_BACKEND" in process.ENVIRONMENT_SET)


def lock_holder(lock: str = LIBTPU_LOCK, proc: Path = Path("/proc")) -> str | None:
    """Another process that has libtpu's lock file open, as "pid N (name)"; None if none."""
    if not os.path.exists(lock):
        return None
    target = os.path.realpath(lock)
    for entry in proc.glob("[0-9]*"):
        if entry.name == str(os.getpid()):
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.path.realpath(fd) == target:
                    name = (entry / "comm").read_text().strip()
                    return f"pid {entry.name} ({name})"
        except OSError:
            continue
    return None


def report(findings: tuple[Finding, ...], said: str = "") -> str:
    """The findings as lines for a message ("" when there are none), leaving out those the
    message (`said`) already names: a failed connect's own reason on Colab is "No TPU is
    attached to this Colab runtime", which the doctor would only repeat."""
    told = said.lower()
    return "".join(f"\n  doctor: {f}" for f in findings if f.situation.lower() not in told)


@dataclass(frozen=True)
class Examination:
    """The doctor run on its own: what it looked at, the version warnings, the findings."""

    runtime: Runtime
    machine: str
    warnings: tuple[str, ...]
    findings: tuple[Finding, ...]

    def summary(self) -> str:
        runtime = self.runtime
        installed = ", ".join(f"{k} {v}" for k, v in runtime.installed.items()) or "none"
        imported = ", ".join(sorted(runtime.imported)) or "none of tensorflow, jax, keras"
        if runtime.keras_backend:
            imported += f" (keras on {runtime.keras_backend})"
        lines = ["The runtime doctor", f"  machine: {self.machine}",
                 f"  installed: {installed}", f"  imported here: {imported}"]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  doctor: {f}" for f in self.findings]
        if not self.warnings and not self.findings:
            lines.append("  no known trap found")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython display
        p.text(self.summary())


def examine(backend: str | None = None, wants_tpu: bool = False,
            env: Mapping[str, str] | None = None) -> Examination:
    """The doctor on this process and machine, as `%tpu_connect --check` runs it, without
    connecting: `backend` ("tf", "jax"), where one is meant; `wants_tpu`, where a TPU is."""
    from tpu_magic.core.deps import version_warnings
    from tpu_magic.core.target import read_machine_signs

    signs = read_machine_signs()
    runtime = read_runtime(signs.tpu_vm, bool(signs.gpu_devices), env)
    tpu = (f"a TPU VM ({', '.join((signs.accel_devices + signs.vfio_groups)[:3]) or 'libtpu'})"
           if signs.tpu_vm else "no TPU VM signs (/dev/accel*, /dev/vfio, libtpu)")
    gpu = (f"GPU device files {', '.join(signs.gpu_devices[:3])}" if signs.gpu_devices
           else "no GPU device files (/dev/nvidia*)")
    service = notebook_service(runtime.env)
    machine = f"{tpu}; {gpu}" + (f"; a {service} runtime" if service else "")
    return Examination(runtime, machine, tuple(version_warnings(runtime.installed)),
                       diagnose(runtime, backend=backend, wants_tpu=wants_tpu))


def main(argv: list[str] | None = None) -> int:
    """`python -m tpu_magic.connecting.doctor`: prints the examination; exits 1 on a finding."""
    parser = argparse.ArgumentParser(
        prog="python -m tpu_magic.connecting.doctor",
        description="The known traps of this runtime (TPU, GPU, notebook images), each with "
                    "its fix. A process of its own imports nothing of the notebook's: there, "
                    "`%tpu_connect --check` (or doctor.examine()) also sees its imports.")
    parser.add_argument("--tpu", action="store_true", help="you mean to train on a TPU here")
    parser.add_argument("--backend", choices=("tf", "jax"),
                        help="the Keras backend you mean to use")
    args = parser.parse_args(argv)
    found = examine(args.backend, args.tpu)
    print(found.summary())
    return 1 if found.findings else 0


if __name__ == "__main__":
    sys.exit(main())
