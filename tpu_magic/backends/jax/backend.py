"""Keras on JAX: `DataParallel` over the devices, `PyDataset` inputs, the compilation cache.

Keras 3 reaches TPUs through JAX with `keras.distribution.DataParallel`: the global
batch is split over the devices, the variables are replicated. `--simulate N` splits
the host CPU into N XLA devices with `--xla_force_host_platform_device_count`, which
JAX reads once, when it first starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from tpu_magic.backends.jax import compile_cache as cache
from tpu_magic.backends.protocol import Named
from tpu_magic.core import process
from tpu_magic.core.devices import DeviceView, StepMemory, chip_named, device_name, host_memory, \
    memory_of, runs_per_second
from tpu_magic.core.deps import installed_versions
from tpu_magic.core.errors import ConnectError, MissingDependencyError
from tpu_magic.core.session import Connection
from tpu_magic.core.target import Target, no_tpu_fix
from tpu_magic.core.flops import counted_training_flops
from tpu_magic.core.layouts import VariableShard, derived_spec
from tpu_magic.core.steps import StepState, frozen_variables, host_copy
from tpu_magic.core.steps import state_groups as _state_groups
from tpu_magic.core.variables import variables_of

JAX_FIX = ("JAX is not installed: `pip install \"tpu_magic[jax]\"` (CPU), `pip install "
           "\"jax[tpu]\"` on a TPU VM or `pip install \"jax[cuda12]\"` for GPUs, then restart "
           "the runtime.")
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def require_jax() -> Any:
    try:
        import jax
    except ImportError:
        raise MissingDependencyError(JAX_FIX) from None
    return jax


def _bytes_on_one_device(array: Any) -> int:
    shards = getattr(array, "addressable_shards", None)
    return int(shards[0].data.nbytes) if shards else int(getattr(array, "nbytes", 0))


LAYOUT_SOURCE = "_tpu_magic_layout"  # on a variable: where its layout came from, for the report


def _model_parallel_class() -> type:
    """Keras's `ModelParallel` that finds each variable's layout itself: from the layout map
    of the model being built where its class offers one (`get_layout_map(mesh, model_dim,
    data_dim)`, as KerasHub's Gemma, Llama and Qwen backbones do), else from the variable's
    shape (`derived_spec`), so any model is sharded. A mapped layout whose mesh axis does not
    divide the variable's dimension (a small model's heads) is derived instead, and said,
    where `device_put` would fail. Each variable records where its layout came from."""
    import keras

    TensorLayout = keras.distribution.TensorLayout
    jnp = require_jax().numpy

    class DerivedModelParallel(keras.distribution.ModelParallel):
        def get_variable_layout(self, variable):
            if getattr(variable, "_layout", None) is not None:
                return variable._layout
            return self.layout_for(variable)

        def layout_for(self, variable, owners=()):
            """The layout of `variable` on this mesh (`owners`: models whose layout maps
            apply, for variables that exist already)."""
            shape = tuple(variable.shape)
            mesh = self.device_mesh
            mapped = self._layout_map[variable.path]
            source = "the layout map"
            if mapped is None:
                mapped, source = self._own_layout(variable.path, owners)
            if mapped is not None:
                axes = dict(zip(mesh.axis_names, mesh.shape))
                spec = tuple(mapped.axes) + (None,) * (len(shape) - len(mapped.axes))
                if all(a is None or d % axes[a] == 0 for a, d in zip(spec, shape)):
                    _mark(variable, source)
                    return mapped
                source = (f"derived: {source}'s {tuple(mapped.axes)} does not divide "
                          f"{shape} over the mesh {dict(axes)}")
            else:
                source = "derived from its shape"
            _mark(variable, source)
            columns = mesh.shape[mesh.axis_names.index("model")]
            return TensorLayout(derived_spec(shape, jnp.dtype(variable.dtype).itemsize, columns),
                                mesh)

        def _own_layout(self, path: str, owners: Any = ()) -> tuple[Any, str]:
            """The layout the model being built gives `path`, from its class's
            `get_layout_map` (found among `owners`, else on the stack: the model's own
            `__init__` or `enable_lora` is creating the variable)."""
            frame = sys._getframe(2)
            candidates = [type(o) for o in owners] or _selves(frame)
            for owner in candidates:
                if callable(getattr(owner, "get_layout_map", None)):
                    own = _own_maps(self).get(owner)
                    if own is None:
                        own = _own_maps(self)[owner] = owner.get_layout_map(
                            self.device_mesh, model_parallel_dim_name="model",
                            data_parallel_dim_name="batch")
                    return own[path], f"{owner.__name__}.get_layout_map"
            return None, ""

    def _selves(frame: Any) -> Iterator[type]:
        while frame is not None:
            yield type(frame.f_locals.get("self", None))
            frame = frame.f_back

    def _own_maps(distribution: Any) -> dict:
        return distribution.__dict__.setdefault("_tpu_magic_own_maps", {})

    def _mark(variable: Any, source: str) -> None:
        setattr(variable, LAYOUT_SOURCE, source)

    return DerivedModelParallel


@contextlib.contextmanager
def _outputs_gathered(model: Any, distribution: Any) -> Iterator[None]:
    """`model.predict_step` with its outputs replicated (an all-gather in the step), while a
    call runs across processes; Keras then reads each process's copy as the whole batch."""
    jax = require_jax()
    everywhere = jax.sharding.NamedSharding(distribution.device_mesh.backend_mesh,
                                            jax.sharding.PartitionSpec())
    own = type(model).predict_step.__get__(model)

    def predict_step(state: Any, data: Any) -> Any:
        outputs, rest = own(state, data)
        return jax.tree_util.tree_map(
            lambda out: jax.lax.with_sharding_constraint(out, everywhere), outputs), rest

    before = model.__dict__.get("predict_step")
    object.__setattr__(model, "predict_step", predict_step)
    model.predict_function = None
    try:
        yield
    finally:
        if before is None:
            model.__dict__.pop("predict_step", None)
        else:
            object.__setattr__(model, "predict_step", before)
        model.predict_function = None


