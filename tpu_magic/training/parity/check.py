"""Which fit is checked, and the check built for it: the `FirstStep` callback, given the
backend's one-device steps and what the model is made of (for the likely cause); and which
fit runs the whole batch on every replica from its start (`WholeBatchRun`)."""

from __future__ import annotations

from typing import Any, Callable

from tpu_magic.core.arrays import batch_shapes
from tpu_magic.core.session import Connection
from tpu_magic.core.steps import build
from tpu_magic.training.inputs import exactness
from tpu_magic.training.parity.callback import FirstStep, WholeBatchRun
from tpu_magic.training.parity.compare import (LOW_PRECISION_TOLERANCE, TOLERANCE,
                                               WHOLE_BATCH, WHOLE_EARLIER, likely_cause,
                                               per_replica_norms, random_layers)
from tpu_magic.training.parity.setup import setup_before

NOT_COMPARED = "the first step is not compared with one device"
ON_HOSTS = f"{NOT_COMPARED} on several hosts"


def checks(connection: Connection, mesh: Any) -> bool:
    """Whether a fit on this placement is checked at all: several replicas or a mesh (one
    device has nothing to compare with)."""
    return connection.replicas > 1 or mesh is not None


def fit_checks(connection: Connection, mesh: Any, plan: Any, built: Any, first: bool,
               agreed: frozenset, one_device_copy: Callable[[Any], Callable[[], Any]]
               ) -> tuple[FirstStep | None, WholeBatchRun | None, list[str]]:
    """What a fit (`plan`, `built` as for `first_step_check`) runs with: the callback
    running it with every replica computing the whole batch, where its setup agreed so
    earlier in the notebook (`agreed`: `compare.Parity.remembered` of earlier comparisons);
    otherwise, where it is the cell's `first` checked fit, the first-step check.

    Returns:
        (the check or None, the whole-batch run or None, notes to say).
    """
    whole = whole_batch_run(connection, mesh, plan, built, agreed)
    if whole is not None:
        return None, whole, [WHOLE_EARLIER]
    if not first:
        return None, None, []
    check, note = first_step_check(connection, mesh, plan, built, agreed, one_device_copy)
    return check, None, [note] if note else []


def whole_batch_run(connection: Connection, mesh: Any, plan: Any, built: Any,
                    agreed: frozenset) -> WholeBatchRun | None:
    """The callback running a fit with every replica computing the whole batch, where its
    setup agreed so earlier (`agreed` holds it marked `WHOLE_BATCH`); None elsewhere."""
    if built.shapes is None or not any(key.startswith(WHOLE_BATCH) for key in agreed):
        return None
    try:
        key = setup_before(plan.model, built.shapes, _where(connection, mesh), None,
                           plan.steps.k)
        means = connection.backend.whole_batch(plan.model, built.call) \
            if WHOLE_BATCH + key in agreed else None
    except Exception:  # noqa: BLE001 - the check must never break the cell
        return None
    return None if means is None else WholeBatchRun(means)


def first_step_check(connection: Connection, mesh: Any, plan: Any, built: Any,
                     agreed: frozenset, one_device_copy: Callable[[Any], Callable[[], Any]]
                     ) -> tuple[FirstStep | None, str | None]:
    """The check of a cell's first fit (`plan`: its `fit.plan.FitPlan`, steps chosen;
    `built`: its inputs, `inputs.build.Built`): its first execution, `plan.steps.k` steps.

    Returns:
        (the callback, or None where it cannot run; a note saying why not, or None).
    """
    if connection.target.startswith("hosts:"):
        return None, ON_HOSTS
    if plan.placement.check_room is not None:  # the memory plan's: it would not fit
        return None, f"{NOT_COMPARED}: {plan.placement.check_room}"
    try:
        return _check(connection, mesh, plan, built, agreed, one_device_copy), None
    except Exception as exc:  # noqa: BLE001 - the check must never break the cell
        return None, f"{NOT_COMPARED}: it could not be set up ({type(exc).__name__}: {exc})"


