"""An execution's batches: read from tpu_magic's own pipeline a group at a time (the next
execution's staged while the device runs this one), or taken from Keras's iterator, and
stacked into groups of one batch type, each placed on the devices as the program takes it.

A batch's arrays go where the distribution lays out a batch (split along the mesh's batch
axis; whole on every device for a batch the axis does not divide or one marked
`WholeRows`); a group's along its second axis. On a mesh of one device a NumPy array stays
on the host (the program's own call moves it, in C++). `spec` describes a group's arrays as
the programs are compiled for them, so a program compiled ahead (`programs`) is the one the
group then runs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from tpu_magic.backends.jax.loop.epoch_reads import Reads
from tpu_magic.core.deps import require_jax


class Group:
    """Batches of one type run as one program: `data` stacked (length `length`), or one
    batch (`single`)."""

    def __init__(self, data: Any, length: int, single: bool) -> None:
        self.data, self.length, self.single = data, length, single
        self.signature = signature(data)

    @classmethod
    def gathered(cls, stacked: Any) -> "Group":
        """A group gathered on the host (`PaddedBatches.group`): put on the devices at once."""
        return cls(placed(stacked, stacked=True), len(_leaves(stacked)[0]), single=False)

    @classmethod
    def one(cls, batch: Any) -> "Group":
        """A batch of its own, from the host."""
        return cls(placed(batch, stacked=False), 1, single=True)

    def __len__(self) -> int:
        return 1 if self.single else self.length


def signature(data: Any) -> tuple:
    """A group's type: each array's shape, dtype and layout (a program is compiled for it).
    The dtype as JAX takes it (NumPy's int64 labels are int32 to a program without x64:
    the same program as for int32 ones)."""
    canonical = require_jax().dtypes.canonicalize_dtype
    return tuple((tuple(a.shape), canonical(a.dtype), getattr(a, "sharding", None))
                 for a in _leaves(data))


def spec(data: Any, length: int | None = None) -> Any:
    """`data` as the abstract arguments a program is compiled for; `length`: a group of that
    many of the batch `data` (stacked along a new first axis)."""
    jax = require_jax()

    def abstract(array: Any) -> Any:
        shape, sharding = tuple(array.shape), getattr(array, "sharding", None)
        if length is not None:
            shape = (length,) + shape
            sharding = None if sharding is None else stacked_sharding(sharding)
        return jax.ShapeDtypeStruct(shape, array.dtype, sharding=sharding)

    return jax.tree_util.tree_map(abstract, data)


def stacked_sharding(sharding: Any) -> Any:
    """A batch's layout for a stack of such batches: the same, one axis further."""
    jax = require_jax()
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec(None, *sharding.spec))
    return sharding


def placed(data: Any, stacked: bool) -> Any:
    """Host arrays on the devices as the distribution lays out a batch (`stacked`: along
    the second axis; `layout_of`); on one device (or with no distribution) NumPy stays (the
    program's call moves it)."""
    import keras
    import numpy as np

    jax = require_jax()
    distribution = keras.distribution.distribution()
    if distribution is None or distribution.device_mesh.devices.size == 1:
        return data  # `layout_of` places nothing there; asked once a step, so not asked

    def place(array: Any) -> Any:
        sharding = layout_of(array, stacked, distribution)
        return array if sharding is None else jax.device_put(np.asarray(array), sharding)

    return keras.tree.map_structure(place, data)


def batch_spec(batch: Any) -> Any:
    """A host batch as the abstract arguments of the program that will run it alone (laid
    out as `placed` lays it out, nothing moved): what the memory plan compiles."""
    import keras

    jax = require_jax()
    distribution = keras.distribution.distribution()
    return keras.tree.map_structure(
        lambda a: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype,
                                       sharding=layout_of(a, False, distribution)), batch)


def layout_of(array: Any, stacked: bool, distribution: Any) -> Any:
    """Where a host array of a batch goes: where the distribution lays out a batch; whole on
    every device for a `WholeRows` array or one the batch axis does not divide; None (it
    stays on the host) with no distribution or on one device."""
    from tpu_magic.backends.jax.data import WholeRows

    jax = require_jax()
    if distribution is None:
        return None
    shape = tuple(array.shape[1:] if stacked else array.shape)
    layout = distribution.get_data_layout(shape).backend_layout
    if layout.num_devices == 1:
        return None
    whole = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
    if isinstance(array, WholeRows):  # whole on every device (a small prediction's)
        return whole
    sharding = stacked_sharding(layout) if stacked else layout
    try:
        sharding.shard_shape(tuple(array.shape))
    except Exception:  # noqa: BLE001 - jax's IndivisibleError: a batch the rows do not divide
        return whole  # goes whole to every device, as `replica_steps` gives it
    return sharding