_ragged_lock = threading.Lock()
_ragged_entries = 0  # how many tpu_magic calls are inside `_ragged_batches_whole`
_keras_distribute_data_input: Any = None  # Keras's own, while they are


def _whole_where_indivisible(keras_own: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's `distribute_data_input`, except that a batch the layout's axes do not divide
    goes to every device whole (replicated) instead of failing."""
    from tpu_magic.backends.jax.data import WholeRows

    def distribute_data_input(per_process_batch: Any, layout: Any, batch_dim_name: str) -> Any:
        jax = require_jax()
        sharding = getattr(layout, "backend_layout", layout)
        shape = tuple(getattr(per_process_batch, "shape", ()))
        if shape and isinstance(sharding, jax.sharding.NamedSharding) and \
                (isinstance(per_process_batch, WholeRows) or
                 (jax.process_count() == 1 and not _divides(sharding, shape))):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        return keras_own(per_process_batch, sharding, batch_dim_name)

    return distribute_data_input


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def _divides(sharding: Any, shape: tuple) -> bool:
    try:
        sharding.shard_shape(shape)
    except Exception:  # noqa: BLE001 - jax's IndivisibleError (a private class)
        return False
    return True


@contextlib.contextmanager
def _ragged_batches_whole() -> Iterator[None]:
    """While tpu_magic runs a model's steps: a batch the mesh's data rows do not divide (the
    last, short batch of a model whose loss cannot be masked, a dataset's short batch,
    `train_on_batch` of 12 rows on 8 devices) is given to every device whole, where Keras
    would fail (jax IndivisibleError). Each device then computes the whole batch: one
    device's computation exactly, repeated. Process-wide while any call is inside, counted
    under a lock: the first entry saves Keras's function, the last exit puts it back."""
    global _ragged_entries, _keras_distribute_data_input
    from keras.src.backend.jax import distribution_lib

    with _ragged_lock:
        if _ragged_entries == 0:
            _keras_distribute_data_input = distribution_lib.distribute_data_input
            distribution_lib.distribute_data_input = _whole_where_indivisible(
                _keras_distribute_data_input)
        _ragged_entries += 1
    try:
        yield
    finally:
        with _ragged_lock:
            _ragged_entries -= 1
            if _ragged_entries == 0:
                distribution_lib.distribute_data_input = _keras_distribute_data_input


def join_processes(coordinator: str, count: int, index: int, local_devices: int | None,
                   timeout: float) -> Connection:
    """This process as process `index` of `count` in one multi-controller JAX run (one
    process a host, all running the same program), and Keras's `DataParallel` over every
    process's devices, each process feeding its own rows of a batch (`auto_shard_dataset`
    off; `jax_data` picks the rows). `local_devices`: a rehearsal on one machine, that many
    CPU devices a process and gloo collectives.

    Raises:
        ConnectError: the coordinator or another process did not answer within `timeout`.
    """
    process.set_environment("KERAS_BACKEND", "jax", "every host's process runs Keras on JAX "
                            "(multi-controller JAX)")
    if local_devices is not None:
        process.set_environment("JAX_PLATFORMS", "cpu", "a rehearsal of several hosts runs on "
                                "the CPU")
        process.set_environment(
            "XLA_FLAGS", host_device_flags(os.environ.get("XLA_FLAGS", ""), local_devices),
            "JAX splits the CPU into devices once, when its runtime starts")
    jax = require_jax()
    if local_devices is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, count, index,
                                   initialization_timeout=max(int(timeout), 1))
    except Exception as exc:  # noqa: BLE001 - JAX raises XlaRuntimeError/RuntimeError here
        raise ConnectError(f"process {index} of {count} could not join the JAX run at "
                           f"{coordinator} within {timeout:g} s: {str(exc).splitlines()[0]}"
                           ) from None
    import keras

    devices = jax.devices()
    connection = Connection(
        target=f"hosts:{count}x{jax.local_device_count()}", kind=devices[0].platform,
        replicas=len(devices),
        strategy=keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False),
        backend=BACKEND, simulated=local_devices is not None,
        devices=tuple(str(d) for d in devices))
    process.set_connection(connection)
    return connection


