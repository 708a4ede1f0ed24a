"""What a backend is: the `Backend` protocol each of `tf.py` and `jax.py` satisfies, and
the `InputBuilder` protocol of their input modules (`tf_data.py`, `jax_data.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Protocol

if TYPE_CHECKING:
    from tpu_magic.backends.compile_cache import CompileCounts
    from tpu_magic.core.devices import DeviceView, StepMemory
    from tpu_magic.core.session import Connection
    from tpu_magic.core.target import Target


class InputBuilder(Protocol):
    """NumPy inputs → whole, padded batches (`tf_data` for TensorFlow, `jax_data` for JAX).

    Each returns an `arrays.Pipeline`: the dataset to give Keras, its steps, the samples,
    the padding and the samples left out (`drop`: whole batches of real samples only).
    """

    def train_pipeline(self, x: Any, y: Any, sample_weight: Any, batch: int, shuffle: bool,
                       repeat: bool = True, seed: int | None = None, first_epoch: int = 0,
                       strategy: Any = None, drop: bool = False) -> Any: ...

    def eval_pipeline(self, x: Any, y: Any, sample_weight: Any, batch: int, strategy: Any = None,
                      drop: bool = False) -> Any: ...

    def predict_pipeline(self, x: Any, batch: int, strategy: Any = None) -> Any: ...


class Backend(Protocol):
    """What tpu_magic asks of a Keras backend. One object per backend (see `get`)."""

    name: str  # "tf" or "jax", as typed after --backend
    label: str  # "TensorFlow" or "JAX", for people
    static_batch_is_global: bool  # a batch fixed in an Input is the global batch (JAX traces it)

    def connect(self, chosen: "Target", simulate: int | None, *, explicit_gpu: bool,
                compile_cache: str | None, env: Mapping[str, str],
                probe_node: Callable[["Target"], Any] = ...
                ) -> "tuple[Connection, Target]":
        """The connection to `chosen`; `probe_node` is the bounded reachability check a
        backend that reaches TPU nodes runs before connecting to one."""

    def refuses(self, chosen: "Target", simulate: int | None) -> str | None:
        """Why this backend cannot connect to `chosen`, told before any framework is imported
        (None: it may try)."""

    def device_view(self, connection: "Connection", env: Mapping[str, str]) -> "DeviceView":
        """The first device: its name, chip, memory, and a matmul measurement."""

    def inputs(self) -> InputBuilder:
        """The module that turns NumPy inputs into padded batches."""

    def repeats_input(self, steps_per_execution: int, steps_given: bool) -> bool:
        """Whether the training input is one endless dataset (else one pass per epoch)."""

    def whole_dataset(self, data: Any, batch: int | None, strategy: Any,
                      note: Callable[[str], None], masked: bool = True) -> Any:
        """A user's dataset as whole batches: with `masked`, a labelled dataset's partial
        batches padded with the padding masked out; otherwise each batch cut to equal
        shares per replica (or the dataset as it is, where the backend cannot)."""

    def dataset_batch_size(self, data: Any) -> int | None:
        """The batch of a user's batched dataset, None where it cannot be told."""

    def built_outside(self, model: Any, strategy: Any) -> bool:
        """Whether the model's variables belong to another strategy (or to none)."""

    def built_for(self, model: Any, strategy: Any) -> bool:
        """Whether the model has variables, all made for this strategy."""

    def reading(self, model: Any) -> ContextManager[Any]:
        """Where a distributed model's variables can be read (its strategy's scope)."""

    def replica_values(self, variable: Any) -> list[Any]:
        """A variable's value on each replica (one value where it is not mirrored)."""

    def on_the_cpu(self) -> ContextManager[Any]:
        """Outside every distribution, on the CPU: where CPU copies are built."""

    def steps_per_execution_note(self, connection: "Connection", steps: int) -> str | None:
        """Why `steps` per execution cannot run on this connection, or None where it can."""

    def jit_compile_note(self, connection: "Connection", model: Any) -> str | None:
        """Why the model's `jit_compile=True` cannot run on this connection (tpu_magic then
        turns it off for the model), or None where it can."""

    def replica_steps(self, model: Any, connection: "Connection") -> ContextManager[Any]:
        """While tpu_magic runs the model's steps on the replicas: each replica's losses are
        those of its own batch, as on one device, its optimizers average the replicas'
        gradients, and every optimizer it holds is built before the first step."""

    def leads(self) -> bool:
        """Whether this process writes the files a run keeps (checkpoints): process 0 of
        several hosts' processes, else the one process."""

    def replica_sum(self, value: Any) -> Any:
        """`value` summed over the replicas, inside a step (the value itself where a step
        sees the global batch)."""

    def model_parallel(self, connection: "Connection", rows: int, columns: int) -> "Connection":
        """The connection for a cell that lays the model out over a `rows` × `columns` mesh
        of the connection's devices (data × model), a variable's layout from the model's
        own layout map, else from its shape (`core.layouts.derived_spec`).

        Raises:
            ShardError: this backend has no model parallelism.
        """

    def step_memory(self, model: Any, batch: Any, connection: "Connection | None" = None
                    ) -> "StepMemory | None":
        """One device's memory for a training step of `model` on `batch` (arrays of the
        global batch's shapes), from the compiler, before any step runs (None: this backend
        cannot tell). With `connection`: on its mesh, as if the model were laid out there."""

    def reshard(self, model: Any, connection: "Connection") -> None:
        """Lays out an existing model's variables for `connection`'s mesh, one at a time."""

    def shard_rows(self, model: Any) -> list:
        """Each of the model's variables as a `core.layouts.VariableShard`: its layout on the
        mesh and its bytes on one device."""

    def compile_counts(self) -> "CompileCounts | None":
        """Programs compiled and loaded from the persistent cache so far (None: not known)."""

    def training_flops(self, model: Any) -> "tuple[float, str] | None":
        """FLOPs of one training sample and where the count comes from (None: not known)."""



class Named:
    """A backend object shows its name ("tf", "jax")."""

    name = ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
