"""Keras on JAX: the `Backend` object. Each method hands its job to the module that does it:
`connect` (devices, `--simulate`), `devices` (the device view), `data` (NumPy inputs),
`replica_steps`, `model_parallel` and `placement` (meshes and where variables live),
`declined` (steps Keras runs op by op for TensorFlow's sake, compiled),
`memory` (the memory plan), `parity` (the first-step check), `flops`, `checkpoint`,
`compile_cache`, `loop` and `handed_state` (a call's steps). Keras 3 reaches TPUs
through JAX with `keras.distribution.DataParallel`: the global batch is split over the
devices, the variables are replicated.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

from tpu_magic.backends.jax import compile_cache, connect, declined, devices, flops, \
    handed_state, memory, model_parallel, parity, placement, replica_steps, step_forms
from tpu_magic.backends.jax.loop import calls
from tpu_magic.backends.jax.loop.pace import Pace
from tpu_magic.core import record
from tpu_magic.backends.protocol import Named
from tpu_magic.core.deps import require_jax
from tpu_magic.core.devices import DeviceView, StepMemory
from tpu_magic.core.layouts import VariableShard
from tpu_magic.core.session import Connection
from tpu_magic.core.steps import StepForm, StepState, Update
from tpu_magic.core.target import Target


class JaxBackend(Named):
    """The `Backend` for Keras on JAX."""

    name = "jax"
    label = "JAX"
    static_batch_is_global = True  # DataParallel traces the global batch
    step_sees_global_batch = True
    evaluates_rest = False  # see evaluate_rest
    flops_from_batch = True  # XLA's cost analysis of the step lowered for the fed shapes
    groups_steps = True  # K steps a dispatch as one program on the devices (`loop`)
    times_steps_as_they_run = True  # K chosen from a call's first steps (`loop.pace`)
    check_compiles_ahead = True  # on a thread, from the first batch's shapes (`parity`)
    plans_memory = True  # every first fit planned from the compiler (`memory`)

    def refuses(self, chosen: Target, simulate: int | None) -> str | None:
        if chosen.kind == "tpu" and chosen.address != "local":
            return (f"JAX reaches TPUs on TPU VMs (`%tpu_connect local --backend jax`), not a "
                    f"TPU node at {chosen.address}: use `--backend tf` for that.")
        return None

    def connect(self, chosen: Target, simulate: int | None, *, explicit_gpu: bool,
                compile_cache: str | None, env: Mapping[str, str],
                probe_node: Callable[[Target], Any] = lambda chosen: None
                ) -> tuple[Connection, Target]:
        """Connects through JAX and makes Keras's `DataParallel` over the devices (see
        `connect.connect`)."""
        return connect.connect(self, chosen, simulate, explicit_gpu, compile_cache, env)

    def device_view(self, connection: Connection, env: Mapping[str, str]) -> DeviceView:
        return devices.device_view(connection, env)

    # -- inputs ----------------------------------------------------------------------------

    def inputs(self) -> Any:
        from tpu_magic.backends.jax import data

        return data

    def runs_short_batches(self) -> bool:
        # across processes a short batch goes whole to every one (`data.WholeRows`)
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
        several hosts each host feeds its own rows of every batch (`data.process_share`;
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

    def auto_steps_note(self) -> str | None:
        # each host would choose K from its own steps' times, and hosts running different
        # programs mismatch their collectives (gloo aborted a host: "Received data size
        # doesn't match expected size")
        if require_jax().process_count() > 1:
            return ("one step an execution: on several hosts each would choose its own from "
                    "its own steps' times, and every host must run the same programs")
        return None

    def jit_compile_note(self, connection: Connection, model: Any) -> str | None:
        return None  # XLA compiles any step Keras lets it compile

    def compile_declined(self, model: Any, label: str) -> str | None:
        return declined.compile_declined(model, label)

    def step_times(self, model: Any, kind: str, batch: Any) -> tuple | None:
        return None  # timed as they train (`times_steps_as_they_run`)

    def group_seconds(self, model: Any, kind: str, batch: Any, steps: int) -> float | None:
        return None

    def grouped_steps(self, model: Any, steps: Any, sources: Mapping[str, Any] | None = None,
                      form: StepForm | None = None) -> Any:
        return _call_steps(model, steps, dict(sources or {}), form)

    def replica_steps(self, model: Any, connection: Connection) -> Any:
        return replica_steps.replica_steps(model, connection)

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

    def model_parallel(self, connection: Connection, rows: int, columns: int,
                       owners: model_parallel.Owners | None = None) -> Connection:
        return model_parallel.model_parallel(connection, rows, columns, owners)

    def reshard(self, model: Any, connection: Connection) -> None:
        placement.reshard(model, connection)

    def step_memory(self, model: Any, batch: Any, connection: Connection | None = None,
                    form: StepForm | None = None, bf16: bool = False) -> StepMemory:
        return memory.step_memory(model, batch, connection, form, bf16)

    def call_memory(self, model: Any, kind: str, batch: Any) -> StepMemory:
        return memory.call_memory(model, kind, batch)

    def step_form_not_exact(self, model: Any) -> str | None:
        return step_forms.not_exact(model)

    def repeated_blocks(self, model: Any) -> list:
        return step_forms.repeated_blocks(model)

    def normalizes_parts(self, model: Any) -> list[str]:
        return step_forms.normalizes_parts(model)

    # -- the first-step parity check ----------------------------------------------------

    def step_state(self, model: Any) -> StepState:
        return parity.step_state(model)

    def one_device_steps(self, model: Any, before: StepState, batches: list,
                         one_device_copy: Callable[[], Any], parts: int = 1
                         ) -> tuple[dict, Update]:
        return parity.one_device_steps(model, before, batches, parts)

    def one_device_ahead(self, model: Any, batch: Any, parts: int = 1, steps: int = 1
                         ) -> Callable[[], bool]:
        return parity.one_device_ahead(model, batch, parts, steps)

    def one_device_update(self, model: Any, batch: Any, parts: int = 1
                          ) -> tuple[dict, Update] | None:
        return parity.one_device_update(model, batch, parts)

    def step_logs(self, model: Any, logs: dict) -> dict:
        return dict(logs or {})  # a step sees the global batch: its logs are the batch's

    def whole_batch(self, model: Any, call: Mapping[str, Any]) -> None:
        return None  # a step sees the global batch: nothing to give whole

    def distributed_inference(self, model: Any, batch: Any) -> None:
        return None  # a step sees the global batch and draws as one device: it is compared

    def evaluate_rest(self, model: Any, rest: tuple,
                      one_device_copy: Callable[[], Any]) -> None:
        return None  # only a model whose Input fixes the batch drops samples here: so does its copy

    def one_device_inference(self, model: Any, batch: Any,
                             one_device_copy: Callable[[], Any]) -> dict:
        return parity.one_device_inference(model, batch, one_device_copy)

    def shard_rows(self, model: Any) -> list[VariableShard]:
        return placement.shard_rows(model)

    def compile_counts(self) -> compile_cache.CompileCounts | None:
        return compile_cache.counts()

    def release_compiled(self) -> None:
        # JAX's caches keep an executable for every op run eagerly at each new shape, for
        # good, and XLA:CPU maps each one's code
        require_jax().clear_caches()

    def training_flops(self, model: Any, batch: Any = None) -> tuple[float, str] | None:
        return flops.training_flops(model, batch)

    # -- variables -------------------------------------------------------------------------

    def built_outside(self, model: Any, strategy: Any) -> bool:
        """Variables made in a distribution's scope span its devices; others sit elsewhere."""
        return bool(self.outside_variables(model, strategy))

    def outside_variables(self, model: Any, strategy: Any) -> list:
        return placement.outside_variables(model, strategy)

    def users_distribution(self, connection: Connection) -> tuple[Connection, str] | None:
        return placement.users_distribution(connection)

    def keep_in_force(self, distribution: Any) -> None:
        import keras

        keras.distribution.set_distribution(distribution)

    def place(self, model: Any, connection: Connection) -> list | None:
        return placement.place(model, connection)

    def built_for(self, model: Any, strategy: Any) -> bool:
        return bool(model.weights) and not self.built_outside(model, strategy)

    def reading(self, model: Any) -> Any:
        return contextlib.nullcontext()  # a replicated jax.Array reads as one value

    def replica_values(self, variable: Any) -> list[Any]:
        return [getattr(variable, "value", variable)]

    def on_the_cpu(self) -> Any:
        return placement.on_the_cpu()


BACKEND = JaxBackend()


@contextlib.contextmanager
def _call_steps(model: Any, steps: Any, sources: dict[str, Any],
                form: StepForm | None = None) -> Iterator[Pace]:
    """A call's steps: K a dispatch (`loop.calls.grouped`), fixed (`steps`, a
    `training.fit.steps.Steps`) or chosen from its first steps (`steps.AsTheyRun`), and the
    state Keras's loop hands back after each execution kept untracked (`handed_state`).
    Yields the call's `Pace` (`result()`: the steps it ran, and why)."""
    pace = Pace(choose=steps.choose, confirm=steps.confirm, unmeasured=steps.unmeasured,
                kind=steps.kind, memory=record.of(model).measured, total=steps.call_steps) \
        if hasattr(steps, "choose") else Pace(fixed=steps)
    with handed_state.untracked(model), calls.grouped(model, pace, sources, form):
        yield pace
