"""Which accelerator to connect to: parsing a TARGET and the `auto` decision.

Pure logic, no TensorFlow and no network: `auto` decides from the environment
variables and from files on the machine, never by probing an address.
"""

from __future__ import annotations

import glob
import importlib.util
import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Mapping

from tpu_magic.core.errors import AddressError

ACCEPTED_FORMS = (
    "auto, local (TPU VM), grpc://HOST:PORT (TPU node), a TPU name such as my-tpu, gpu, cpu"
)

# Cloud TPU names: lowercase letters, digits and hyphens, starting with a letter.
_TPU_NAME = re.compile(r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$")
_HOSTNAME_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


NO_TPU_FIX = (
    "No TPU is attached to this runtime. In Colab: Runtime > Change runtime type > a TPU "
    "(Kaggle: Settings > Accelerator > TPU), then `%tpu_connect local`. On a TPU VM today's "
    "TPU path is JAX (`pip install \"jax[tpu]\"`, then `%tpu_connect local --backend jax`); "
    "TensorFlow there needs its TPU build instead (`pip install tensorflow-tpu`, same version "
    "as tensorflow, never beside JAX's libtpu), then restart. "
    "To rehearse without a TPU: `%tpu_connect --simulate 8`."
)
REHEARSE = "`%tpu_connect --simulate 8`"


def no_tpu_fix(env: Mapping[str, str], rehearse: str = REHEARSE) -> str:
    """`NO_TPU_FIX` with the platform's own menu first, where the environment names it.
    `rehearse`: how to rehearse from here (a line that works next in this process)."""
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        fix = ("No TPU is attached to this Kaggle session: Settings > Accelerator > TPU VM "
               "v5e-8 (or v6e-8), then run the notebook again. To rehearse without a TPU: "
               f"{REHEARSE}.")
    elif "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env:
        fix = ("No TPU is attached to this Colab runtime: Runtime > Change runtime type > a "
               "TPU, then run the notebook again. To rehearse without a TPU: "
               f"{REHEARSE}.")
    else:
        fix = NO_TPU_FIX
    return fix.replace(REHEARSE, rehearse)


def no_gpu_fix(framework: str, env: Mapping[str, str], gpu_devices: tuple[str, ...],
               gpu_build: str) -> str:
    """Why `framework` ("JAX", "TensorFlow") finds no GPU, from the machine's GPU device
    files: none (the platform's menu, where the environment names it), or a GPU that the
    installed build cannot use (`gpu_build`: the install command of one that can)."""
    if gpu_devices:
        return (f"This machine has a GPU ({', '.join(gpu_devices[:3])}), but the installed "
                f"{framework} has no GPU support: {gpu_build}, then restart the runtime.")
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        menu = "Settings > Accelerator > a GPU"
    elif "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env:
        menu = "Runtime > Change runtime type > a GPU"
    else:
        menu = "in Colab: Runtime > Change runtime type > a GPU; on Kaggle: Settings > " \
               "Accelerator > a GPU"
    return (f"No GPU is attached to this runtime (no /dev/nvidia* device files): {menu}, "
            "then run the notebook again. Without one: `%tpu_connect cpu`, or "
            "`%tpu_connect --simulate 8` to rehearse a TPU.")


@dataclass(frozen=True)
class Target:
    """A validated connect target.

    Attributes:
        kind: "tpu", "gpu" or "cpu".
        address: for a TPU, what the cluster resolver gets ("local",
            "grpc://HOST:PORT" or a TPU name); None otherwise.
        reason: why this target was chosen, in words (for `auto`).
        notes: remarks for the user, e.g. about an obsolete variable.
    """

    kind: str
    address: str | None = None
    reason: str = "named explicitly"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_tpu_node(self) -> bool:
        """True for a remote TPU reached over gRPC (address or TPU name)."""
        return self.kind == "tpu" and self.address != "local"

    @property
    def label(self) -> str:
        """The target as a user would type it."""
        return self.address if self.kind == "tpu" else self.kind


@dataclass(frozen=True)
class MachineSigns:
    """What the machine shows of its accelerators, read without touching the network."""

    accel_devices: tuple[str, ...] = ()
    vfio_groups: tuple[str, ...] = ()
    libtpu_importable: bool = False
    gpu_devices: tuple[str, ...] = ()

    @property
    def tpu_vm(self) -> bool:
        return bool(self.accel_devices or self.vfio_groups or self.libtpu_importable)


def read_machine_signs() -> MachineSigns:
    """Looks for TPU VM and GPU device files and for an importable libtpu."""
    vfio = tuple(p for p in sorted(glob.glob("/dev/vfio/*")) if os.path.basename(p) != "vfio")
    return MachineSigns(
        accel_devices=tuple(sorted(glob.glob("/dev/accel*"))),
        vfio_groups=vfio,
        libtpu_importable=importlib.util.find_spec("libtpu") is not None,
        gpu_devices=tuple(sorted(glob.glob("/dev/nvidia[0-9]*"))),
    )


def parse_grpc_address(text: str) -> tuple[str, int]:
    """Splits and validates ``grpc://HOST:PORT``.

    Returns:
        (host, port), host without IPv6 brackets.

    Raises:
        AddressError: the scheme, host or port is not valid.
    """
    rest = text[len("grpc://"):]
    if rest.startswith("["):
        host, sep, port_text = rest[1:].partition("]:")
        if not sep:
            raise AddressError(f"TPU address {text!r} has no port: use grpc://[IPV6]:8470")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"TPU address {text!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep or not host:
            raise AddressError(
                f"TPU address {text!r} needs a host and a port: use grpc://HOST:PORT, "
                "e.g. grpc://10.0.0.2:8470"
            )
        if not _valid_host(host):
            raise AddressError(f"TPU address {text!r}: {host!r} is not a valid host name or IP")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise AddressError(
            f"TPU address {text!r}: port {port_text!r} is not a number from 1 to 65535"
        )
    return host, int(port_text)


def _valid_host(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host):  # looks numeric but is not a valid IPv4
        return False
    return len(host) <= 253 and all(_HOSTNAME_LABEL.match(p) for p in host.split("."))


def parse_target(text: str) -> Target:
    """Validates an explicit TARGET (anything but ``auto``).

    Raises:
        AddressError: naming the value and the accepted forms.
    """
    value = text.strip()
    lowered = value.lower()
    if lowered in ("cpu", "gpu"):
        return Target(kind=lowered)
    if lowered == "local":
        return Target(kind="tpu", address="local")
    if lowered.startswith("grpc://"):
        parse_grpc_address(value)
        return Target(kind="tpu", address=value)
    if "://" in value:
        scheme = value.split("://", 1)[0]
        raise AddressError(
            f"target {value!r} has the scheme {scheme!r}; a TPU node is reached over gRPC: "
            f"grpc://HOST:PORT. Accepted: {ACCEPTED_FORMS}"
        )
    if ":" in value:
        raise AddressError(
            f"target {value!r} has no scheme: write grpc://{value}. Accepted: {ACCEPTED_FORMS}"
        )
    if _TPU_NAME.match(value):
        return Target(kind="tpu", address=value)
    raise AddressError(f"target {value!r} is not valid. Accepted: {ACCEPTED_FORMS}")


def resolve_target(
    text: str, env: Mapping[str, str], signs: MachineSigns
) -> Target:
    """Turns a TARGET into a `Target`; ``auto`` decides from env and machine signs.

    The ``auto`` order: ``TPU_NAME``; TPU VM signs (``/dev/accel*``, ``/dev/vfio``
    groups, an importable ``libtpu``); GPU device files; the CPU. A legacy
    ``COLAB_TPU_ADDR`` is not used: it gets a note that it is obsolete.

    Raises:
        AddressError: for a malformed explicit target or ``TPU_NAME``.
    """
    if text.strip().lower() != "auto":
        return parse_target(text)
    notes: list[str] = []
    if env.get("COLAB_TPU_ADDR"):
        notes.append(
            f"COLAB_TPU_ADDR={env['COLAB_TPU_ADDR']} is obsolete: Colab TPUs are TPU VMs now, "
            "reached with `%tpu_connect local` (Runtime > Change runtime type > TPU)."
        )
    tpu_name = env.get("TPU_NAME", "").strip()
    if tpu_name:
        found = parse_target(tpu_name if tpu_name != "local" else "local")
        if found.kind != "tpu":
            raise AddressError(f"TPU_NAME={tpu_name!r} does not name a TPU. Accepted: {ACCEPTED_FORMS}")
        return Target("tpu", found.address, f"TPU_NAME is set to {tpu_name!r}", tuple(notes))
    if signs.tpu_vm:
        seen = signs.accel_devices + signs.vfio_groups
        why = ", ".join(seen[:3]) if seen else "libtpu is importable"
        return Target("tpu", "local", f"this is a TPU VM ({why})", tuple(notes))
    if signs.gpu_devices:
        return Target("gpu", None, f"GPU device files found ({', '.join(signs.gpu_devices[:3])})",
                      tuple(notes))
    return Target(
        "cpu", None, "no TPU_NAME, no TPU VM signs (/dev/accel*, /dev/vfio, libtpu) and no GPU",
        tuple(notes),
    )
