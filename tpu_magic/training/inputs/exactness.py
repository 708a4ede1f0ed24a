"""Exact losses and metrics over padded batches, switched on per model.

Every batch tpu_magic feeds a device is whole (TPUs need static shapes; replicas need equal
shares). Where the data do not fill the last batch, it is padded, and the batch carries a
*packed* sample weight, a dict of three per-row values:

- `MASK`: 1 for a real sample, 0 for padding;
- `WEIGHT`: the user's own sample weight (times `class_weight`), 1 where none was given;
- `REAL`: the share of real samples in the batch (k / B), the same on every row.

Measured (FACTS.md): a zero sample weight alone is not exact in Keras 3 — the loss still
divides by the padded batch, `metrics=` count padded rows, and `fit`'s epoch loss weighs a
partial batch like a full one. So `enable(model)` gives the model, and only it, three
instance-level overrides (no Keras class is patched, nothing leaks into other models or
threads):

- `compute_loss` uses `MASK * WEIGHT / REAL`: the batch's loss and gradient are plain
  Keras's mean over its k real samples;
- the loss trackers (the model's, and one per output) weigh a batch by its k real samples,
  as plain Keras weighs a partial batch by its size;
- the compiled metrics give `metrics=` the mask (0/1: counts stay whole) and
  `weighted_metrics=` the mask times the user's weights.

This holds only where Keras's own `train_step`, `test_step`, `compute_loss` and
`compute_metrics` run and the loss comes from `compile` (see `masks_reach_loss`); other
models are fed whole batches of real samples only (see `training.inputs`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import keras
from keras import ops

# Keras 3 keeps an output's mask as a tensor attribute; these are its own accessors.
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

from tpu_magic.core import record
from tpu_magic.core.overrides import without
from tpu_magic.core.packed import MASK, REAL, WEIGHT, is_packed

_KERAS_STEPS = ("train_step", "test_step", "compute_loss", "compute_metrics")


def keras_steps(model: Any) -> bool:
    """Whether the model trains and tests with Keras's own steps, loss and metrics code."""
    cls = type(model)
    return all(getattr(cls, name, None) is getattr(keras.Model, name) for name in _KERAS_STEPS)


def masks_reach_loss(model: Any, has_targets: bool) -> bool:
    """Whether padded rows can be masked out of everything the model's steps compute.

    Not for a custom `train_step`/`test_step`/`compute_loss`/`compute_metrics` (it may
    ignore sample weights), nor without targets or a compiled loss (then the loss comes
    from `add_loss`, which sample weights do not reach), nor for a loss that reduces the
    batch to one number itself (see `scalar_losses`).
    """
    return (has_targets and keras_steps(model)
            and getattr(model, "_compile_loss", None) is not None
            and not scalar_losses(model))


def scalar_losses(model: Any) -> list[str]:
    """The model's compiled losses that return one number for a batch (e.g. a function
    ending in `ops.mean`): a sample weight cannot reach their rows, so padding would leak in.

    Each user-written loss (a function, or a `Loss` subclass's `call`) is tried once on two
    rows shaped like the model's output; Keras's own losses keep one value per sample.
    """
    outputs = getattr(model, "outputs", None)
    losses = keras.tree.flatten(getattr(model, "loss", None))
    if not outputs or not losses:
        return []
    found = []
    for loss, output in zip(losses, outputs * len(losses) if len(outputs) == 1 else outputs):
        fn = loss.call if isinstance(loss, keras.losses.Loss) else loss
        if not callable(fn) or _keras_own(fn):
            continue
        shape = (2,) + tuple(d or 1 for d in tuple(output.shape)[1:])
        try:
            value = fn(ops.zeros(shape), ops.ones(shape) * 0.5)
        except Exception:  # noqa: BLE001 - it wants other targets: it cannot be told here
            continue
        if len(getattr(value, "shape", ())) == 0:
            found.append(getattr(loss, "__name__", None) or type(loss).__name__)
    return found


def _keras_own(fn: Any) -> bool:
    owner = getattr(fn, "__func__", fn)
    return getattr(owner, "__module__", "").startswith("keras")


def shaped(weight: Any, like: Any) -> Any:
    """A per-row weight (B,) as (B, 1, ..., 1), the rank of `like` (a target or output).

    Keras's losses broadcast a sample weight only when ranks differ by one with a last
    dimension of 1; a per-timestep loss (B, T) against a (B,) weight would not broadcast.
    A weight of more dimensions (per-timestep weights, (B, T)) is the user's own shape, which
    Keras takes as it is.
    """
    rank = len(like.shape)
    if len(weight.shape) != 1 or rank <= 1:
        return weight
    return ops.reshape(weight, (-1,) + (1,) * (rank - 1))


def _by_row(per_row: Any, weight: Any) -> Any:
    """A per-row value (B,) shaped to multiply a weight of any rank ((B,) or (B, T, ...))."""
    extra = len(weight.shape) - 1
    return ops.reshape(per_row, (-1,) + (1,) * extra) if extra > 0 else per_row


