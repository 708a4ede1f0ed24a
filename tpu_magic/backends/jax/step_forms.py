"""A training step in the form that fits a device (`core.steps.StepForm`): its batch as
micro-batches inside the step, and/or its repeated blocks rematerialized, with the full
batch's numbers.

Micro-batches. The global batch's rows are dealt into m micro-batches (row i to micro-batch
i mod m: each device keeps its own rows, no data moves), and one compiled step runs Keras's
own `compute_loss_and_updates` on each in turn (a loop on the device), adding up its
gradients, then applies the optimizer once (its learning-rate schedule and `iterations`
advance once a batch). Keras's loss divides a batch's weighted sum by its elements, so a
micro-batch's loss is an estimate of the whole batch's whose mean over the micro-batches
is exactly the whole batch's loss (regularization losses included), and so is the mean of
the gradients. Where an output carries a Keras mask, Keras divides by the mask's true
entries instead: those are counted over the whole batch first (a forward pass, no
gradients) and each micro-batch's loss is weighed by them, so the mean is again the whole
batch's. The compiled metrics and the loss tracker are updated micro-batch by micro-batch:
sums and counts, the whole batch's results. A model whose training draws random numbers
(Dropout, noise, augmentation: a micro-batch draws its own), whose forward pass adds losses
of its own (`add_loss` in `call`: a sum over rows is not a mean) or whose training step or
loss is its own is not micro-batched (`not_exact` says why). BatchNormalization in training
mode normalizes each micro-batch by its own statistics, as replicas do (`normalizes_parts`).

Rematerialization. The model's repeated blocks (the layers of one class that appear
several times with weights: transformer blocks, residual stages) run under Keras's own
rematerialization (`RematScope(mode="full")`, set on those layers while the step is
traced): their activations are recomputed in the backward pass instead of kept. The same
operations run, so the numbers are the same.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable, Iterator

from tpu_magic.core.deps import require_jax
from tpu_magic.core.overrides import overridden
from tpu_magic.core.steps import StepForm


def train_step(model: Any, form: StepForm, on_one_device: bool = False
               ) -> Callable[..., Any]:
    """Keras's stateless train step in `form` (as written: Keras's own). `on_one_device`:
    the step's batch is on one device (the parity check's), so its micro-batches are runs
    of rows (a reshape, no copy) rather than dealt (a transposed copy of the batch)."""
    keras_step = model.train_step
    if form.as_written:
        return keras_step
    blocks = repeated_blocks(model) if form.remat else []

    def step(state: Any, data: Any) -> Any:
        with rematerialized(blocks):
            if form.micro == 1:
                return keras_step(state, data)
            return _micro_batched(model, form.micro, state, data, on_one_device)

    return step


def not_exact(model: Any) -> str | None:
    """Why micro-batches would not give this model's full-batch numbers (None: they do)."""
    from keras.src.backend.jax.trainer import JAXTrainer

    for name in ("train_step", "compute_loss", "compute_loss_and_updates"):
        if getattr(type(model), name, None) is not getattr(JAXTrainer, name, None) and \
                not _keras_own(type(model), name):
            return f"its {name} is its own"
    drawing = [type(layer).__name__ for layer in model._flatten_layers(include_self=False)
               if getattr(layer, "_seed_generators", None) and
               getattr(layer, "rate", None) != 0]
    if drawing:
        return (f"it draws random numbers while training ({', '.join(sorted(set(drawing)))}),"
                " which a micro-batch draws for its own rows")
    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, "activity_regularizer", None) is not None:
            return f"{layer.name} adds an activity loss, a sum over its batch's rows"
    for loss in _losses(model):
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction not in ("sum_over_batch_size", "mean", None):
            return f"its loss {type(loss).__name__} reduces with {reduction!r}"
    return None


def normalizes_parts(model: Any) -> list[str]:
    """The layers that, in training, normalize each micro-batch by its own statistics."""
    import keras

    return [layer.name for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable]


def repeated_blocks(model: Any) -> list[Any]:
    """The model's repeated blocks: layers of one class with weights of their own that
    appear at least twice, none inside another (a transformer's decoder blocks, a ResNet's
    residual blocks); the outermost such class."""
    layers = [layer for layer in model._flatten_layers(include_self=False)
              if layer.weights and list(layer._flatten_layers(include_self=False))]
    counts = Counter(type(layer) for layer in layers)
    for layer in layers:  # outermost first (Keras walks depth-first, parents first)
        if counts[type(layer)] >= 2:
            return [found for found in layers if type(found) is type(layer)]
    return []


@contextlib.contextmanager
def rematerialized(blocks: list[Any]) -> Iterator[None]:
    """While a step is traced: each block's call recomputed in the backward pass (Keras's
    own `RematScope(mode="full")` on the layer)."""
    if not blocks:
        yield
        return
    from keras.src.backend.common.remat import RematScope

    mode = RematScope(mode="full")
    with contextlib.ExitStack() as stack:
        for block in blocks:
            stack.enter_context(overridden(block, "_remat_mode", mode))
        yield


