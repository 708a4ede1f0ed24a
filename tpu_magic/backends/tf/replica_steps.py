"""The replicas' loss semantics under `MirroredStrategy`: each replica's losses stay its own
batch's mean and the optimizers average the gradients, so every path (Keras's own steps, a
custom `train_step`, a layer's `add_loss`) computes the numbers one device would."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from tpu_magic.core import record
from tpu_magic.core.deps import require_tensorflow
from tpu_magic.core.session import Connection


@contextlib.contextmanager
def replica_steps(model: Any, connection: Connection) -> Iterator[None]:
    """Keras on TensorFlow divides every `Loss` result and `add_loss` total computed in a
    replica by the replica count, sums the replicas' gradients, and multiplies the
    loss back only inside its own `train_step`/`test_step`. A custom step (or a layer
    calling a loss object and `add_loss`) then logs 1/R of its loss, or trains on 1/R of
    it. Here, instead, a replica's losses stay its own batch's mean (scaling is off while
    the model's steps are traced) and the model's optimizers average the gradients: the
    same numbers on every path as on one device.

    An optimizer a custom `compile` keeps (a GAN's two) would build its slots inside the
    first step, in a replica, which TensorFlow cannot run ("You must feed a value for
    placeholder tensor"): it is built here first, over all the model's trainable
    variables (it updates only those its step gives it; the others' slots stay unused).
    """
    if not mirrored_replicas(connection):
        yield
        return
    for optimizer in _optimizers_of(model):
        _average_gradients(optimizer)
        if not optimizer.built and model.trainable_variables:
            optimizer.build(model.trainable_variables)
    with _loss_scaling_off():
        yield


def replica_sum(value: Any) -> Any:
    """`value` summed over the replicas, inside a replica's step."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def mirrored_replicas(connection: Connection) -> bool:
    return connection.replicas > 1 and type(connection.strategy).__name__ == "MirroredStrategy"


_scaling_lock = threading.Lock()
_scaling_entries = 0  # how many tpu_magic calls are inside `_loss_scaling_off`
_keras_scaling: tuple = ()  # Keras's own (scale, unscale), while they are


@contextlib.contextmanager
def _loss_scaling_off() -> Iterator[None]:
    """Keras's `scale_loss_for_distribution` and `unscale_loss_for_distribution` (functions
    of `keras.src.losses.loss`, which its losses, trainer and compile utilities look up
    there) leave a loss as it is. Process-wide, since MirroredStrategy runs each replica's
    step on a thread of its own, where nothing thread-local would reach; counted under a
    lock while any call is inside: the first entry swaps them, the last exit puts Keras's
    back."""
    global _scaling_entries, _keras_scaling
    from keras.src.losses import loss as loss_module

    with _scaling_lock:
        if _scaling_entries == 0:
            _keras_scaling = (loss_module.scale_loss_for_distribution,
                              loss_module.unscale_loss_for_distribution)
            loss_module.scale_loss_for_distribution = \
                loss_module.unscale_loss_for_distribution = _unchanged
        _scaling_entries += 1
    try:
        yield
    finally:
        with _scaling_lock:
            _scaling_entries -= 1
            if _scaling_entries == 0:
                (loss_module.scale_loss_for_distribution,
                 loss_module.unscale_loss_for_distribution) = _keras_scaling


def _unchanged(value: Any) -> Any:
    return value


def _optimizers_of(model: Any) -> list[Any]:
    """The model's optimizers: `model.optimizer` and any a custom `compile` kept (a GAN's
    two), with the inner optimizer of a loss-scale optimizer."""
    import keras

    found = [v for v in [getattr(model, "optimizer", None), *vars(model).values()]
             if isinstance(v, keras.optimizers.Optimizer)]
    found += [o.inner_optimizer for o in found if hasattr(o, "inner_optimizer")]
    unique: dict[int, Any] = {}
    for optimizer in found:
        unique.setdefault(id(optimizer), optimizer)
    return list(unique.values())


def _average_gradients(optimizer: Any) -> None:
    """The optimizer all-reduces gradients to their mean over the replicas (Keras: the sum)."""
    if "_all_reduce_sum_gradients" in record.installed(optimizer):
        return
    tf = require_tensorflow()
    summed = optimizer._all_reduce_sum_gradients

    def all_reduce_mean(grads_and_vars):
        reduced = summed(grads_and_vars)
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context is not None else 1
        if replicas == 1:
            return reduced
        return [(None if g is None else _divided(tf, g, replicas), v) for g, v in reduced]

    record.install(optimizer, "_all_reduce_sum_gradients", all_reduce_mean)


def _divided(tf: Any, gradient: Any, n: int) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values / n, gradient.indices, gradient.dense_shape)
    return gradient / n