def _per_output(weight: Any, y: Any) -> Any:
    leaves = keras.tree.flatten(y)
    if len({len(leaf.shape) for leaf in leaves}) == 1:
        return shaped(weight, leaves[0])
    return keras.tree.map_structure(lambda leaf: shaped(weight, leaf), y)


def enable(model: Any, replica_sum: Callable[[Any], Any] = lambda value: value) -> bool:
    """Puts the overrides on `model` (again after a new `compile`).

    Args:
        replica_sum: a value summed over the replicas inside a step (the backend's; the
            identity where a step sees the global batch).

    Returns:
        True when they were (re)installed: functions traced before must be traced again.
    """
    tracker = getattr(model, "_loss_tracker", None)
    kept = record.of(model)
    if tracker is None or not keras_steps(model) or kept.exact is tracker:
        return False
    record.install(model, "compute_loss", _exact_compute_loss(model, replica_sum))
    _weigh_by_real_samples(model, tracker)
    compiled_loss = getattr(model, "_compile_loss", None)
    if compiled_loss is not None:
        _on_build(compiled_loss, lambda: [_weigh_by_real_samples(model, t)
                                          for t in compiled_loss.metrics])
    compiled_metrics = getattr(model, "_compile_metrics", None)
    if compiled_metrics is not None:
        _mask_metrics(compiled_metrics)
    kept.exact = tracker
    return True


def _exact_compute_loss(model: Any, replica_sum: Callable[[Any], Any]) -> Callable[..., Any]:
    """The model's `compute_loss` over padded batches: its class's own, given the weight of
    `_weight_for` where a batch is packed or an output is masked."""
    original_loss = type(model).compute_loss.__get__(model)
    kept = record.of(model)

    def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
        predictions = keras.tree.flatten(y_pred)
        masks = [get_keras_mask(p) for p in predictions]
        packed = is_packed(sample_weight)
        if not packed and (all(m is None for m in masks) or not _one_weight(sample_weight)):
            kept.real_rows = None
            return original_loss(x, y, y_pred, sample_weight, training=training)
        if packed:
            real = ops.cast(sample_weight[REAL], "float32")
            users = ops.cast(sample_weight[WEIGHT], "float32")  # (B,) or per timestep (B, T)
            rows = ops.cast(sample_weight[MASK], "float32")
            # This step's (replica's) rows times the batch's real share: its real samples' worth.
            kept.real_rows = ops.cast(ops.shape(real)[0], "float32") * ops.mean(real)
        else:  # whole batches, a masked output: only its normalization needs care
            rows = ops.ones((ops.shape(predictions[0])[0],), "float32")
            real = rows
            users = rows if sample_weight is None else ops.cast(sample_weight, "float32")
            kept.real_rows = None
        weights = [_weight_for(mask, rows, real, users, replica_sum) for mask in masks]
        if len(weights) == 1:
            weight = _per_output(weights[0], y)
        else:  # one a output, in the outputs' structure (Keras reads it by their paths)
            weight = keras.tree.pack_sequence_as(y_pred, [
                shaped(w, leaf) for w, leaf in zip(weights, _targets(model, y, y_pred))])
        for prediction, mask in zip(predictions, masks):  # in the weight now (see _weight_for)
            if mask is not None:
                set_keras_mask(prediction, None)
        try:
            return original_loss(x, y, y_pred, weight, training=training)
        finally:  # the metrics read the outputs' masks as Keras left them
            for prediction, mask in zip(predictions, masks):
                if mask is not None:
                    set_keras_mask(prediction, mask)

    return compute_loss


def _targets(model: Any, y: Any, y_pred: Any) -> list:
    """The targets in the order of the outputs: a dict of targets for a list of outputs is
    read by the outputs' names, as Keras's compiled loss reads it."""
    names = list(getattr(model, "output_names", None) or [])
    if isinstance(y, dict) and isinstance(y_pred, (list, tuple)) and set(names) == set(y):
        return [y[name] for name in names]
    return keras.tree.flatten(y)


def _weight_for(keras_mask: Any, rows: Any, real: Any, users: Any,
                replica_sum: Callable[[Any], Any]) -> Any:
    """One output's loss weight over a (padded) batch.

    Without a Keras mask on the output, Keras's loss divides by the padded batch's elements,
    so the real rows are weighed up by 1/REAL. With one (a masked sequence, a KerasHub
    task's padding mask) plain Keras divides by the mask's true entries over the whole
    batch; here the mask goes into the weight, scaled by all replicas' elements over all
    replicas' real unmasked entries (padded rows left out), and is taken off the output
    while the loss is computed: the same mean on one device, on a global batch (JAX) or
    averaged over replicas that each hold a different share of the masked entries (TF).
    """
    if keras_mask is None:
        return _by_row(rows / real, users) * users
    valid = ops.cast(keras_mask, "float32") * _by_row(rows, keras_mask)
    elements = replica_sum(ops.cast(ops.size(valid), "float32"))
    counted = replica_sum(ops.sum(valid))
    per_entry = _by_row(users, valid) if len(users.shape) < len(valid.shape) else users
    return per_entry * valid * ops.divide_no_nan(elements, counted)


