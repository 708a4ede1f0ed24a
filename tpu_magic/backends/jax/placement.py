"""Where a model's variables live on JAX: those off the distribution's devices, a model laid
out again for another mesh (`--shard auto`), the user's own distribution, each variable's
layout for the report, and the CPU for a copy."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from tpu_magic.backends.jax.model_parallel import LAYOUT_SOURCE
from tpu_magic.core import record
from tpu_magic.core.deps import require_jax
from tpu_magic.core.layouts import VariableShard
from tpu_magic.core.session import Connection
from tpu_magic.core.steps import state_groups
from tpu_magic.core.variables import variables_of


def reshard(model: Any, connection: Connection) -> None:
    """Lays out a model that exists already (its optimizer's and metrics' variables too)
    for the connection's mesh, one variable at a time: no second whole copy is made."""
    distribution, owners = connection.strategy, layout_owners(model)
    for variable in state_variables(model):
        variable._layout = distribution.layout_for(variable, owners)
        variable._direct_assign(variable.value)
    model.train_function = model.test_function = model.predict_function = None


def place(model: Any, connection: Connection) -> list:
    """A variable whose value lives off the distribution's devices (made outside every
    cell, on one device, or for another mesh) is laid out as the distribution lays it
    out and its value moved there: the same variable, the same model."""
    distribution = connection.strategy
    devices = mesh_devices(distribution)
    owners = layout_owners(model)
    moved = []
    for variable in state_variables(model):
        sharding = getattr(getattr(variable, "value", None), "sharding", None)
        if sharding is None or set(sharding.device_set) == devices:
            continue
        variable._layout = None  # a layout for another mesh does not hold here
        variable._layout = (distribution.layout_for(variable, owners)
                            if hasattr(distribution, "layout_for")
                            else distribution.get_variable_layout(variable))
        variable._direct_assign(variable.value)
        moved.append(variable)
    if moved:
        model.train_function = model.test_function = model.predict_function = None
    return moved


def outside_variables(model: Any, strategy: Any) -> list:
    """Variables made in a distribution's scope span its devices; these sit elsewhere."""
    devices = mesh_devices(strategy)
    found = []
    for variable in variables_of(model):
        sharding = getattr(getattr(variable, "value", variable), "sharding", None)
        if sharding is not None and set(sharding.device_set) != devices:
            found.append(variable)
    return found


def users_distribution(connection: Connection) -> tuple[Connection, str] | None:
    """The connection on the distribution the user set (`keras.distribution.
    set_distribution`), and how to describe it; None where none, or ours, is in force."""
    import keras

    from tpu_magic.backends.jax.data import data_rows

    distribution = keras.distribution.distribution()
    if distribution is None or distribution is connection.strategy:
        return None
    mesh = distribution.device_mesh
    shape = "x".join(str(d) for d in mesh.shape)
    described = (f"{type(distribution).__name__} over a {shape} mesh "
                 f"({', '.join(mesh.axis_names)})")
    return dataclasses.replace(connection, strategy=distribution,
                               replicas=data_rows(distribution)), described


def shard_rows(model: Any) -> list[VariableShard]:
    """Each weight's layout, its bytes on one device and in all, and where its layout came
    from (the report's sharding table)."""
    rows = []
    for variable in model.weights:
        value = getattr(variable, "value", variable)
        sharding = getattr(value, "sharding", None)
        spec = tuple(getattr(sharding, "spec", ()) or ())
        spec = tuple(s if isinstance(s, str) or s is None else "+".join(s) for s in spec)
        spec = spec + (None,) * (len(variable.shape) - len(spec))
        shards = getattr(value, "addressable_shards", None)
        per_device = shards[0].data.nbytes if shards else int(value.nbytes)
        rows.append(VariableShard(variable.path, tuple(variable.shape), spec, per_device,
                                  int(value.nbytes), record.kept(variable, LAYOUT_SOURCE, "")))
    return rows


@contextlib.contextmanager
def on_the_cpu() -> Iterator[None]:
    """No distribution in force, and JAX's default device the CPU (a copy built here)."""
    import keras

    jax = require_jax()
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            yield
    finally:
        keras.distribution.set_distribution(distribution)


def mesh_devices(distribution: Any) -> set:
    """The JAX devices of a distribution's mesh (Keras's mesh may hold them as names)."""
    return set(distribution.device_mesh.backend_mesh.devices.flatten())


def state_variables(model: Any) -> list:
    return [v for group in state_groups(model) for v in group]


def layout_owners(model: Any) -> list:
    """The model and its parts whose class offers `get_layout_map` (a KerasHub backbone)."""
    return [layer for layer in [model, *model._flatten_layers(include_self=False)]
            if callable(getattr(type(layer), "get_layout_map", None))]