@contextlib.contextmanager
def _native_stderr_kept() -> Iterator[Callable[[], str]]:
    """Catches what native code writes to the process's stderr (libtpu's "could not determine
    TPU accelerator type", its source-location traces) in a file instead of the cell; yields
    a function giving the last line it wrote, for an error message."""
    caught = tempfile.TemporaryFile(mode="w+")
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 here: nothing to keep out
        yield lambda: ""
        return
    sys.stderr.flush()
    os.dup2(caught.fileno(), 2)

    def last_line() -> str:
        caught.seek(0)
        lines = [line.strip() for line in caught.read().splitlines() if line.strip()]
        return lines[-1] if lines else ""

    try:
        yield last_line
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def host_device_flags(flags: str, n: int) -> str:
    """XLA_FLAGS with the host platform split into `n` devices (any earlier count replaced)."""
    kept = _DEVICE_COUNT.sub("", flags).split()
    return " ".join(kept + [f"--xla_force_host_platform_device_count={n}"])


def _cache_note(setting: str | None, env: Mapping[str, str]) -> str:
    try:
        return cache.enable(setting, env, installed_versions()).note()
    except OSError as exc:
        return f"JAX's compilation cache is off: its directory cannot be made ({exc})"


def memory_bytes(device: Any) -> tuple[int | None, int | None, int | None]:
    """(in use, limit, peak) bytes on one device, where the runtime reports them (TPUs, GPUs)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - CPU devices raise or return None
        return None, None, None
    stats = stats or {}
    return stats.get("bytes_in_use"), stats.get("bytes_limit"), stats.get("peak_bytes_in_use")


FLOP_SAMPLES = 8  # the batch the gradient is lowered for (FLOPs are per sample)


def _xla_training_flops(model: Any) -> float | None:
    """FLOPs of one sample's forward and backward pass, as XLA counts them."""
    jax = require_jax()
    import jax.numpy as jnp
    import keras

    shapes = [tuple(t.shape)[1:] for t in model.inputs]
    if any(d is None for shape in shapes for d in shape):
        return None
    inputs = [jax.ShapeDtypeStruct((FLOP_SAMPLES, *shape), t.dtype)
              for shape, t in zip(shapes, model.inputs)]
    trainable = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in model.trainable_variables]
    fixed = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in model.non_trainable_variables]

    def loss(trainable, fixed, *x):  # a loss whose gradient XLA cannot fold away
        out, _ = model.stateless_call(trainable, fixed, x[0] if len(x) == 1 else list(x),
                                      training=False)
        return sum(jnp.sum(jnp.square(o.astype("float32"))) for o in keras.tree.flatten(out))

    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        cost = jax.jit(jax.grad(loss)).lower(trainable, fixed, *inputs).cost_analysis()
    finally:
        keras.distribution.set_distribution(distribution)
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = (cost or {}).get("flops")
    return None if not flops else flops / FLOP_SAMPLES


