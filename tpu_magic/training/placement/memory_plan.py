"""A memory plan before a fit's first step: what one device will hold during a training
step, from the compiler, set against its memory.

The backend lowers Keras's own train step for the mesh in force and compiles it from
abstract inputs (`Backend.step_memory`): nothing runs and nothing is allocated, and on JAX
the program compiled is the one the fit then runs (the plan costs no compile of its own).
When the step fits (with `HEADROOM` to spare) the report gets one line. When it does not,
the step takes the form the plan chooses (`fitting`: micro-batches inside the step, its
repeated blocks rematerialized; the full batch's numbers), said in that line; where no
exact form fits, or with `--memory off`, training is refused before it starts, the
weights untouched, with the biggest term named and what would change the numbers listed
with its planned saving. `--plan-for v5e-8` plans for hardware you do not have: on 8
simulated CPU devices, against a v5e's HBM; XLA:CPU lays memory out differently from the
TPU's compiler, which the line says. The plan also tells whether the first-step check's
one-device copy of the model's state fits beside the step (`Planned.check_room`: where it
would not, the check is skipped and says why).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from tpu_magic.core.chips import Chip
from tpu_magic.core.devices import StepMemory
from tpu_magic.core.errors import MemoryPlanError
from tpu_magic.core.steps import StepForm, copied_bytes
from tpu_magic.training.placement import fitting

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


@dataclass(frozen=True)
class Planned:
    """A fit's plan: its line for the report (None: nothing planned), the step's form, and
    what to say of that form (BatchNormalization by micro-batch, micro-batches a user named
    where they are not exact); `flops`: a sample's training FLOPs, from the cost analysis
    of the step as written that the plan compiled (None: not counted), so the report's
    utilization lowers nothing more."""

    line: str | None = None
    form: StepForm = StepForm()
    notes: tuple = ()
    flops: float | None = None
    check_room: str | None = None  # why the first-step check would not fit (None: it fits)


def before_fit(connection: Any, model: Any, batch: Any, planned: tuple[Chip, int] | None,
               request: Any = None) -> Planned:
    """The fit's plan from its first batch (see the module's docstring): `request`'s
    `--memory`, `--microbatches`, `--remat` (None: auto).

    Raises:
        MemoryPlanError: no form of the step fits a device (nothing has run).
    """
    if batch is None:
        return Planned()
    backend = connection.backend
    asked = _asked(request)
    written = backend.step_memory(model, batch, form=asked)
    if written is None:
        return Planned()
    total = device_bytes(connection, planned)
    where = f"per {planned[0].name} device" if planned else "per device"
    notes = _form_notes(backend, model, asked)
    flops = written.flops * written.devices / _rows(batch) \
        if written.flops and asked.as_written and _rows(batch) else None
    if total is None or written.peak <= HEADROOM * total:
        return Planned(line(written, total, where, asked, _rows(batch)), asked, notes, flops,
                       _check_room(model, written, total, connection))
    if not asked.as_written or getattr(request, "memory", "auto") == "off":
        raise MemoryPlanError(refusal(written, total, where, _changes(
            connection, model, batch, asked)))
    not_micro = backend.step_form_not_exact(model)
    remat_allowed = getattr(request, "remat", None) is not False  # `--remat off`: none
    forms = fitting.candidates(_rows(batch) // connection.replicas,
                               remat_allowed and bool(backend.repeated_blocks(model)),
                               not_micro is None)
    chosen = fitting.fit(lambda form: backend.step_memory(model, batch, form=form), written,
                         HEADROOM * total, forms, not_micro)
    if chosen.form is None:
        raise MemoryPlanError(refusal(written, total, where, _changes(
            connection, model, batch, asked), chosen))
    return Planned(fitted_line(written, chosen, total, where, _rows(batch)), chosen.form,
                   _form_notes(backend, model, chosen.form), flops,
                   _check_room(model, chosen.memory or written, total, connection))


def _check_room(model: Any, step: StepMemory, total: float | None, connection: Any
                ) -> str | None:
    """Why the first-step check's one-device step would not fit beside the model's own
    state on its device (None: it fits, or the device's memory is not known). The check
    runs the step once more on one device, from a copy of the model's state but a frozen
    layer's (`core.steps.copied_bytes`), whole there, beside the step's own share: on a
    chip the step fills, that copy is what would run out of memory. Several replicas or a
    mesh only: one device is not checked."""
    if total is None or (connection.replicas <= 1 and step.devices <= 1):
        return None
    copy = copied_bytes(model)
    if step.peak + copy <= HEADROOM * total:
        return None
    return (f"its one-device step would hold a copy of the model's state "
            f"({copy / _GIB:.3g} GiB) beside the step's {step.peak / _GIB:.3g} GiB, more "
            f"than {HEADROOM:.0%} of the device's {total / _GIB:.3g} GiB")


def call_batch(connection: Any, model: Any, kind: str, batch: int,
               first_batch: Callable[[int], Any]) -> tuple[int, str | None]:
    """The batch an `evaluate` or `predict` (`kind` "test", "predict") runs in: `batch`
    where its step fits a device with headroom (planned from the compiler; the program
    compiled is the one the call runs), else the largest half, quarter ... that fits (a
    whole number of replicas): the same outputs and results, batch by batch. Returns (the
    batch, what to say: None where it is `batch`). `first_batch(b)`: the call's first batch
    at batch `b`, as its pipeline builds it."""
    backend = connection.backend
    total = device_bytes(connection, None)
    if not backend.plans_memory or total is None:
        return batch, None
    replicas, chosen = connection.replicas, batch
    while True:
        memory = backend.call_memory(model, kind, first_batch(chosen))
        if memory is None or memory.peak <= HEADROOM * total:
            break
        smaller = (chosen // 2) // replicas * replicas
        if smaller < replicas or smaller == chosen:
            return batch, None  # nothing smaller fits: as asked (the step says why)
        chosen = smaller
    if chosen == batch:
        return batch, None
    call = {"test": "evaluate", "predict": "predict"}[kind]
    return chosen, (f"{call}'s batch of {batch} needs more than {100 * HEADROOM:.0f} % of a "
                    f"device's {_gib(total)} GiB (planned): it runs in batches of {chosen}, "
                    "the same results")


def _asked(request: Any) -> StepForm:
    """The form the user named (`--microbatches`, `--remat on`), else as written."""
    micro = getattr(request, "microbatches", None) or 1
    return StepForm(micro, bool(getattr(request, "remat", None)))


def _form_notes(backend: Any, model: Any, form: StepForm) -> tuple:
    notes = []
    if form.micro > 1:
        parts = backend.normalizes_parts(model)
        if parts:
            notes.append(f"{', '.join(parts)} normalize each of the {form.micro} "
                         "micro-batches by its own statistics in training, as replicas do "
                         "(the full batch's statistics would differ a little)")
        why = backend.step_form_not_exact(model)
        if why:
            notes.append(f"--microbatches {form.micro}: not the full batch's numbers, since "
                         f"{why}")
    return tuple(notes)


def _rows(batch: Any) -> int:
    import keras

    x = keras.utils.unpack_x_y_sample_weight(batch)[0]
    return int(keras.tree.flatten(x)[0].shape[0])



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


def line(memory: StepMemory, total: float | None, where: str,
         form: StepForm = StepForm(), rows: int | None = None) -> str:
    parts = (f"weights {_gib(memory.weights)}, optimizer {_gib(memory.optimizer)}, "
             f"activations and gradients {_gib(memory.temporaries)}, batch {_gib(memory.batch)}")
    of = f" of {_gib(total)}" if total else ""
    shaped = "" if form.as_written else f", {form.describe(rows)}"
    text = f"memory plan: {_gib(memory.peak)}{of} GiB {where}{shaped} ({parts})"
    return text + _on_cpu(memory)


def fitted_line(written: StepMemory, chosen: fitting.Fitted, total: float, where: str,
                rows: int) -> str:
    """E.g. `memory plan: 21.3 GiB is more than 90 % of 16 GiB per TPU v5e device, so 4
    micro-batches of 2 (the same update as batch 8): 11.2 GiB`, with the plan's own
    seconds."""
    memory = chosen.memory
    tried = len(chosen.planned)
    return (f"memory plan: {_gib(written.peak)} GiB is more than {100 * HEADROOM:.0f} % of "
            f"{_gib(total)} GiB {where}, so {chosen.form.describe(rows)}: "
            f"{_gib(memory.peak)} GiB (activations and gradients {_gib(memory.temporaries)}"
            f" of {_gib(written.temporaries)}), the fitting form of least estimated step "
            f"time ({fitting.cost(written, chosen.form):.2f}x as written); {tried} "
            f"form{'s' * (tried != 1)} planned in {chosen.seconds:.2g} s" + _on_cpu(memory))


def _on_cpu(memory: StepMemory) -> str:
    if memory.compiled_on != "cpu":
        return ""
    return ("; planned by XLA on this machine's CPU devices, whose layout of memory differs "
            "from a TPU's or GPU's compiler: take it as ±30 %")


def refusal(memory: StepMemory, total: float, where: str, changes: list | None = None,
            tried: fitting.Fitted | None = None) -> str:
    """Why the step will not fit, its biggest term, the exact forms tried, and what would
    change the numbers, each with its planned saving, largest first."""
    terms = {"the weights": memory.weights, "the optimizer's state": memory.optimizer,
             "activations and gradients": memory.temporaries, "the batch": memory.batch}
    biggest = max(terms, key=terms.get)
    text = (f"memory plan: a training step needs {_gib(memory.peak)} GiB {where}, more than "
            f"{100 * HEADROOM:.0f} % of its {_gib(total)} GiB; the biggest part is {biggest} "
            f"({_gib(terms[biggest])} GiB). Nothing has run and the weights are untouched.")
    if tried is not None:
        planned = ", ".join(f"{form.describe()} {_gib(peak)} GiB" for form, peak in tried.planned)
        text += (f" No form with the full batch's numbers fits (planned: {planned or 'none '}"
                 f"{'; ' if planned else ''}the others' activations would not shrink enough)")
        if tried.not_micro:
            text += (f"; micro-batches were left out: {tried.not_micro} (`--microbatches N` "
                     "runs them anyway)")
        text += "."
    listed = "; ".join(f"{change.what} saves {_gib(change.saved)} GiB"
                       for change in changes or [] if change.saved)
    if listed:
        text += f" What would change the numbers, planned, largest saving first: {listed}."
    return text


def _changes(connection: Any, model: Any, batch: Any, form: StepForm) -> list:
    """What would change the numbers, each planned from abstract inputs (`fitting.savings`):
    half the batch, a sequence half as long, bfloat16 variables, the model's columns over
    the devices, LoRA where the model offers it."""
    import keras

    backend = connection.backend

    def sliced(rows: Any = slice(None), columns: Any = slice(None)) -> Any:
        return keras.tree.map_structure(
            lambda a: a[rows] if a.ndim < 2 else a[rows, columns], batch)

    rows = _rows(batch)
    plans = {"half the batch": lambda: backend.step_memory(
        model, sliced(slice(0, max(rows // 2, connection.replicas))), form=form),
        "a sequence half as long": lambda: backend.step_memory(
            model, sliced(columns=slice(0, _length(batch) // 2)), form=form)
        if _length(batch) >= 2 else None,
        "`--precision bf16` (bfloat16 variables)": lambda: backend.step_memory(
            model, batch, form=form, bf16=True)}
    devices = connection.replicas
    if devices > 1:
        plans[f"`--shard model --mesh 1x{devices}` (the model's large variables over the "
              "devices)"] = lambda: backend.step_memory(
                  model, batch, backend.model_parallel(connection, 1, devices), form=form)
    lora = any(hasattr(layer, "enable_lora") for layer in model._flatten_layers()) and \
        not any("lora" in v.path for v in model.trainable_variables)
    return fitting.savings(backend.step_memory(model, batch, form=form), plans, lora)


def _length(batch: Any) -> int:
    """The batch's sequence length: the second axis of its inputs that have one (0: none)."""
    import keras

    x = keras.utils.unpack_x_y_sample_weight(batch)[0]
    found = [a.shape[1] for a in keras.tree.flatten(x) if getattr(a, "ndim", 0) >= 2]
    return int(min(found)) if found else 0


def _gib(count: float) -> str:
    return f"{count / _GIB:.3g}" if count >= 0.01 * _GIB else f"{count / _GIB:.2g}"
