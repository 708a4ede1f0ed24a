"""Keras on TensorFlow: the `Backend` object. Each method hands its job to the module that
does it: `connect` (strategies, TPU init, `--simulate`), `devices` (the device view), `data`
(NumPy and user inputs as tf.data), `replica_steps` (the replicas' loss semantics),
`call_start` (a call's start without Keras's build batch), `variables` (mirrored variables
and their strategy), `executions` (steps an execution), `parity` (the first-step check),
`whole_batch` (every replica the whole batch, for losses the replicas cannot split).
TensorFlow is imported by the methods, never here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

from tpu_magic.backends.protocol import Named
from tpu_magic.backends.tf import (call_start, connect, devices, executions, parity,
                                   replica_steps, variables, whole_batch)
from tpu_magic.core.devices import DeviceView
from tpu_magic.core.errors import ShardError
from tpu_magic.core.flops import counted_training_flops
from tpu_magic.core.session import Connection
from tpu_magic.core.steps import StepState, Update
from tpu_magic.core.target import Target


class TensorFlowBackend(Named):
    """The `Backend` for Keras on TensorFlow."""

    name = "tf"
    label = "TensorFlow"
    static_batch_is_global = False  # Keras gives each replica the Input's fixed batch
    step_sees_global_batch = False
    evaluates_rest = True  # see evaluate_rest
    # Keras's own steps_per_execution: a user's K set on the model (`models.setup`), an auto
    # K for each call (`executions.keras_steps`)
    groups_steps = False
    times_steps_as_they_run = False  # a step is measured before the call (`executions`)
    check_compiles_ahead = False  # a copy of the model is built and traced where it runs
    plans_memory = False  # Keras on TensorFlow: no memory plan
    flops_from_batch = False  # counted from the layers

    # -- connecting ------------------------------------------------------------------------

    def refuses(self, chosen: Target, simulate: int | None) -> str | None:
        return None  # TensorFlow reaches TPU nodes, TPU VMs (with tensorflow-tpu), GPUs, CPUs

    def connect(self, chosen: Target, simulate: int | None, *, explicit_gpu: bool,
                compile_cache: str | None, env: Mapping[str, str],
                probe_node: Callable[[Target], Any] = lambda chosen: None
                ) -> tuple[Connection, Target]:
        return connect.connect(self, chosen, simulate, explicit_gpu, env, probe_node)

    def device_view(self, connection: Connection, env: Mapping[str, str]) -> DeviceView:
        return devices.device_view(connection, env)

    # -- inputs ----------------------------------------------------------------------------

    def inputs(self) -> Any:
        from tpu_magic.backends.tf import data

        return data

    def runs_short_batches(self) -> bool:
        return False  # MirroredStrategy splits a short batch unevenly, or leaves replicas empty

    def repeats_input(self, steps_per_execution: int, steps_given: bool) -> bool:
        # tf.data repeats (no stall at each epoch start), except where Keras would run whole
        # executions of K steps on an endless dataset and so overshoot the epoch.
        return steps_per_execution == 1 or steps_given

    def user_batches(self, data: Any, strategy: Any, note: Callable[[str], None],
                     masked: bool = True, *, batch: int | None = None, shuffle: bool = False,
                     class_weight: Any = None, steps: int | None = None,
                     keep: int = 1) -> tuple[Any, bool]:
        from tpu_magic.backends.tf.datasets import user_batches

        return user_batches(data, strategy, note, masked, batch=batch, shuffle=shuffle,
                            class_weight=class_weight, steps=steps, keep=keep)

    def dataset_batch_size(self, data: Any) -> int | None:
        from tpu_magic.backends.tf.datasets import dataset_batch_size

        return dataset_batch_size(data)

    def steps_per_execution_note(self, connection: Connection, steps: int) -> str | None:
        if steps > 1 and replica_steps.mirrored_replicas(connection):
            return (f"more than one step an execution fails in Keras 3 under MirroredStrategy "
                    f"with {connection.replicas} replicas (keras-team/keras#19246): one step "
                    "an execution here; on a TPU or one device more apply")
        return None

    def auto_steps_note(self) -> str | None:
        return None  # one process (tpu_magic's several hosts run JAX)

    def step_times(self, model: Any, kind: str, batch: Any) -> tuple[float, float] | None:
        return executions.measured(model, kind, batch)

    def group_seconds(self, model: Any, kind: str, batch: Any, steps: int) -> float | None:
        return None  # `step_times` timed Keras's own loop of several steps already

    def grouped_steps(self, model: Any, steps: Any, sources: Mapping[str, Any] | None = None,
                      form: Any = None) -> Any:
        return executions.keras_steps(model, steps)  # Keras's own loop, at `steps.k`

    def jit_compile_note(self, connection: Connection, model: Any) -> str | None:
        if getattr(model, "jit_compile", False) is True and \
                replica_steps.mirrored_replicas(connection):
            return (f"jit_compile=True fails in TensorFlow under MirroredStrategy with "
                    f"{connection.replicas} replicas (XLA cannot place the replicas' variables "
                    "on one device): model runs without it here; on a TPU, XLA compiles every "
                    "step anyway.")
        return None

    def compile_declined(self, model: Any, label: str) -> str | None:
        return None  # the layers Keras runs op by op cannot compile on TensorFlow

    def leads(self) -> bool:
        return True  # one process

    def shard_writer(self, model: Any) -> Any:
        return None  # one process, its variables whole in it: one HDF5 file

    def replica_sum(self, value: Any) -> Any:
        return replica_steps.replica_sum(value)

    @contextlib.contextmanager
    def replica_steps(self, model: Any, connection: Connection) -> Iterator[None]:
        with call_start.without_build_batch(model), \
                replica_steps.replica_steps(model, connection):
            yield

    def model_parallel(self, connection: Connection, rows: int, columns: int,
                       owners: Any = None) -> Connection:
        raise ShardError(
            "--shard model needs Keras on JAX: Keras's model parallelism "
            "(keras.distribution.ModelParallel) exists only there. Restart the runtime and run "
            "`%tpu_connect --backend jax` (add `--simulate 8` to rehearse on the CPU) before "
            "anything imports keras.")

    # -- the first-step parity check ----------------------------------------------------

    def step_state(self, model: Any) -> StepState:
        return parity.step_state(model)

    def one_device_steps(self, model: Any, before: StepState, batches: list,
                         one_device_copy: Callable[[], Any], parts: int = 1
                         ) -> tuple[dict, Update]:
        # the whole batch on one device: TensorFlow's memory is not planned
        logs, after = parity.one_device_steps(model, before, batches, one_device_copy)
        return logs, Update.between(before, after)

    def one_device_ahead(self, model: Any, batch: Any, parts: int = 1, steps: int = 1
                         ) -> None:
        return None  # a copy of the model is built and traced where it runs

    def one_device_update(self, model: Any, batch: Any, parts: int = 1) -> None:
        return None  # nothing compiled ahead: the copy runs from the copied state

    def step_logs(self, model: Any, logs: dict) -> dict:
        return parity.step_logs(model, logs)

    def whole_batch(self, model: Any, call: Mapping[str, Any]) -> Any:
        return whole_batch.for_fit(model, call)

    def distributed_inference(self, model: Any, batch: Any) -> dict | None:
        return parity.distributed_inference(model, batch)

    def one_device_inference(self, model: Any, batch: Any,
                             one_device_copy: Callable[[], Any]) -> dict:
        return parity.one_device_inference(model, batch, one_device_copy)

    def evaluate_rest(self, model: Any, rest: tuple,
                      one_device_copy: Callable[[], Any]) -> dict | None:
        return parity.evaluate_rest(model, rest, one_device_copy)

    def shard_rows(self, model: Any) -> list:
        return []

    def step_memory(self, model: Any, batch: Any, connection: Connection | None = None,
                    form: Any = None, bf16: bool = False) -> None:
        return None  # planned on JAX, where Keras's model parallelism is

    def call_memory(self, model: Any, kind: str, batch: Any) -> None:
        return None  # planned on JAX

    def step_form_not_exact(self, model: Any) -> str | None:
        return "Keras on TensorFlow plans no memory here"

    def normalizes_parts(self, model: Any) -> list[str]:
        return []

    def repeated_blocks(self, model: Any) -> list:
        return []  # no step forms on TensorFlow

    def reshard(self, model: Any, connection: Connection) -> None:
        self.model_parallel(connection, 1, 1)  # says that it needs JAX

    def compile_counts(self) -> None:
        return None  # TensorFlow keeps no persistent compilation cache for Keras's steps

    def release_compiled(self) -> None:
        pass  # Keras's traced functions are its models', collected with them

    def training_flops(self, model: Any, batch: Any = None) -> tuple[float, str] | None:
        flops = counted_training_flops(model)
        return None if flops is None else (flops, "counted from the layers")

    # -- variables -------------------------------------------------------------------------

    def built_outside(self, model: Any, strategy: Any) -> bool:
        return variables.built_outside(model, strategy)

    def outside_variables(self, model: Any, strategy: Any) -> list:
        return variables.outside_variables(model, strategy)

    def users_distribution(self, connection: Connection) -> tuple[Connection, str] | None:
        return None  # Keras's distribution API is JAX's; tf.distribute strategies are ours

    def keep_in_force(self, distribution: Any) -> None:
        return None

    def place(self, model: Any, connection: Connection) -> list | None:
        variables.place(model, connection)
        return None

    def built_for(self, model: Any, strategy: Any) -> bool:
        return variables.built_for(model, strategy)

    def reading(self, model: Any) -> Any:
        return variables.reading(model)

    def replica_values(self, variable: Any) -> list[Any]:
        return variables.replica_values(variable)

    def on_the_cpu(self) -> Any:
        return variables.on_the_cpu()


BACKEND = TensorFlowBackend()
