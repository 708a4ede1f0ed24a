"""`--shard model` on JAX: Keras's `ModelParallel` over a mesh of data rows by model
columns, finding each variable's layout itself: from the layout map of the model's class
where it offers one (`get_layout_map(mesh, model_dim, data_dim)`, as KerasHub's Gemma,
Llama and Qwen backbones do), else from the variable's shape (`core.layouts.derived_spec`),
so any model is sharded. Each variable records where its layout came from.

Which classes' maps apply is given, never searched for: the models a variable belongs to
where it exists already, else the `owners` the cell gives (the classes its code names,
resolved when the variable is made, while the cell builds its model).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from tpu_magic.core import record
from tpu_magic.core.deps import require_jax
from tpu_magic.core.layouts import derived_spec
from tpu_magic.core.session import Connection

LAYOUT_SOURCE = "layout_source"  # kept about a variable: where its layout came from (report)

Owners = Callable[[], Iterable[type]]  # the classes whose layout maps apply, asked when needed


def model_parallel(connection: Connection, rows: int, columns: int,
                   owners: Owners | None = None) -> Connection:
    """`connection` on a `rows` x `columns` mesh of its devices ("batch" by "model"), each
    host feeding its own rows (`data.row_split`); `owners` (see the module)."""
    import keras

    devices = list(connection.strategy.device_mesh.devices.flatten())
    mesh = keras.distribution.DeviceMesh((rows, columns), ["batch", "model"], devices)
    distribution = _model_parallel_class()(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch",
        auto_shard_dataset=False, owners=owners)
    return dataclasses.replace(connection, strategy=distribution, replicas=rows)


def _model_parallel_class() -> type:
    """Keras's `ModelParallel` whose variables' layouts are `layout_of`'s. A class made on
    demand: Keras is imported here, not when this module is."""
    import keras

    class DerivedModelParallel(keras.distribution.ModelParallel):
        def __init__(self, *, owners: Owners | None = None, **kwargs: Any):
            super().__init__(**kwargs)
            self._owners = owners or tuple

        def get_variable_layout(self, variable):
            if getattr(variable, "_layout", None) is not None:
                return variable._layout
            return self.layout_for(variable)

        def layout_for(self, variable, owners=()):
            """The layout of `variable` on this mesh (`owners`: models whose layout maps
            apply, for variables that exist already; else the cell's owners)."""
            return layout_of(self, variable, [type(o) for o in owners] or
                             list(self._owners()))

    return DerivedModelParallel


def layout_of(distribution: Any, variable: Any, owners: list[type]) -> Any:
    """`variable`'s layout on the distribution's mesh: the distribution's layout map, else
    the first of `owners`' layout maps that names it, else derived from its shape. A mapped
    layout whose mesh axis does not divide the variable's dimension (a small model's heads)
    is derived instead, and said, where `device_put` would fail."""
    shape = tuple(variable.shape)
    mesh = distribution.device_mesh
    mapped, source = distribution._layout_map[variable.path], "the layout map"
    if mapped is None:
        mapped, source = _owners_layout(distribution, variable.path, owners)
    if mapped is not None:
        axes = dict(zip(mesh.axis_names, mesh.shape))
        spec = tuple(mapped.axes) + (None,) * (len(shape) - len(mapped.axes))
        if all(a is None or d % axes[a] == 0 for a, d in zip(spec, shape)):
            record.keep(variable, LAYOUT_SOURCE, source)
            return mapped
        source = (f"derived: {source}'s {tuple(mapped.axes)} does not divide "
                  f"{shape} over the mesh {dict(axes)}")
    else:
        source = "derived from its shape"
    record.keep(variable, LAYOUT_SOURCE, source)
    import keras

    columns = mesh.shape[mesh.axis_names.index("model")]
    itemsize = require_jax().numpy.dtype(variable.dtype).itemsize
    return keras.distribution.TensorLayout(derived_spec(shape, itemsize, columns), mesh)


def _owners_layout(distribution: Any, path: str, owners: list[type]) -> tuple[Any, str]:
    """The layout the first of `owners` whose `get_layout_map` names `path` gives it, and
    where it came from; (None, "") where none does. Each class's map is made once a mesh."""
    maps = record.kept(distribution, "own_maps")
    if maps is None:
        maps = {}
        record.keep(distribution, "own_maps", maps)
    for owner in owners:
        if not callable(getattr(owner, "get_layout_map", None)):
            continue
        own = maps.get(owner)
        if own is None:
            own = maps[owner] = owner.get_layout_map(
                distribution.device_mesh, model_parallel_dim_name="model",
                data_parallel_dim_name="batch")
        if own[path] is not None:
            return own[path], f"{owner.__name__}.get_layout_map"
    return None, ""