def measure_matmul(device: Any, dtype: str, n: int, min_seconds: float = 0.3) -> float:
    """TFLOP/s of repeated n×n matmuls on one JAX device, after a compiled warm-up."""
    jax = require_jax()
    import jax.numpy as jnp

    a = jax.device_put(jnp.asarray(jax.random.uniform(jax.random.PRNGKey(0), (n, n)), dtype),
                       device)
    matmul = jax.jit(lambda u, v: u @ v)
    matmul(a, a).block_until_ready()  # warm-up: compiling
    rate = runs_per_second(lambda: matmul(a, a), lambda c: c.block_until_ready(), min_seconds)
    return 2.0 * n ** 3 * rate / 1e12


def _rehearsal_from_here(jax: Any, cores: int = 8) -> str:
    """How to rehearse after JAX looked for a TPU in this process: JAX has started, and it
    splits the CPU into devices once, so `--simulate` works next only where the split is
    already `cores` (else after a restart)."""
    line = f"`%tpu_connect --backend jax --simulate {cores}`"
    try:
        started = len(jax.devices("cpu"))
    except RuntimeError:
        started = 0
    if started == cores:
        return line
    return (f"restart the runtime (JAX started here with {started} CPU "
            f"device{'s' * (started != 1)}, and it splits the CPU only once), then {line} "
            "before anything uses JAX")