def _micro_batched(model: Any, m: int, state: Any, data: Any, runs: bool = False) -> Any:
    """Keras's train step on `data` as `m` micro-batches (see the module's docstring;
    `runs`: of consecutive rows, `_dealt`)."""
    import keras

    jax = require_jax()
    import jax.numpy as jnp

    trainable, non_trainable, optimizer_vars, metrics_vars = state
    x, y, weights = keras.utils.unpack_x_y_sample_weight(data)
    rows = int(keras.tree.flatten(x)[0].shape[0])
    if rows % m:  # a short batch the micro-batches do not divide: as written, it is smaller
        return model.train_step(state, data)
    if isinstance(weights, dict):  # a padded batch's packed weight (`exactness`)
        raise ValueError("a padded batch: its padding is masked out over the whole batch")
    parts = jax.tree_util.tree_map(lambda a: _dealt(a, m, runs), (x, y, weights))
    valid = _valid_entries(model, trainable, non_trainable, parts)
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)

    def body(carry: Any, part: Any) -> Any:
        grads, fixed, metrics = carry
        px, py, pw = part
        with _weighed_by_the_whole(model, m, valid):
            (_, aux), step_grads = grad_fn(trainable, fixed, metrics, px, py, pw,
                                           training=True, optimizer_variables=optimizer_vars)
        unscaled, y_pred, fixed, metrics = aux
        grads = jax.tree_util.tree_map(
            lambda total, g: total + g.astype(total.dtype) / m, grads, step_grads)
        logs, metrics = model._update_metrics_variables(metrics, unscaled, px, py, y_pred, pw)
        return (grads, fixed, metrics), logs

    zeros = jax.tree_util.tree_map(
        lambda v: jnp.zeros(v.shape, jnp.promote_types(v.dtype, jnp.float32)), trainable)
    (grads, non_trainable, metrics_vars), logs = jax.lax.scan(
        body, (zeros, non_trainable, metrics_vars), parts)
    grads = jax.tree_util.tree_map(lambda g, v: g.astype(v.dtype), grads, trainable)
    trainable, optimizer_vars = model.optimizer.stateless_apply(optimizer_vars, grads,
                                                                trainable)
    logs = jax.tree_util.tree_map(lambda a: a[-1], logs)
    return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)


def _dealt(array: Any, m: int, runs: bool = False) -> Any:
    """A batch's rows dealt into `m` micro-batches, (m, rows/m, ...): row i to micro-batch
    i mod m, so each device's rows stay its own; or (`runs`, a batch on one device) the
    first rows/m rows to the first and so on, a reshape that copies nothing (dealing
    there would transpose a copy of the whole batch)."""
    if array is None:
        return None
    rows = array.shape[0]
    if runs:
        return array.reshape((m, rows // m) + tuple(array.shape[1:]))
    return array.reshape((rows // m, m) + tuple(array.shape[1:])).swapaxes(0, 1)


def _valid_entries(model: Any, trainable: Any, non_trainable: Any, parts: Any) -> Any:
    """The true entries of the output's Keras mask over the whole batch (a forward pass of
    every micro-batch, no gradients), or None where the output carries no mask (the pass
    is then left out of the program). Several masked outputs: not micro-batched."""
    import keras
    from keras.src.backend.common.masking import get_keras_mask

    jax = require_jax()
    import jax.numpy as jnp

    def masks(px: Any) -> list:
        y_pred, _ = model.stateless_call(trainable, non_trainable, px, training=False)
        return [get_keras_mask(p) for p in keras.tree.flatten(y_pred)]

    first = masks(jax.tree_util.tree_map(lambda a: a[0], parts[0]))
    found = [mask for mask in first if mask is not None]
    if not found:
        return None
    if len(keras.tree.flatten(first)) > 1:
        raise ValueError("several outputs and a Keras mask: micro-batches would not give "
                         "the full batch's loss")

    def count(total: Any, px: Any) -> Any:
        mask = masks(px)[0]
        return total + jnp.sum(mask.astype("float32")), None

    total, _ = jax.lax.scan(count, jnp.zeros((), "float32"), parts[0])
    return total


@contextlib.contextmanager
def _weighed_by_the_whole(model: Any, m: int, valid: Any) -> Iterator[None]:
    """While a micro-batch's loss is traced: a masked output's loss weighed so that its
    mean over the micro-batches is the whole batch's (the mask in the weight, scaled by the
    micro-batches' entries over the whole batch's true ones, and off the output meanwhile).
    Nothing where no output is masked."""
    if valid is None:
        yield
        return
    import keras
    from keras import ops
    from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

    own = model.compute_loss

    def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
        prediction = keras.tree.flatten(y_pred)[0]
        mask = ops.cast(get_keras_mask(prediction), "float32")
        scale = ops.cast(ops.size(mask), "float32") * m / valid
        weight = mask * scale
        if sample_weight is not None:
            users = ops.cast(sample_weight, "float32")
            while len(users.shape) < len(weight.shape):
                users = ops.expand_dims(users, -1)
            weight = weight * users
        kept = get_keras_mask(prediction)
        set_keras_mask(prediction, None)
        try:
            return own(x, y, y_pred, weight, training=training)
        finally:
            set_keras_mask(prediction, kept)  # the metrics read it as Keras gave it

    with overridden(model, "compute_loss", compute_loss):
        yield


def _keras_own(cls: type, name: str) -> bool:
    """Whether `cls`'s `name` is Keras's own (defined in a keras module), a KerasHub task's
    included: they do not change how a batch's loss is reduced."""
    for klass in cls.__mro__:
        if name in vars(klass):
            module = klass.__module__
            return module.startswith("keras.") or module.startswith("keras_hub.")
    return True


def _losses(model: Any) -> list:
    """The compiled loss objects (Keras's `Loss` instances), flattened."""
    compiled = getattr(model, "_compile_loss", None)
    found = getattr(compiled, "_flat_losses", None) or []
    return [getattr(loss, "fn", loss) for loss in found]
