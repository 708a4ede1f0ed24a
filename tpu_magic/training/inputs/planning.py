"""Input planning for one `fit`/`evaluate`/`predict` call: its batch, checked before it runs.

Which batch a call means (its own `batch_size`, `--batch-size`, a batch fixed in the
model's Input, a dataset's batch, or Keras's default), whether it splits over the
replicas, the batch NumPy data is cut into, and the inputs a connection cannot take.
Pure decisions: nothing here trains or prints; warnings come back for the cell to say.
Keras, NumPy and the modules that import them (`core.arrays`, `exactness`) are imported
inside the functions that read arrays or models, so that the decisions are unit-tested
without a framework (tests/unit/training/inputs/test_planning.py).
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any, Mapping

from tpu_magic.core import record
from tpu_magic.core.batching import TPU_TILE, BatchPlan, plan_batches, scaled_learning_rate
from tpu_magic.core.errors import BatchSizeError, InputError

KERAS_DEFAULT_BATCH = 32


def is_dataset(data: Any) -> bool:
    """A dataset of batches: tf.data's (anything with an element spec) or grain's (what a
    KerasHub task makes of arrays)."""
    return hasattr(data, "element_spec") or any(
        cls.__name__ in ("MapDataset", "IterDataset") and cls.__module__.startswith("grain")
        for cls in type(data).__mro__)


def as_arrays(call: Mapping[str, Any]) -> dict:
    """A new call whose tensors (TensorFlow's, JAX's, pandas' frames: anything NumPy can
    read) are NumPy arrays, so they take the same whole-batch, exact path as NumPy input
    (left to Keras under replicas, a tensor reached BatchNorm as empty replica batches)."""
    found = dict(call)
    for key in ("x", "y", "sample_weight"):
        if key in found:
            found[key] = _numpy_leaves(found[key])
    validation = found.get("validation_data")
    if isinstance(validation, (tuple, list)):
        found["validation_data"] = tuple(_numpy_leaves(part) for part in validation)
    return found


def _numpy_leaves(data: Any) -> Any:
    import keras
    import numpy as np

    if data is None or is_dataset(data) or read_once(data) or \
            isinstance(data, keras.utils.PyDataset):
        return data
    leaves = keras.tree.flatten(data)
    if not leaves or all(isinstance(a, np.ndarray) for a in leaves) or \
            not all(hasattr(a, "__array__") and hasattr(a, "shape") for a in leaves):
        return data
    return keras.tree.map_structure(np.asarray, data)


def batched_input(data: Any) -> bool:
    """Input that comes in batches of its own: a dataset, a `PyDataset`, a generator."""
    return is_dataset(data) or read_once(data) or _is_keras(data, "utils", "PyDataset")


def _is_keras(value: Any, *name: str) -> bool:
    """Whether `value` is an instance of Keras's class `keras.NAME...`. Asked of
    `sys.modules`: before Keras is imported there is no such instance, and the decisions here
    need not import it."""
    found = sys.modules.get("keras")
    if found is None:
        return False
    for part in name:
        found = getattr(found, part)
    return isinstance(value, found)


def read_once(data: Any) -> bool:
    """A generator or iterator: one pass reads it up, so a `fit` on it cannot be repeated."""
    return inspect.isgenerator(data) or (hasattr(data, "__next__") and iter(data) is data)


def static_batch(model: Any) -> int | None:
    """A batch size fixed in the model's Input(s), e.g. `keras.Input(batch_shape=(128, 40))`."""
    try:
        sizes = {t.shape[0] for t in model.inputs}
    except (AttributeError, TypeError, ValueError):
        return None
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def plan_call(method: str, model: Any, call: Mapping[str, Any], named: set, connection: Any,
              requested: BatchPlan | None, key: str = "batch_size",
              label: str | None = None) -> BatchPlan:
    """The batch of one call, checked against the connection's replicas.

    Args:
        method: "fit", "evaluate" or "predict".
        call / named: the call's arguments, and which of them the user named.
        requested: `--batch-size`'s plan (the request's), if given.
        key: the argument that holds the batch.
        label: the user's name for the model, for messages.

    Returns:
        A `BatchPlan` whose warnings the cell says (a plan of batch 0 where a dataset's
        batch cannot be told).

    Raises:
        BatchSizeError: the batch does not split over the replicas.
        InputError: inputs this connection cannot take (see `refuse_strings`).
    """
    static = static_per_replica(model, connection)
    check_samples(method, call)
    refuse_strings(model, call.get("x"), connection, label)
    return choose_batch(method, call, named, connection, requested, static, key)