def _check(connection: Connection, mesh: Any, plan: Any, built: Any, agreed: frozenset,
           one_device_copy: Callable[[Any], Callable[[], Any]]) -> FirstStep:
    backend, model = connection.backend, plan.model
    global_batch = backend.step_sees_global_batch
    random = [] if global_batch else random_layers(model)
    draws = (f"it draws random numbers while training ({', '.join(random)}), and each "
             f"{backend.label} replica draws its own" if random else None)
    low = str(getattr(model, "compute_dtype", "float32")) in ("bfloat16", "float16")
    likely = likely_cause(connection.replicas,
                          [] if global_batch else per_replica_norms(model),
                          exactness.scalar_losses(model), not exactness.keras_steps(model))

    parts = _parts(connection, plan.placement.form)

    def reference(m: Any, before: Any, batches: list) -> Any:
        with exactness.suspended(m):
            return backend.one_device_steps(m, before, batches, one_device_copy(m), parts)

    def ahead(m: Any, batch: Any) -> Callable[[], bool] | None:
        with exactness.suspended(m):
            return backend.one_device_ahead(m, batch, parts, plan.steps.k)

    def now(m: Any, real: Any) -> Any:
        with exactness.suspended(m):
            return backend.one_device_update(m, real, parts)

    def inference(m: Any, fed: Any, real: Any) -> Any:
        ours = backend.distributed_inference(m, fed)
        if ours is None:
            return None
        with exactness.suspended(m):
            return ours, backend.one_device_inference(m, real, one_device_copy(m))

    where = _where(connection, mesh)
    shapes = _shapes_before(built, plan)
    before = (setup_before(model, shapes, where, draws, plan.steps.k)
              if shapes is not None and agreed else None)
    # a replica's own BatchNorm statistics are what several replicas mean (and what
    # `synchronized=True` changes): that difference is said, not run away from
    norms = [] if global_batch else per_replica_norms(model)
    return FirstStep(backend.step_state, built.first, reference,
                     LOW_PRECISION_TOLERANCE if low else TOLERANCE, likely, draws, where,
                     agreed, inference, backend.step_logs, setup_before=before,
                     whole=None if norms or global_batch else
                     lambda: backend.whole_batch(model, built.call),
                     ahead=ahead if backend.check_compiles_ahead else None,
                     first_steps=plan.steps.k, first_fed=plan.first,
                     now=now if backend.check_compiles_ahead else None)


def _shapes_before(built: Any, plan: Any) -> Callable[[int], list] | None:
    """The shapes of a fit's first `n` batches as fed, told before it reads (`setup_before`
    takes them): tpu_magic's own pipeline's, else those of the plan's first batch as fed
    (an input Keras reads itself: every batch of the first execution has its shapes);
    None where neither is known."""
    if built.shapes is not None:
        return built.shapes
    try:
        first = plan.first()
    except Exception:  # noqa: BLE001 - the check must never break the cell
        return None
    return None if first is None else lambda n: [batch_shapes(first)] * n


def checked_first(placement: Any, request: Any, verified: bool) -> bool:
    """Whether a fit on `placement` is the cell's first checked one: `request`'s `--verify`
    on, no fit of the cell `verified` yet, and something to compare (`checks`)."""
    return bool(request.verify) and not verified and checks(placement.connection,
                                                            placement.mesh)


def check_ahead(placement: Any, agreed: frozenset, request: Any, verified: bool
                ) -> Callable[[Any, Callable[[], Any]], None] | None:
    """Where the fit about to be planned is the cell's first checked one (`checked_first`;
    `placement` settled, on a backend that compiles the check's one-device step ahead):
    what starts that compile from the fit's first batch (`first()`), before the memory
    plan compiles the distributed step, so the two compile side by side, not the check's
    beside the steps; nothing where the batch's setup agreed earlier (`agreed`: no
    comparison, nothing to compile). None where the fit is not checked so."""
    connection, mesh, steps = placement.connection, placement.mesh, request.steps_per_execution
    backend = connection.backend
    if not (checked_first(placement, request, verified) and backend.check_compiles_ahead and
            placement.settled) or connection.target.startswith("hosts:"):
        return None
    where = _where(connection, mesh)

    def ahead(model: Any, first: Callable[[], Any]) -> None:
        try:
            batch = first()
            k = steps or max(int(getattr(model, "steps_per_execution", 1) or 1), 1)
            if batch is None or setup_before(model, lambda n: [batch_shapes(batch)] * n,
                                             where, None, k) in agreed:
                return
        except Exception:  # noqa: BLE001 - the check must never break the cell
            return
        build(model, batch)  # as the plan would next (its error is the cell's: raised)
        try:
            with exactness.suspended(model):  # the step's own form is the plan's, still to
                # come: as written where asked (another form's is compiled at the check)
                backend.one_device_ahead(model, batch, _parts(connection, None), k)
        except Exception:  # noqa: BLE001 - the check must never break the cell: where this
            pass  # fails, its step is made ready at the first step, as without it

    return ahead


def _parts(connection: Connection, form: Any) -> int:
    """The parts a global batch is in on the devices: the replicas' shares, each in the
    step's own micro-batches (`form`: the memory plan's `StepForm`, None as written)."""
    return max(connection.replicas, 1) * max(getattr(form, "micro", 1) or 1, 1)


def _where(connection: Connection, mesh: Any) -> str:
    """The devices a model trains on, for `setup_key`."""
    return f"{connection.strategy_name} {connection.replicas} {mesh} {connection.target}"