def taken(iterator: Any, k: int) -> list:
    """Up to `k` batches from Keras's iterator (placed on the devices); StopIteration where
    it has none, as Keras's own loop expects."""
    batches = [next(iterator)]
    for _ in range(k - 1):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    return batches


def alike(batches: list) -> list[Group]:
    """Consecutive batches of one type stacked together; a lone batch runs on its own."""
    groups: list[Group] = []
    run: list = []

    def close() -> None:
        if len(run) == 1:
            groups.append(Group(run[0], 1, single=True))
        elif run:
            groups.append(Group(_stacked_on_device(run), len(run), single=False))
        run.clear()

    for batch in batches:
        if run and _kind(batch) != _kind(run[0]):
            close()
        run.append(batch)
    close()
    return groups


class Reader:
    """One call's reading of tpu_magic's own pipelines (by role: "train", "test",
    "predict"), a group at a time, the next execution's staged while the device runs."""

    def __init__(self, sources: dict[str, Any]) -> None:
        self.sources = sources
        self._ahead: dict[str, tuple] = {}  # kind -> (pass, first step, staged groups)

    def groups(self, kind: str, iterator: Any, limit: int) -> list[Group]:
        """The execution's batches (at most `limit`; StopIteration where there is none), as
        groups of consecutive batches of one type. From tpu_magic's own pipeline without
        Keras's iterator, which then reads nothing (each pass is a new `Reads`, from
        batch 0); else Keras's batches."""
        source = self.sources.get(kind) if isinstance(iterator, Reads) else None
        if source is None:
            return alike(taken(iterator, limit))
        done = iterator.done
        if done >= len(source):
            raise StopIteration
        steps = min(limit, len(source) - done)
        ahead = self._ahead.pop(kind, None)
        found = ahead[2] if ahead is not None and ahead[:2] == (iterator, done) and \
            sum(len(group) for group in ahead[2]) == steps else _read(source, done, steps)
        iterator.took(steps)
        return found

    def stage(self, kind: str, iterator: Any, limit: int) -> None:
        """The next execution's batches of this pass (`limit` steps, or the rest of the
        pass) read and on their way to the devices while the device runs the one just
        dispatched; only within the pass, whose order is fixed."""
        source = self.sources.get(kind)
        if source is None or not isinstance(iterator, Reads):
            return
        done = iterator.done
        if done < len(source):
            self._ahead[kind] = (iterator, done,
                                 _read(source, done, min(limit, len(source) - done)))

    def finished(self) -> None:
        self._ahead.clear()


def _read(source: Any, done: int, steps: int) -> list[Group]:
    """`steps` batches from tpu_magic's own pipeline, from its `done`th, on the devices;
    one step alone as a batch of its own (the program a step on its own runs)."""
    if steps == 1:
        return [Group.one(source[done])]
    return [Group.gathered(data) if stacked else Group.one(data)
            for data, stacked in source.group(done, steps)]


def unstacked(out: Any) -> Any:
    """A group's predictions, (K, batch, ...), as Keras joins an execution's: (K × batch, ...)."""
    import keras

    return keras.tree.map_structure(
        lambda a: a.reshape((a.shape[0] * a.shape[1],) + tuple(a.shape[2:])), out)


def joined(outputs: list) -> Any:
    if len(outputs) == 1:
        return outputs[0]
    import jax.numpy as jnp
    import keras

    return keras.tree.map_structure(lambda *parts: jnp.concatenate(parts), *outputs)


def _kind(batch: Any) -> tuple:
    jax = require_jax()
    leaves, tree = jax.tree_util.tree_flatten(batch)
    return tree, tuple((tuple(a.shape), a.dtype, getattr(a, "sharding", None))
                       for a in leaves)


def _leaves(data: Any) -> list:
    return require_jax().tree_util.tree_leaves(data)


def _stacked_on_device(batches: list) -> Any:
    """Batches already on the devices (or NumPy, on one device), stacked along a new first
    axis there: one program, its output laid out as `spec` says."""
    jax = require_jax()
    leaves = _leaves(batches[0])
    shardings = tuple(getattr(a, "sharding", None) for a in leaves)
    if any(s is None for s in shardings):  # NumPy from Keras's one-device iterator
        import numpy as np

        return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *batches)
    return _stacker(jax.tree_util.tree_structure(batches[0]),
                    tuple(stacked_sharding(s) for s in shardings))(*batches)


@functools.cache
def _stacker(tree: Any, shardings: tuple) -> Callable[..., Any]:
    jax = require_jax()
    import jax.numpy as jnp

    return jax.jit(lambda *parts: jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *parts),
                   out_shardings=jax.tree_util.tree_unflatten(tree, shardings))