def _one_weight(sample_weight: Any) -> bool:
    """No sample weight, or one array for all outputs (not one per output)."""
    return sample_weight is None or not isinstance(sample_weight, (dict, list, tuple))


def _weigh_by_real_samples(model: Any, tracker: Any) -> None:
    """A loss tracker (a Mean Keras weighs by the batch's rows) weighs a padded batch by its
    real samples instead.

    Keras passes the rows as a static shape for the per-output trackers, which is None
    once tf.function relaxes shapes on a retrace (then plain Keras weighs every batch
    alike); the real samples' worth from `compute_loss` does not depend on it.
    """
    original = tracker.update_state
    kept = record.of(model)

    def update_state(values, sample_weight=None):
        real = kept.real_rows
        return original(values, sample_weight=sample_weight if real is None else real)

    record.install(tracker, "update_state", update_state)


def _on_build(compiled_loss: Any, then: Any) -> None:
    """Per-output loss trackers exist only once the compiled loss is built (in the first step)."""
    if compiled_loss.built:
        then()
        return
    original = compiled_loss.build

    def build(y_true, y_pred):
        original(y_true, y_pred)
        then()

    record.install(compiled_loss, "build", build)


def _mask_metrics(compiled_metrics: Any) -> None:
    """`metrics=` get the 0/1 mask, `weighted_metrics=` the mask times the user's weights."""
    original = compiled_metrics.update_state

    def update_state(y_true, y_pred, sample_weight=None):
        if not is_packed(sample_weight):
            return original(y_true, y_pred, sample_weight)
        if not compiled_metrics.built:
            compiled_metrics.build(y_true, y_pred)
        mask = ops.cast(sample_weight[MASK], "float32")
        users = ops.cast(sample_weight[WEIGHT], "float32")
        weighted = _by_row(mask, users) * users
        truths = compiled_metrics._flatten_y(y_true)
        predictions = compiled_metrics._flatten_y(y_pred)
        for group, weight in ((compiled_metrics._flat_metrics, mask),
                              (compiled_metrics._flat_weighted_metrics, weighted)):
            for metric, truth, prediction in zip(group, truths, predictions):
                # an output's metrics come as Keras's MetricsList: each weighed its own way
                inner = metric.metrics if type(metric).__name__ == "MetricsList" else [metric]
                for each in inner if metric else []:
                    each.update_state(truth, prediction, _metric_weight(each, weight, truth))

    record.install(compiled_metrics, "update_state", update_state)


# Keras's metrics that shape a per-row weight (B,) themselves (F1Score's `expand_dims`)
_ROW_WEIGHTED = ("FBetaScore",)


def _metric_weight(metric: Any, weight: Any, truth: Any) -> Any:
    """A metric's per-row weight: (B,) where the metric shapes it itself, else of the
    target's rank (`shaped`), which the confusion metrics broadcast against predictions."""
    if any(kind.__name__ in _ROW_WEIGHTED for kind in type(metric).__mro__):
        return weight
    return shaped(weight, truth)


def why_not_exact(model: Any, has_targets: bool, rest_on_one_device: bool = False) -> str | None:
    """None where padding can be masked out of this model's loss; else why not, and what
    tpu_magic does instead (whole batches of real samples only; `rest_on_one_device`:
    evaluate's last samples run on one device, see `Backend.evaluate_rest`)."""
    if masks_reach_loss(model, has_targets):
        return None
    scalar = scalar_losses(model) if has_targets and keras_steps(model) else []
    if scalar:
        why = (f"its loss {', '.join(scalar)} reduces a batch to one number itself, so a "
               "sample weight cannot reach its rows (return one value per sample to let "
               "Keras reduce it)")
    elif keras_steps(model):
        why = "it has no targets or compiled loss (its loss comes from add_loss)"
    else:
        why = ("its train_step/test_step/compute_loss/compute_metrics are its own and may "
               "ignore sample weights")
    return (f"{why}, so padded samples could reach its loss. tpu_magic feeds it whole "
            "batches of real samples only: fit leaves out the last few samples of each "
            "epoch's shuffled order (different ones each epoch), "
            + ("validation the last few samples, fewer than one batch (the report counts "
               "them); evaluate runs its last few samples on one device."
               if rest_on_one_device else
               "evaluate the last few samples, each fewer than one batch (the report counts "
               "them)."))


@contextlib.contextmanager
def suspended(model: Any) -> Iterator[None]:
    """Plain Keras's steps for a while: the overrides `enable` put on the model, its loss
    trackers and compiled metrics taken off, and put back after (the parity check's
    one-device step runs so)."""
    compiled_loss = getattr(model, "_compile_loss", None)
    owners = [model, getattr(model, "_loss_tracker", None), compiled_loss,
              getattr(model, "_compile_metrics", None),
              *(getattr(compiled_loss, "metrics", None) or [])]
    with contextlib.ExitStack() as stack:
        for owner in owners:
            if owner is not None:
                stack.enter_context(without(owner, list(record.installed(owner))))
        yield
