"""Whether this host can hold a model's CPU copy: its gathered weights and the copy, against
the memory the host has free (`/proc/meminfo`, or a test's limit); refused before anything
is gathered."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tpu_magic.core.errors import SyncError

HOST_LIMIT_VARIABLE = "TPU_MAGIC_HOST_MEMORY_BYTES"  # the host's free memory, for tests


def refuse_if_too_big(model: Any, name: str) -> None:
    """A sharded model is gathered into host memory variable by variable, and then held twice
    (the gathered arrays and the CPU copy): refused first where that cannot fit.

    Raises:
        SyncError: twice the weights' bytes exceed 80 % of the host's free memory.
    """
    needed = 2 * sum(int(np.prod(w.shape)) * 4 for w in model.weights)
    free = _host_free_bytes()
    if free is not None and needed > 0.8 * free:
        raise SyncError(
            f"the CPU copy of {name!r} needs about {needed / 2**30:.2f} GiB of host memory (its "
            f"gathered weights and the copy), and this host has {free / 2**30:.2f} GiB free: "
            "nothing was copied. Keep training state with --checkpoint (LoRA models write their "
            "adapters only), or copy on a machine with more memory.")


def _host_free_bytes() -> float | None:
    if os.environ.get(HOST_LIMIT_VARIABLE):
        return float(os.environ[HOST_LIMIT_VARIABLE])
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None
