"""A memory plan before the first step (`--shard model`, `--plan-for CHIP`): what one
device will hold during a training step, from the compiler, set against its memory.

The backend lowers Keras's own train step for the mesh in force and compiles it from
abstract inputs (`Backend.step_memory`): nothing runs and nothing is allocated. When the
step fits (with `HEADROOM` to spare) the report gets one line; when it does not, training
is refused before it starts, the weights untouched, with the biggest term named and the
fixes in order with what each saves. `--plan-for v5e-8` plans for hardware you do not have:
on 8 simulated CPU devices, against a v5e's HBM; XLA:CPU lays memory out differently from
the TPU's compiler, which the line says.
"""

from __future__ import annotations

import os
from typing import Any

from tpu_magic.core.chips import Chip
from tpu_magic.core.devices import StepMemory
from tpu_magic.core.errors import MemoryPlanError

HEADROOM = 0.9  # a step may take this share of a device's memory
LIMIT_VARIABLE = "TPU_MAGIC_DEVICE_MEMORY_BYTES"  # a device's memory, for tests and odd runtimes
_GIB = 2.0 ** 30


def device_bytes(connection: Any, planned: tuple[Chip, int] | None) -> float | None:
    """A device's memory: a test's limit, the planned chip's HBM, else the runtime's."""
    if os.environ.get(LIMIT_VARIABLE):
        return float(os.environ[LIMIT_VARIABLE])
    if planned is not None:
        return planned[0].device_memory_gib * _GIB
    memory = connection.backend.device_view(connection, {}).memory
    return memory.total_gib * _GIB if memory and memory.total_gib else None


def before_fit(connection: Any, model: Any, batch: Any,
               planned: tuple[Chip, int] | None) -> str | None:
    """The plan's line for the report, from the fit's first batch (None: the backend cannot
    plan, or no batch to plan from).

    Raises:
        MemoryPlanError: the step will not fit a device (nothing has run).
    """
    if batch is None:
        return None
    memory = connection.backend.step_memory(model, batch)
    if memory is None:
        return None
    total = device_bytes(connection, planned)
    where = f"per {planned[0].name} device" if planned else "per device"
    if total is not None and memory.peak > HEADROOM * total:
        raise MemoryPlanError(refusal(memory, total, where))
    return line(memory, total, where)


def choose(connection: Any, model: Any, batch: Any, planned: tuple[Chip, int] | None,
           owners: Any = None
           ) -> tuple[Any, tuple[int, int] | None, str | None]:
    """`--shard auto`: data parallel where its step fits a device with headroom, else the
    fewest model columns M (a divisor of the devices) whose step fits, the data rows taking
    the rest; each planned from abstract inputs shaped as the fit's first `batch`, before
    anything runs.

    Returns:
        (the connection to train on, its mesh (None: data parallel), the plan's line).

    Raises:
        MemoryPlanError: not even the most model columns fit (the fixes named).
    """
    if batch is None:  # no batch to plan from: data parallel, planned at a later fit
        return connection, None, None
    memory = connection.backend.step_memory(model, batch)
    if memory is None:  # a backend that plans no memory (TensorFlow): data parallel, said
        return connection, None, (f"--shard auto: data parallel ({connection.strategy_name}); "
                                  "Keras on this backend plans no memory and lays out "
                                  "no model columns: that needs Keras on JAX")
    total = device_bytes(connection, planned)
    where = f"per {planned[0].name} device" if planned else "per device"
    if total is None or memory.peak <= HEADROOM * total:
        return connection, None, line(memory, total, where) + "; --shard auto: data parallel"
    devices = connection.replicas
    for columns in [m for m in range(2, devices + 1) if devices % m == 0]:
        candidate = connection.backend.model_parallel(connection, devices // columns, columns,
                                                      owners)
        memory = connection.backend.step_memory(model, batch, candidate)
        if memory.peak <= HEADROOM * total:
            mesh = (devices // columns, columns)
            return candidate, mesh, (line(memory, total, where) + f"; --shard auto: data "
                                     f"parallel needs more, so model columns, mesh "
                                     f"{mesh[0]}x{mesh[1]}")
    raise MemoryPlanError(refusal(memory, total, where + f" even on a 1x{devices} mesh"))


def line(memory: StepMemory, total: float | None, where: str) -> str:
    parts = (f"weights {_gib(memory.weights)}, optimizer {_gib(memory.optimizer)}, "
             f"activations and gradients {_gib(memory.temporaries)}, batch {_gib(memory.batch)}")
    of = f" of {_gib(total)}" if total else ""
    text = f"memory plan: {_gib(memory.peak)}{of} GiB {where} ({parts})"
    if memory.compiled_on == "cpu":
        text += ("; planned by XLA on this machine's CPU devices, whose layout of memory "
                 "differs from a TPU's or GPU's compiler: take it as ±30 %")
    return text


def refusal(memory: StepMemory, total: float, where: str) -> str:
    """Why the step will not fit, its biggest term, and the fixes in order with savings."""
    terms = {"the weights": memory.weights, "the optimizer's state": memory.optimizer,
             "activations and gradients": memory.temporaries, "the batch": memory.batch}
    biggest = max(terms, key=terms.get)
    fixes = [
        ("`--precision bf16` (bfloat16 variables, not mixed_bfloat16's float32 ones)",
         (memory.weights + memory.optimizer) / 2),
        ("LoRA (`layer.enable_lora(4)`): only the adapters train, so the optimizer's state "
         "shrinks to theirs", memory.optimizer * 0.95),
        ("half the batch or a shorter sequence", (memory.temporaries + memory.batch) / 2),
        ("`with keras.RematScope(mode=\"full\"):` around the model's layers (recompute "
         "activations in the backward pass)", memory.temporaries / 2),
        ("`--shard model` with twice the model columns (`--mesh`)",
         (memory.weights + memory.optimizer) / 2),
    ]
    fixes.sort(key=lambda fix: -fix[1])
    listed = "; ".join(f"{fix} saves about {_gib(saving)} GiB" for fix, saving in fixes)
    return (f"memory plan: a training step needs {_gib(memory.peak)} GiB {where}, more than "
            f"{100 * HEADROOM:.0f} % of its {_gib(total)} GiB; the biggest part is {biggest} "
            f"({_gib(terms[biggest])} GiB). Nothing has run and the weights are untouched. "
            f"Fixes, largest saving first: {listed}.")


def _gib(count: float) -> str:
    return f"{count / _GIB:.3g}" if count >= 0.01 * _GIB else f"{count / _GIB:.2g}"