class JaxBackend(Named):
    """The `Backend` for Keras on JAX."""

    name = "jax"
    label = "JAX"
    static_batch_is_global = True  # DataParallel traces the global batch
    step_sees_global_batch = True
    evaluates_rest = False  # see evaluate_rest

    def refuses(self, chosen: Target, simulate: int | None) -> str | None:
        if chosen.kind == "tpu" and chosen.address != "local":
            return (f"JAX reaches TPUs on TPU VMs (`%tpu_connect local --backend jax`), not a "
                    f"TPU node at {chosen.address}: use `--backend tf` for that.")
        return None

    def connect(self, chosen: Target, simulate: int | None, *, explicit_gpu: bool,
                compile_cache: str | None, env: Mapping[str, str],
                probe_node: Callable[[Target], Any] = lambda chosen: None
                ) -> tuple[Connection, Target]:
        """Connects through JAX and makes Keras's `DataParallel` over the devices.

        `compile_cache` (a directory, "off", or None to choose) sets JAX's persistent
        compilation cache (see `compile_cache`); where it went is one of the notes.

        Raises:
            ConnectError: no such device here, or JAX already started with another CPU split.
            MissingDependencyError: JAX is not installed.
        """
        if simulate is not None:
            process.set_environment(
                "XLA_FLAGS", host_device_flags(os.environ.get("XLA_FLAGS", ""), simulate),
                "JAX splits the CPU into devices once, when its runtime starts")
            if "jax" not in sys.modules:  # a rehearsal never starts libtpu (and its stderr)
                process.set_environment("JAX_PLATFORMS", "cpu", "JAX picks its platforms once, "
                                        "when it starts: --simulate rehearses on the CPU")
        jax = require_jax()
        import keras

        if simulate is not None:
            devices = jax.devices("cpu")
            if len(devices) != simulate:
                raise ConnectError(
                    f"--simulate {simulate} needs {simulate} CPU devices, but JAX already started "
                    f"with {len(devices)}. Restart the runtime and run `%tpu_connect --backend jax "
                    f"--simulate {simulate}` before anything uses JAX.")
            kind, target = "cpu", f"simulate:{simulate}"
        else:
            kind = chosen.kind
            try:
                with _native_stderr_kept() as said:  # libtpu's own lines stay out of the cell
                    devices = jax.devices(kind)
            except RuntimeError as exc:
                if kind == "gpu" and not explicit_gpu:  # auto saw GPU device files JAX cannot use
                    chosen = Target("cpu", None, f"{chosen.reason}, but JAX has no GPU backend "
                                                 "(`pip install \"jax[cuda12]\"`)", chosen.notes)
                    kind, devices = "cpu", jax.devices("cpu")
                else:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else said()
                    raise ConnectError(f"JAX finds no {kind.upper()} here ({first}). "
                                       + (no_tpu_fix(env, _rehearsal_from_here(jax))
                                          if kind == "tpu" else JAX_FIX)) from None
            if kind == "cpu":
                devices = devices[:1]
            target = chosen.label
        # In force only inside %%tpu_train cells (its `scope()`), like a tf.distribute strategy:
        # a global distribution would also split every batch of the user's other models.
        distribution = keras.distribution.DataParallel(devices=list(devices))
        chosen = Target(chosen.kind, chosen.address, chosen.reason,
                        chosen.notes + (_cache_note(compile_cache, env),))
        return Connection(target=target, kind=kind, replicas=len(devices), strategy=distribution,
                          simulated=simulate is not None, devices=tuple(str(d) for d in devices),
                          backend=self), chosen

    def device_view(self, connection: Connection, env: Mapping[str, str]) -> DeviceView:
        jax = require_jax()
        device = jax.devices(connection.kind)[0]
        name = device_name(connection.kind, getattr(device, "device_kind", ""),
                           connection.simulated, env)
        chip = chip_named(connection.kind, name, env)
        if connection.kind == "cpu":
            memory = host_memory()
        else:
            memory = memory_of(*memory_bytes(device), chip, name)
        return DeviceView(name, chip, memory, lambda dtype, n: measure_matmul(device, dtype, n))

    # -- inputs ----------------------------------------------------------------------------

    def inputs(self) -> Any:
        from tpu_magic.backends.jax import data as jax_data

        return jax_data

    def runs_short_batches(self) -> bool:
        # across processes a short batch goes whole to every one (`jax_data.WholeRows`)
        return True

    def repeats_input(self, steps_per_execution: int, steps_given: bool) -> bool:
        return False  # a PyDataset is asked for each epoch

    def user_batches(self, data: Any, strategy: Any, note: Callable[[str], None],
                     masked: bool = True, *, batch: int | None = None, shuffle: bool = False,
                     class_weight: Any = None, steps: int | None = None,
                     keep: int = 1) -> tuple[Any, bool]:
        """Any batched input (tf.data, grain, KerasHub's own pipelines, a `PyDataset`, a
        generator) read by Keras's own adapter, one batch for one (`keras_inputs.whole_batches`):
        short batches padded and masked where the model's loss takes the mask, else run as
        they are, whole on every device where the mesh's data rows do not divide them. On
        several hosts each host feeds its own rows of every batch (`jax_data.process_share`;
        a tf.data dataset's full batches are cut inside its pipeline)."""
        from tpu_magic.backends.jax.data import process_share, row_split
        from tpu_magic.backends.keras_inputs import whole_batches

        split = row_split(strategy)
        return whole_batches(data, split.rows, masked, shuffle=shuffle,
                             class_weight=class_weight, steps=steps, keep=keep,
                             share=process_share(split),
                             split=split if require_jax().process_count() > 1 else None), True

    def dataset_batch_size(self, data: Any) -> int | None:
        return None

    def steps_per_execution_note(self, connection: Connection, steps: int) -> str | None:
        return None

    def jit_compile_note(self, connection: Connection, model: Any) -> str | None:
        return None  # JAX compiles every step with XLA anyway

    def replica_steps(self, model: Any, connection: Connection) -> Any:
        # Keras on JAX computes a step over the global batch (sharded arrays): its losses
        # and gradients are one device's already. Across processes (several hosts), each
        # holds only its rows of a prediction, which Keras cannot read back: there the
        # outputs are gathered onto every device inside the step.
        if require_jax().process_count() == 1:
            return _ragged_batches_whole()
        return _both(_ragged_batches_whole(), _outputs_gathered(model, connection.strategy))

    def replica_sum(self, value: Any) -> Any:
        return value  # a step computes over the global batch

    def leads(self) -> bool:
        return require_jax().process_index() == 0  # one process a host: process 0 writes

    def shard_writer(self, model: Any) -> Any:
        from tpu_magic.backends.jax.checkpoint import ShardWriter, wanted

        if model is None:  # to read a checkpoint written shard by shard
            return ShardWriter()
        optimizer = getattr(model, "optimizer", None)
        state = list(model.weights) + (list(optimizer.variables) if optimizer is not None
                                       and optimizer.built else [])
        return ShardWriter() if wanted(state) else None

    def model_parallel(self, connection: Connection, rows: int, columns: int) -> Connection:
        import keras

        devices = list(connection.strategy.device_mesh.devices.flatten())
        mesh = keras.distribution.DeviceMesh((rows, columns), ["batch", "model"], devices)
        distribution = _model_parallel_class()(
            layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch",
            auto_shard_dataset=False)  # each host feeds its own rows (`jax_data.row_split`)
        return dataclasses.replace(connection, strategy=distribution, replicas=rows)

    def reshard(self, model: Any, connection: Connection) -> None:
        """Lays out a model that exists already (its optimizer's and metrics' variables too)
        for the connection's mesh, one variable at a time: no second whole copy is made."""
        distribution, owners = connection.strategy, _layout_owners(model)
        for variable in _state_variables(model):
            variable._layout = distribution.layout_for(variable, owners)
            variable._direct_assign(variable.value)
        model.train_function = model.test_function = model.predict_function = None

    def step_memory(self, model: Any, batch: Any, connection: Connection | None = None
                    ) -> StepMemory:
        """Lowers Keras's own train step for the distribution in force (or `connection`'s,
        with the variables laid out as it would: nothing moves) and compiles it from
        abstract inputs (no step runs, nothing is allocated), donating the state as Keras
        does, and reads XLA's memory analysis of one device."""
        model._symbolic_build(data_batch=batch)  # what fit does first: loss, metrics, optimizer
        if connection is None:
            return self._step_memory(model, batch, None)
        with connection.strategy.scope():
            return self._step_memory(model, batch, connection.strategy)

    def _step_memory(self, model: Any, batch: Any, planned: Any) -> StepMemory:
        import keras

        jax = require_jax()
        distribution = keras.distribution.distribution()

        def abstract(array: Any) -> Any:
            if array is None:
                return None
            shape = tuple(array.shape)
            sharding = (distribution.get_data_layout(shape).backend_layout
                        if distribution is not None and shape else None)
            return jax.ShapeDtypeStruct(shape, array.dtype, sharding=sharding)

        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                     optimizer_variables=True, metrics_variables=True)
        if planned is not None:  # the state as `planned` would lay it out
            owners = _layout_owners(model)
            state = tuple(
                [jax.ShapeDtypeStruct(v.shape, v.value.dtype,
                                      sharding=planned.layout_for(v, owners).backend_layout)
                 for v in group] for group in _state_groups(model))
        data = keras.tree.map_structure(abstract, batch)
        compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, data).compile()
        stats = compiled.memory_analysis()

        def on_one(arrays: Any) -> int:
            return sum(_bytes_on_one_device(a) if planned is None else
                       math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                       for a in jax.tree_util.tree_leaves(arrays))

        weights, optimizer = on_one(state[:2]), on_one(state[2])
        return StepMemory(
            weights=weights, optimizer=optimizer,
            batch=max(stats.argument_size_in_bytes - weights - optimizer - on_one(state[3]), 0),
            temporaries=stats.temp_size_in_bytes,
            outputs=max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0),
            compiled_on=jax.devices()[0].platform)

    # -- the first-step parity check ----------------------------------------------------

    def step_state(self, model: Any) -> StepState:
        frozen = frozen_variables(model)
        live = _live_state(model)
        return StepState(*(tuple(None if id(v) in frozen else host_copy(a)
                                 for v, a in zip(variables, arrays))
                           for variables, arrays in zip(_state_groups(model), live)))

    def one_device_steps(self, model: Any, before: StepState, batches: list,
                         one_device_copy: Callable[[], Any]) -> tuple[dict, StepState]:
        """Keras's own `train_step` of the model, compiled for one device (the first local
        one) with no distribution in force, from `before` (a frozen layer's weights read from
        the model: the replicated copy already on that device, nothing moved)."""
        import keras

        jax = require_jax()
        device = jax.local_devices()[0]
        live = _live_state(model)
        state = tuple([jax.device_put(h, device) if h is not None else _on_device(a, device)
                       for h, a in zip(host, arrays)]
                      for host, arrays in zip(before.groups, live))
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            step = jax.jit(model.train_step)
            logs: Any = {}
            for batch in batches:
                logs, state = step(state, jax.device_put(batch, device))
        finally:
            keras.distribution.set_distribution(distribution)
        after = StepState(*(tuple(None if h is None else host_copy(a)
                                  for h, a in zip(host, arrays))
                            for host, arrays in zip(before.groups, state)))
        return {key: float(np.asarray(value)) for key, value in logs.items()}, after

    def step_logs(self, model: Any, logs: dict) -> dict:
        return dict(logs or {})  # a step sees the global batch: its logs are the batch's

    def distributed_inference(self, model: Any, batch: Any) -> None:
        return None  # a step sees the global batch and draws as one device: it is compared

    def evaluate_rest(self, model: Any, rest: tuple,
                      one_device_copy: Callable[[], Any]) -> None:
        return None  # only a model whose Input fixes the batch drops samples here: so does its copy

    def one_device_inference(self, model: Any, batch: Any,
                             one_device_copy: Callable[[], Any]) -> dict:
        import keras

        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            copy = one_device_copy()
            copy.set_weights([np.asarray(w) for w in model.get_weights()])
            x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
            logs = copy.test_on_batch(x, y, weight, return_dict=True)
        finally:
            keras.distribution.set_distribution(distribution)
        return {key: float(np.asarray(value)) for key, value in logs.items()}

    def shard_rows(self, model: Any) -> list[VariableShard]:
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
                                      int(value.nbytes), getattr(variable, LAYOUT_SOURCE, "")))
        return rows

    def compile_counts(self) -> cache.CompileCounts | None:
        return cache.counts()

    def training_flops(self, model: Any) -> tuple[float, str] | None:
        """XLA's cost analysis of the gradient of the model's forward pass (lowered, not
        compiled: no device time), per sample; the layer count where it cannot lower."""
        try:
            flops = _xla_training_flops(model)
        except Exception:  # noqa: BLE001 - a model JAX cannot lower abstractly: count instead
            flops = None
        counted = counted_training_flops(model)
        # XLA's analysis counts a loop's body once, not once a step: a recurrent layer's
        # scan over 250 words comes out 250 times too small. There the layers' count holds.
        if flops and not (counted and flops < 0.5 * counted):
            return flops, "XLA cost analysis"
        return None if counted is None else (counted, "counted from the layers")

    # -- variables -------------------------------------------------------------------------

    def built_outside(self, model: Any, strategy: Any) -> bool:
        """Variables made in a distribution's scope span its devices; others sit elsewhere."""
        return bool(self.outside_variables(model, strategy))

    def outside_variables(self, model: Any, strategy: Any) -> list:
        devices = _mesh_devices(strategy)
        found = []
        for variable in variables_of(model):
            sharding = getattr(getattr(variable, "value", variable), "sharding", None)
            if sharding is not None and set(sharding.device_set) != devices:
                found.append(variable)
        return found

    def users_distribution(self, connection: Connection) -> tuple[Connection, str] | None:
        import keras

        distribution = keras.distribution.distribution()
        if distribution is None or distribution is connection.strategy:
            return None
        mesh = distribution.device_mesh
        shape = "x".join(str(d) for d in mesh.shape)
        described = (f"{type(distribution).__name__} over a {shape} mesh "
                     f"({', '.join(mesh.axis_names)})")
        from tpu_magic.backends.jax.data import data_rows

        return dataclasses.replace(connection, strategy=distribution,
                                   replicas=data_rows(distribution)), described

    def keep_in_force(self, distribution: Any) -> None:
        import keras

        keras.distribution.set_distribution(distribution)

    def place(self, model: Any, connection: Connection) -> list | None:
        """A variable whose value lives off the distribution's devices (made outside every
        cell, on one device, or for another mesh) is laid out as the distribution lays it
        out and its value moved there: the same variable, the same model."""
        distribution = connection.strategy
        devices = _mesh_devices(distribution)
        owners = _layout_owners(model)
        moved = []
        for variable in _state_variables(model):
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

    def built_for(self, model: Any, strategy: Any) -> bool:
        return bool(model.weights) and not self.built_outside(model, strategy)

    def reading(self, model: Any) -> Any:
        return contextlib.nullcontext()  # a replicated jax.Array reads as one value

    def replica_values(self, variable: Any) -> list[Any]:
        return [getattr(variable, "value", variable)]

    @contextlib.contextmanager
    def on_the_cpu(self) -> Iterator[None]:
        import keras

        jax = require_jax()
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            with jax.default_device(jax.devices("cpu")[0]):
                yield
        finally:
            keras.distribution.set_distribution(distribution)