def static_per_replica(model: Any, connection: Any) -> int | None:
    """The batch fixed in the model's Input as each replica gets it (None: none is fixed).

    Keras splits such a batch per replica; where the backend traces the global batch, the
    fixed batch is the global one, and each replica gets its share.

    Raises:
        BatchSizeError: a global fixed batch that does not split over the replicas.
    """
    static = static_batch(model)
    if static is not None and connection.backend.static_batch_is_global:
        static = plan_batches(static, connection.replicas,
                              what="the batch fixed in the model's Input").per_replica
    return static


def choose_batch(method: str, call: Mapping[str, Any], named: set, connection: Any,
                 requested: BatchPlan | None, static: int | None,
                 key: str = "batch_size") -> BatchPlan:
    """Which batch a call means, checked against the connection's replicas: a dataset's
    own, else the call's `key` where the user named it, else `--batch-size`, else the
    Input's fixed batch, else Keras's default (for evaluate/predict batched as plain Keras
    batches them, or rounded up to whole replicas where it does not split).

    Args:
        method / call / named / requested / key: as for `plan_call`.
        static: the Input's fixed batch per replica (`static_per_replica`), or None.

    Returns:
        A `BatchPlan` (of batch 0 where a dataset's batch cannot be told).

    Raises:
        BatchSizeError: the batch does not split over the replicas.
    """
    replicas = connection.replicas
    data = call.get("x")
    if batched_input(data):
        batch, what = connection.backend.dataset_batch_size(data), "the dataset's batch"
        if batch is None:
            return BatchPlan(0, replicas, 0)
    elif key in named and call.get(key) is not None:
        batch, what = call[key], key
    elif requested is not None:
        if requested.replicas == replicas and static is None:
            return requested  # the request's plan, carried through
        batch, what = requested.global_batch, "--batch-size"
    elif static is not None:
        batch, what = static * replicas, key
    elif method == "fit":
        batch, what = KERAS_DEFAULT_BATCH, key  # Keras's default, advice included
    elif KERAS_DEFAULT_BATCH % replicas == 0:
        # evaluate/predict: Keras's default, as plain Keras batches it (a custom test_step
        # may average per-batch numbers, and a layer may mix a batch's rows); no TPU advice
        # for a batch the user did not choose
        return plan_batches(KERAS_DEFAULT_BATCH, replicas, static_per_replica=static, what=key)
    else:
        unit = _unit(connection)
        batch, what = math.ceil(KERAS_DEFAULT_BATCH / unit) * unit, key
    return plan_batches(batch, replicas, tpu_rules=connection.tpu_rules,
                        static_per_replica=static, what=what)


def check_samples(method: str, call: Mapping[str, Any]) -> None:
    """Every NumPy array of a call (x, y, sample_weight, validation_data) has the same
    number of samples, and fit/evaluate get at least one; checked before anything runs.

    Raises:
        InputError: arrays of different lengths (each named with its length), or no samples.
    """
    from tpu_magic.core import arrays

    parts = {key: call.get(key) for key in ("x", "y", "sample_weight")}
    checks = [(method, parts)]
    validation = call.get("validation_data")
    if method == "fit" and isinstance(validation, (tuple, list)):
        checks.append(("fit's validation_data", dict(zip(("x", "y", "sample_weight"),
                                                          validation))))
    for what, given in checks:
        given = {k: v for k, v in given.items() if v is not None and arrays.is_array_input(v)}
        if "x" not in given:
            continue
        if arrays.common_length(what, **given) == 0 and method != "predict":
            raise InputError(
                f"{what} got 0 samples (x has no rows), so there is nothing to "
                f"{'train on' if what == 'fit' else 'evaluate'}: check the slice or filter "
                "that made x")


def validation_plan(call: Mapping[str, Any], plan: BatchPlan, model: Any, connection: Any) -> BatchPlan:
    """The batch of `fit`'s validation pass: its own, else the training batch, else (a
    dataset's fit, whose batch is its own) what plain Keras's `evaluate` takes: its default."""
    batch = call.get("validation_batch_size") or plan.global_batch
    if not batch:
        return choose_batch("evaluate", {}, set(), connection, None,
                            static_per_replica(model, connection))
    return plan_batches(batch, connection.replicas, what="validation_batch_size",
                        static_per_replica=plan.per_replica if static_batch(model) else None)


def pads(model: Any, connection: Any) -> bool:
    """Whether the model's last batch may be padded: everywhere but where the backend runs
    a short batch as it is (JAX in one process), unless the model's Input fixes the batch.
    Where nothing is padded, every step runs plain Keras's code: nothing to mask."""
    return not connection.backend.runs_short_batches() or static_batch(model) is not None


def remainder_for(model: Any, connection: Any, has_targets: bool) -> str:
    """What becomes of the samples that do not fill a call's last batch (see
    `backends.protocol.InputBuilder`): "short" where nothing is padded, "pad" where the
    model's loss takes the padding mask (`exactness`), else "drop"."""
    if not pads(model, connection):
        return "short"
    from tpu_magic.training.inputs import exactness

    return "pad" if exactness.masks_reach_loss(model, has_targets) else "drop"


