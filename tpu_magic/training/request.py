"""A cell's request: every flag of `%%tpu_train` (or the panel's Train) read and checked
once, into one frozen value, before anything runs.

The first step of a cell's one way through (request → placement → run → report): the
magic, the panel's job and a host's engine build a `TrainRequest` with `read_request`, and
nothing after it parses a flag again. The magic's flags with its defaults in place
(`flag_values`) are what each host's engine gets too, as a line (`as_line`): the hosts read
the same request, the notebook's `%config TpuMagics...` defaults among it. The shard mode is an enum, the mesh integers, the
chip planned for a `Chip`, the batch a `BatchPlan` over the data rows it will split into.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Mapping

from tpu_magic.core.batching import BatchPlan, plan_batches
from tpu_magic.core.chips import Chip, chip_for
from tpu_magic.core.errors import FlagError, MemoryPlanError, ShardError


class Shard(enum.Enum):
    """`--shard`: how the devices hold the model."""

    DATA = "data"    # replicate the model, split the batch
    MODEL = "model"  # also split the model's large variables over the mesh's columns
    AUTO = "auto"    # data where the memory plan fits a device, else the fewest columns


@dataclass(frozen=True)
class TrainRequest:
    """What a cell asked for, checked.

    Attributes:
        batch: `--batch-size` over the data rows (None: each call's own batch).
        epochs: `--epochs` (None: each fit's own).
        scale_lr: `--scale-lr`.
        steps_per_execution: `--steps-per-execution K` (None: auto, the default: the
            model's own where it has one, else chosen from a measured step: `fit.steps`).
        progress: whether bars show.
        checkpoint / keep / resume: `--checkpoint DIR`, `--keep K`, `--resume`.
        precision: the dtype policy `--precision` chose for this connection (None: Keras's
            policy as it is).
        shard: `--shard`; mesh: `--shard model`'s (data rows, model columns), else None.
        plan_for: `--plan-for CHIP-N`: the chip and its device count.
        verify: `--verify`: the first step against the same step on one device.
        measured_tflops: one device's matmul TFLOP/s from `--check`, if it ran.
        memory: `--memory`: "auto" (a step that does not fit runs in the form the plan
            chooses: micro-batches, rematerialized blocks) or "off" (it is refused).
        microbatches: `--microbatches N` (None: the plan's choice, auto).
        remat: `--remat on|off` (None: the plan's choice, auto).
    """

    batch: BatchPlan | None = None
    epochs: int | None = None
    scale_lr: bool = False
    steps_per_execution: int | None = None
    progress: bool = True
    checkpoint: str | None = None
    keep: int = 2
    resume: bool = False
    precision: Any = None  # a `precision.Precision`
    shard: Shard = Shard.DATA
    mesh: tuple[int, int] | None = None
    plan_for: tuple[Chip, int] | None = None
    verify: bool = True
    measured_tflops: float | None = None
    memory: str = "auto"
    microbatches: int | None = None
    remat: bool | None = None

    @property
    def batch_size(self) -> int | None:
        return None if self.batch is None else self.batch.global_batch


# `%%tpu_train`'s flags by argparse's names (what `read_request` takes, but for
# `no_progress`), in the order the magic lists them. Flags that take no value:
TRAIN_FLAGS = ("batch_size", "epochs", "scale_lr", "steps_per_execution", "checkpoint", "keep",
               "resume", "precision", "shard", "mesh", "plan_for", "memory", "microbatches",
               "remat", "verify", "no_progress")
SWITCHES = frozenset({"scale_lr", "resume", "no_progress"})


def flag_values(parsed: Mapping[str, Any], *, precision: str | None = None,
                shard: str | None = None, verify: Any = "on") -> dict:
    """A cell's flags as typed (`parsed`: argparse's names), with the magic's defaults
    (`TpuMagics.precision`, `.shard`, `.verify`) where a flag was not typed: what the
    request is read from, in this kernel and, as a line (`as_line`), on every host."""
    values = {name: parsed.get(name) for name in TRAIN_FLAGS}
    for name, default in (("precision", precision or None), ("shard", shard or None),
                          ("verify", verify)):
        if values[name] is None:
            values[name] = default
    return values


def as_line(values: Mapping[str, Any]) -> str:
    """`values` (`flag_values`) as a `%%tpu_train` line that reads back to them: what a
    host's engine runs the cell with."""
    parts = []
    for name in TRAIN_FLAGS:
        value = values.get(name)
        if value is None or (name in SWITCHES and not value):
            continue
        flag = "--" + name.replace("_", "-")
        if name in SWITCHES:
            parts.append(flag)
        else:
            word = ("on" if value else "off") if isinstance(value, bool) else str(value)
            parts.append(f"{flag} {_as_typed(word)}")
    return " ".join(parts)


def _as_typed(word: str) -> str:
    """A value as the magic's parser reads it back: IPython keeps a quoted value's quotes in
    it, so a value with spaces is already quoted as typed; one that is not gets quotes."""
    if not re.search(r"\s", word) or word[:1] in "'\"" and word[-1:] == word[:1]:
        return word
    return '"' + word.replace('"', '\\"') + '"'



def read_request(connection: Any, *, batch_size: int | None = None, epochs: Any = None,
                 scale_lr: bool = False, steps_per_execution: int | str | None = None,
                 progress: bool = True, checkpoint: str | None = None,
                 keep: int | None = None, resume: bool = False,
                 precision: str | None = None, shard: str | None = None,
                 mesh: str | None = None, plan_for: str | None = None,
                 verify: Any = True, measured_tflops: float | None = None,
                 memory: str | None = None, microbatches: int | None = None,
                 remat: str | None = None) -> TrainRequest:
    """The flags as typed (strings where the user types words), checked against the
    connection: its devices for `--mesh` and `--plan-for`, the data rows for the batch.

    Raises:
        FlagError, BatchSizeError, ShardError, MemoryPlanError, PrecisionError: a value, or
            flags that do not go together; the message names the value and the fix.
    """
    steps_per_execution = _steps(steps_per_execution)
    for flag, value in (("--epochs", epochs), ("--steps-per-execution", steps_per_execution),
                        ("--keep", keep), ("--microbatches", microbatches)):
        _at_least_one(flag, value)
    memory = _memory(memory, microbatches, remat)
    for flag, given in (("--resume", resume), ("--keep", keep is not None)):
        if given and checkpoint is None:
            raise FlagError(f"{flag} works with --checkpoint DIR: add it, e.g. "
                            f"%%tpu_train --checkpoint ckpt {flag}")
    mode, rows_columns = read_shard(shard, mesh, connection.replicas)
    rows = rows_columns[0] if rows_columns else connection.replicas  # what a batch splits over
    batch = None if batch_size is None else plan_batches(
        batch_size, rows, tpu_rules=connection.tpu_rules, what="--batch-size")
    devices = len(connection.devices) or connection.replicas
    return TrainRequest(
        batch=batch, epochs=epochs, scale_lr=scale_lr, steps_per_execution=steps_per_execution,
        progress=progress, checkpoint=checkpoint, keep=2 if keep is None else keep,
        resume=resume, precision=_precision(precision, connection), shard=mode,
        mesh=rows_columns, plan_for=target_chip(plan_for, devices),
        verify=on_or_off("--verify", verify), measured_tflops=measured_tflops,
        memory=memory, microbatches=microbatches,
        remat=None if remat in (None, "auto") else on_or_off("--remat", remat))


def _memory(memory: str | None, microbatches: int | None, remat: str | None) -> str:
    """`--memory auto|off`, checked with `--microbatches` and `--remat`.

    Raises:
        FlagError: another word, or a step form named with `--memory off`.
    """
    chosen = (memory or "auto").strip().lower()
    if chosen not in ("auto", "off"):
        raise FlagError(f"--memory {memory!r}: use auto (a step that does not fit a device "
                        "runs as micro-batches and/or with its blocks rematerialized, the full "
                        "batch's numbers) or off (such a step is refused, with what would fit)")
    if chosen == "off" and (microbatches is not None or remat not in (None, "auto")):
        raise FlagError("--memory off runs every step as written: leave out --microbatches "
                        "and --remat, or use --memory auto")
    if remat is not None and remat.strip().lower() not in ("on", "off", "auto"):
        raise FlagError(f"--remat {remat!r}: use on, off or auto (the plan's choice)")
    return chosen


def read_shard(shard: str | None, mesh: str | None, devices: int
               ) -> tuple[Shard, tuple[int, int] | None]:
    """`--shard` and `--mesh`: the mode, and under `model` the mesh (default `1x<devices>`).

    Raises:
        ShardError: an unknown mode, a mesh with `--shard data|auto`, or a mesh that is not
            the devices.
    """
    chosen = (shard or ("model" if mesh else "data")).strip().lower()
    try:
        mode = Shard(chosen)
    except ValueError:
        raise ShardError(f"--shard {shard!r}: use data (replicate the model, split the batch), "
                         "model (split the model's large variables too, on JAX) or auto (data "
                         "where the memory plan fits, else the fewest model columns that fit)"
                         ) from None
    if mode is not Shard.MODEL and mesh:
        raise ShardError(f"--mesh {mesh} lays out the model over its columns: use it with "
                         "--shard model (or leave --mesh out for data parallelism)")
    return mode, (parse_mesh(mesh, devices) if mode is Shard.MODEL else None)


def parse_mesh(text: str | None, devices: int) -> tuple[int, int]:
    """`--mesh BxM` (None: one row over all devices, `1x<devices>`).

    Raises:
        ShardError: not `BxM`, or B×M is not the number of devices.
    """
    if text is None:
        return 1, devices
    parts = text.lower().replace("×", "x").split("x")
    try:
        rows, columns = (int(p) for p in parts)
    except ValueError:
        raise ShardError(f"--mesh {text!r}: write it as BxM, data rows by model columns, e.g. "
                         f"--mesh 1x{devices} or --mesh 2x{max(devices // 2, 1)}") from None
    if rows < 1 or columns < 1 or rows * columns != devices:
        divisors = [m for m in range(1, devices + 1) if devices % m == 0]
        raise ShardError(f"--mesh {text}: {rows}×{columns} is not the {devices} devices here; "
                         "use one of " + ", ".join(f"{devices // m}x{m}" for m in divisors))
    return rows, columns


def on_or_off(flag: str, value: Any) -> bool:
    """`on`/`off` (and yes/no, true/false, 1/0, or a bool) as a bool.

    Raises:
        FlagError: any other value.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("on", "yes", "true", "1"):
        return True
    if text in ("off", "no", "false", "0"):
        return False
    raise FlagError(f"{flag} {value!r}: use on or off")


def _steps(value: int | str | None) -> int | None:
    """`--steps-per-execution`: a whole number, or auto (None).

    Raises:
        FlagError: anything else.
    """
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise FlagError(f"--steps-per-execution {value!r}: use a whole number of steps, e.g. "
                        "--steps-per-execution 32, or auto (the default: chosen from a "
                        "measured step)") from None


def _at_least_one(flag: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FlagError(f"{flag} {value!r} must be 1 or more" if not isinstance(value, int)
                        else f"{flag} {value} must be 1 or more")


def _precision(text: str | None, connection: Any) -> Any:
    if text is None:
        return None
    from tpu_magic.training.models.precision import for_connection

    return for_connection(text, connection)


def target_chip(text: str | None, devices: int) -> tuple[Chip, int] | None:
    """`--plan-for CHIP-N` (e.g. v5e-8, v6e-1, v2-8): the chip, and its device count.

    Raises:
        MemoryPlanError: an unknown chip, or a count other than this connection's devices.
    """
    if not text:
        return None
    chip = chip_for(text)
    count = re.search(r"-(\d+)$", text.strip())
    if chip is None or count is None:
        raise MemoryPlanError(f"--plan-for {text!r}: name a chip and its device count as the "
                              "runtimes do, e.g. --plan-for v5e-8, v6e-1, v4-8 or v2-8")
    if int(count.group(1)) != devices:
        raise MemoryPlanError(
            f"--plan-for {text} plans for {count.group(1)} devices, and this connection has "
            f"{devices}: connect with `%tpu_connect --backend jax --simulate "
            f"{count.group(1)}` to plan for it on this machine")
    return chip, devices