def _live_state(model: Any) -> tuple:
    """The model's state as JAX arrays now: what `fit` holds between steps (its variables
    are emptied while it trains), else the variables' values."""
    held = getattr(model, "_jax_state", None)
    if held and not getattr(model, "_jax_state_synced", True):
        return (held["trainable_variables"], held["non_trainable_variables"],
                held["optimizer_variables"], held["metrics_variables"])
    return tuple([v.value for v in group] for group in _state_groups(model))


def _on_device(array: Any, device: Any) -> Any:
    """`array` on one device: a replicated array's own copy there (no transfer), else moved."""
    jax = require_jax()
    sharding = getattr(array, "sharding", None)
    if sharding is not None and sharding.is_fully_replicated:
        for shard in array.addressable_shards:
            if shard.device == device:
                return shard.data
    return jax.device_put(array, device)


def _mesh_devices(distribution: Any) -> set:
    """The JAX devices of a distribution's mesh (Keras's mesh may hold them as names)."""
    return set(distribution.device_mesh.backend_mesh.devices.flatten())


def _state_variables(model: Any) -> list:
    return [v for group in _state_groups(model) for v in group]


def _layout_owners(model: Any) -> list:
    """The model and its parts whose class offers `get_layout_map` (a KerasHub backbone)."""
    return [layer for layer in [model, *model._flatten_layers(include_self=False)]
            if callable(getattr(type(layer), "get_layout_map", None))]


BACKEND = JaxBackend()