def padded_batch(plan: BatchPlan, model: Any, samples: int, connection: Any,
                 remainder: str = "pad") -> int:
    """The batch NumPy data is cut into.

    A batch larger than the data shrinks to the data, rounded up to whole replicas (the
    same results without padding, say, 10**9 rows); "short": the data itself; "drop": rounded
    down to whole replicas instead.

    Raises:
        BatchSizeError: "drop", too few samples for one batch over the replicas.
    """
    if static_batch(model) is not None:
        return plan.global_batch
    unit = _unit(connection)
    if remainder == "pad":
        return min(plan.global_batch, max(1, math.ceil(samples / unit)) * unit)
    if remainder == "short":
        return min(plan.global_batch, samples)
    whole = (samples // unit) * unit or (samples // plan.replicas) * plan.replicas
    if not whole:
        raise BatchSizeError(
            f"{samples} sample{'s' * (samples != 1)} cannot fill one batch over "
            f"{plan.replicas} replicas, and this model's loss cannot skip padding: pass at "
            f"least {plan.replicas} samples")
    return min(plan.global_batch, whole)


def refuse_strings(model: Any, data: Any, connection: Any, label: str | None = None) -> None:
    """Strings cannot be split over replicas, nor go to a TPU: say where they belong.

    Raises:
        InputError: the model gets strings on several replicas or a TPU.
    """
    if connection.replicas == 1 and connection.kind != "tpu":
        return
    from tpu_magic.core import arrays

    found = arrays.string_input(model, data)
    if found is not None:
        raise InputError(
            f"model {label or model.name!r} gets strings ({found}): a TPU "
            "cannot run string ops and replicas cannot split them. Move the text "
            "vectorization into the tf.data pipeline, `dataset.map(lambda x, y: "
            "(vectorize_layer(x), y))`, and give the model its integer output (as the Keras "
            "TPU guides do); keep a model with the TextVectorization layer for inference "
            "on the CPU.")


def fold_class_weight(y: Any, weights: Any, class_weight: dict | None) -> Any:
    """`class_weight` folded into per-sample weights (Keras's own rule), as Keras does.

    Raises:
        InputError: both class and sample weights, or targets that are not one array.
    """
    if not class_weight:
        return weights
    if weights is not None:
        raise InputError("fit got both class_weight and sample_weight (Keras takes one): "
                         "multiply the class weights into sample_weight, or drop one")
    import keras

    from tpu_magic.core import arrays

    if y is None or keras.tree.is_nested(y):
        raise InputError("class_weight works with one target array (a single output): "
                         "give per-sample weights as sample_weight instead")
    return arrays.class_weights_to_sample_weights(y, class_weight)


def split_validation(x: Any, y: Any, weights: Any, fraction: float) -> tuple[tuple, tuple]:
    """Keras's validation_split: the last samples, before shuffling, are for validation."""
    import keras

    from tpu_magic.core import arrays

    cut = validation_cut(arrays.num_samples(x), fraction)

    def part(piece: slice) -> tuple:
        return tuple(None if a is None else keras.tree.map_structure(lambda v: v[piece], a)
                     for a in (x, y, weights))

    return part(slice(None, cut)), part(slice(cut, None))


def validation_cut(samples: int, fraction: float) -> int:
    """Where Keras's validation_split cuts `samples` rows: the first one held out (Keras's
    own arithmetic, so that both keep the same rows for validation)."""
    return int(math.floor(samples * (1.0 - fraction)))


def _unit(connection: Any) -> int:
    """The smallest batch step: whole replicas, and on a TPU whole 8-row tiles per replica."""
    return connection.replicas * (TPU_TILE if connection.tpu_rules else 1)


def scale_learning_rate(model: Any, plan: BatchPlan) -> str | None:
    """`--scale-lr`: the rate tuned for one replica's batch times the replicas, once per model
    (the first rate is kept in the model's record). Returns what to say (None: no optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    schedule = ("optimizers", "schedules", "LearningRateSchedule")
    if _is_keras(optimizer.learning_rate, *schedule) or \
            _is_keras(getattr(optimizer, "_learning_rate", None), *schedule):
        return "--scale-lr: the learning rate is a schedule, left as it is"
    kept = record.of(model)
    if kept.base_rate is None:
        kept.base_rate = float(optimizer.learning_rate.numpy())
    base = kept.base_rate
    scaled = scaled_learning_rate(base, plan)
    optimizer.learning_rate = scaled
    return (f"--scale-lr: learning rate {base:g} → {scaled:g} (×{plan.replicas}: global "
            f"batch {plan.global_batch} = {plan.replicas} × {plan.per_replica} per replica)")
