"""What a backend is: the `Backend` protocol each of `tf/backend.py` and `jax/backend.py`
satisfies, and the `InputBuilder` protocol of their input modules (`tf/data.py`,
`jax/data.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping, Protocol

if TYPE_CHECKING:
    from tpu_magic.backends.jax.compile_cache import CompileCounts
    from tpu_magic.core.devices import DeviceView, StepMemory
    from tpu_magic.core.session import Connection
    from tpu_magic.core.steps import StepState, Update
    from tpu_magic.core.target import Target


class InputBuilder(Protocol):
    """NumPy inputs → whole, padded batches (`tf/data.py` for TensorFlow, `jax/data.py` for JAX).

    Each returns an `arrays.Pipeline`: the dataset to give Keras, its steps, the samples,
    the padding and the samples left out. `remainder` says what becomes of the samples
    that do not fill the last batch (`planning.remainder_for`): "pad" (padding masked out
    of losses and metrics), "short" (a short last batch as it is: backends that
    `runs_short_batches`) or "drop" (left out: the model's loss cannot take a mask and the
    backend needs whole batches).
    """

    def train_pipeline(self, x: Any, y: Any, sample_weight: Any, batch: int,
                       shuffle: bool | str, repeat: bool = True, seed: int | None = None,
                       first_epoch: int = 0, strategy: Any = None, remainder: str = "pad",
                       build_pass: bool = False) -> Any: ...

    def eval_pipeline(self, x: Any, y: Any, sample_weight: Any, batch: int, strategy: Any = None,
                      remainder: str = "pad") -> Any: ...

    def predict_pipeline(self, x: Any, batch: int, strategy: Any = None,
                         remainder: str = "pad") -> Any: ...


class Backend(Protocol):
    """What tpu_magic asks of a Keras backend. One object per backend (see `get`)."""

    name: str  # "tf" or "jax", as typed after --backend
    label: str  # "TensorFlow" or "JAX", for people
    static_batch_is_global: bool  # a batch fixed in an Input is the global batch (JAX traces it)
    # a step computes over the whole global batch (JAX); else each replica over its own share
    step_sees_global_batch: bool
    evaluates_rest: bool  # evaluate's left-out samples run on one device (`evaluate_rest`)
    # K steps an execution run as one program on the devices, set for each call
    # (`grouped_steps`); else Keras's own `steps_per_execution`, set on the model
    groups_steps: bool
    # K is chosen from a call's first steps as they train (`grouped_steps` takes a
    # `steps.AsTheyRun`); else from a step measured before the call (`step_times`)
    times_steps_as_they_run: bool
    # every fit's step is planned from the compiler before it runs (`step_memory`)
    plans_memory: bool
    # a step's FLOPs are counted from a batch the model is fed (`training_flops`'s `batch`:
    # XLA's count of the lowered step); else from the layers alone, and no batch is read
    flops_from_batch: bool
    # the first-step check's one-device step is compiled beside (`one_device_ahead`, given
    # the first batch's shapes: before the memory plan's compile, else the first step);
    # else where it runs
    check_compiles_ahead: bool

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

    def runs_short_batches(self) -> bool:
        """Whether a batch the replicas do not divide runs as it is, whole on every device,
        with one device's numbers (JAX, one process: then nothing is padded, and every model
        runs plain Keras's code); else the last batch is padded and masked, or left out where
        the model's loss cannot take the mask (TensorFlow's replicas need equal shares)."""

    def repeats_input(self, steps_per_execution: int, steps_given: bool) -> bool:
        """Whether the training input is one endless dataset (else one pass per epoch)."""

    def user_batches(self, data: Any, strategy: Any, note: Callable[[str], None],
                     masked: bool = True, *, batch: int | None = None, shuffle: bool = False,
                     class_weight: Any = None, steps: int | None = None,
                     keep: int = 1) -> tuple[Any, bool]:
        """A user's batched input (a dataset, a `PyDataset`, a generator) as whole batches,
        read as plain Keras reads it (each batch once a pass, in its order): with `masked`,
        a labelled input's short batches padded with the padding masked out; otherwise as
        the backend can run them exactly (or the input as it is, where it cannot wrap it).
        `batch`: the dataset's batch where known; `shuffle`, `class_weight`, `steps`: the
        call's, for the backends that read the input with Keras's own adapter; `keep`: how
        many first batches of a pass to keep for the parity check (where it can).

        Returns:
            (the input to give Keras, whether `class_weight` is applied in it).
        """

    def dataset_batch_size(self, data: Any) -> int | None:
        """The batch of a user's batched dataset, None where it cannot be told."""

    def built_outside(self, model: Any, strategy: Any) -> bool:
        """Whether the model's variables belong to another strategy (or to none)."""

    def users_distribution(self, connection: "Connection") -> "tuple[Connection, str] | None":
        """The distribution the user's own code put in force (Keras's
        `keras.distribution.set_distribution`, a distribution's `scope()`), where it is not
        the connection's: the connection to train with instead, and its description. None:
        there is none (or the backend has no such API)."""

    def keep_in_force(self, distribution: Any) -> None:
        """Puts the user's `distribution` back in force after a cell's own scope ended, as
        plain Keras leaves a `set_distribution` in force."""

    def outside_variables(self, model: Any, strategy: Any) -> list:
        """The model's variables (its weights, its optimizer's) not made for `strategy`."""

    def place(self, model: Any, connection: "Connection") -> list | None:
        """Moves the model's variables made elsewhere (its weights, its optimizer's and
        metrics' state, a layer adapted in an earlier cell) onto the connection's devices,
        each laid out as the distribution lays it out. Returns the variables moved (empty:
        none), or None where a variable cannot move (TensorFlow's belong to the strategy
        they were made in: the model is rebuilt instead)."""

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

    def auto_steps_note(self) -> str | None:
        """Why K cannot be chosen by this process alone (several processes, each timing its
        own steps, must run the same programs), or None where it can."""

    def step_times(self, model: Any, kind: str, batch: Any) -> "tuple | None":
        """One `kind` ("train", "test", "predict") step of the model on `batch` (one batch,
        NumPy), measured without changing the model: its device seconds, the host's
        seconds to place the batch and dispatch the step, and the longest group of such
        steps that runs as fast a step, with why (or None) (None: this backend does not
        measure; `training.fit.steps` then keeps one step an execution)."""

    def group_seconds(self, model: Any, kind: str, batch: Any, steps: int) -> float | None:
        """Seconds a `kind` step takes when `steps` of them run as one dispatch on `batch`
        repeated (the call and the steps timed together), without changing the model; None:
        not measured (the choice then trusts `step_times`)."""

    def grouped_steps(self, model: Any, steps: Any, sources: "Mapping[str, Any] | None" = None,
                      form: Any = None) -> ContextManager[Any]:
        """While a call of the model runs: its steps an execution, one dispatch each, every
        step reading the batch it reads one step an execution. `steps`: a
        `training.fit.steps.Steps` (K), or, where `times_steps_as_they_run`, a
        `steps.AsTheyRun` (K chosen from the call's first steps); `sources`: tpu_magic's own
        pipelines by role ("train", "test", "predict"), which the backend may read a group
        at a time; `form`: the train step's form the memory plan chose
        (`core.steps.StepForm`; None: as written). Yields an object whose `result()` is
        the `Steps` the call ran, and why."""

    def jit_compile_note(self, connection: "Connection", model: Any) -> str | None:
        """Why the model's `jit_compile=True` cannot run on this connection (tpu_magic then
        turns it off for the model), or None where it can."""

    def compile_declined(self, model: Any, label: str) -> str | None:
        """Where Keras runs the model's steps op by op only for layers whose steps this
        backend compiles (JAX: Keras's coordinate-transforming image augmentation layers),
        compiles them (`jit_compile` on) and says why; None: nothing changed."""

    def replica_steps(self, model: Any, connection: "Connection") -> ContextManager[Any]:
        """While tpu_magic runs the model's steps on the replicas: each replica's losses are
        those of its own batch, as on one device, its optimizers average the replicas'
        gradients, every optimizer it holds is built before the first step, and a call
        of a model already built starts without reading a batch only to build it."""

    def leads(self) -> bool:
        """Whether this process writes the files a run keeps (checkpoints): process 0 of
        several hosts' processes, else the one process."""

    def shard_writer(self, model: Any) -> Any:
        """What writes this model's checkpoints shard by shard, on every process at once
        (`backends.jax.checkpoint.ShardWriter`: several hosts, or a model split over the
        devices), or None: one file, written by the process that `leads`. `model` None: a
        reader of such checkpoints (None where this backend cannot read them)."""

    def replica_sum(self, value: Any) -> Any:
        """`value` summed over the replicas, inside a step (the value itself where a step
        sees the global batch)."""

    def model_parallel(self, connection: "Connection", rows: int, columns: int,
                       owners: Callable[[], Iterable[type]] | None = None) -> "Connection":
        """The connection for a cell that lays the model out over a `rows` × `columns` mesh
        of the connection's devices (data × model), a variable's layout from the model's
        own layout map, else from its shape (`core.layouts.derived_spec`). A variable made
        while the cell runs takes the map of a class `owners()` gives, asked then (the
        classes the cell names: `training.cell_code.layout_owners`); one that exists
        already, its model's.

        Raises:
            ShardError: this backend has no model parallelism.
        """

    def step_memory(self, model: Any, batch: Any, connection: "Connection | None" = None,
                    form: Any = None, bf16: bool = False) -> "StepMemory | None":
        """One device's memory for a training step of `model` on `batch` (arrays of the
        global batch's shapes), from the compiler, before any step runs (None: this backend
        cannot tell). With `connection`: on its mesh, as if the model were laid out there;
        `form`: the step as micro-batches and/or with its blocks rematerialized
        (`core.steps.StepForm`; the program compiled is the one the fit then runs); `bf16`:
        as if its floating-point variables were bfloat16."""

    def call_memory(self, model: Any, kind: str, batch: Any) -> "StepMemory | None":
        """One device's memory for a `kind` ("test", "predict") step of the model on one
        batch, from the compiler, before it runs (None: this backend cannot tell)."""

    def step_form_not_exact(self, model: Any) -> str | None:
        """Why micro-batches inside the step would not give the model's full-batch numbers
        (None: they would)."""

    def repeated_blocks(self, model: Any) -> list:
        """The model's repeated blocks, rematerialized in a step of `form.remat` (none: this
        backend does not)."""

    def normalizes_parts(self, model: Any) -> list[str]:
        """The model's layers that, micro-batched, normalize each micro-batch by its own
        statistics (BatchNormalization in training)."""

    def reshard(self, model: Any, connection: "Connection") -> None:
        """Lays out an existing model's variables for `connection`'s mesh, one at a time."""

    def step_state(self, model: Any) -> "StepState":
        """The model's training state now, as host arrays (the first-step parity check's
        before and after); a frozen layer's weights are not copied."""

    def one_device_steps(self, model: Any, before: "StepState", batches: list,
                         one_device_copy: Callable[[], Any], parts: int = 1
                         ) -> "tuple[dict, Update]":
        """The model's training steps on one device, with plain Keras's code, from `before`,
        one a batch: their last logs and the sizes of their change of the state
        (`core.steps.Update`). `one_device_copy` makes a compiled copy of the model outside
        every strategy, for a backend whose variables cannot leave theirs (TensorFlow's).
        `parts`: the batch's parts as the devices hold it (the replicas times the step's own
        micro-batches): a backend that plans memory runs a batch in that many micro-batches
        where they give its numbers, so that device holds a distributed step's activations,
        not the whole batch's."""

    def one_device_ahead(self, model: Any, batch: Any, parts: int = 1, steps: int = 1
                         ) -> "Callable[[], bool] | None":
        """Before the fit's first step (before its memory plan, where the fit is known to
        be checked), the model built: `one_device_steps` for `steps` batches like `batch`
        (in `parts`, as there) made ready while the cell goes on, once a model and batch
        type; returns whether they are ready now, for the check to compare where they are
        (a backend that cannot: nothing, None)."""

    def one_device_update(self, model: Any, batch: Any, parts: int = 1
                          ) -> "tuple[dict, Update] | None":
        """Just before the fit's first step, where `one_device_ahead` made one step for
        `batch`'s type ready: that step run now from the model's own state on one device,
        as `one_device_steps` returns it; the state is not copied for it where a device
        holds it whole. None where it is not ready (nothing waited for) or cannot run so:
        the check then runs `one_device_steps` from the copied state after the step."""

    def step_logs(self, model: Any, logs: dict) -> dict:
        """The metrics over the whole batch after a step (a callback's `logs` may hold one
        replica's own, as on TensorFlow replicas)."""

    def whole_batch(self, model: Any, call: Mapping[str, Any]) -> Any:
        """The means to run a fit (`call`: its inputs as built) with every replica computing
        the whole global batch, as one device does: for a model whose losses the replicas
        cannot split (an object with `start`, `rerun`, `keep`, `undo` and `close`, as
        `tf/whole_batch.WholeBatch`). None where a step sees the global batch already (JAX)
        or the fit's inputs cannot be given whole."""

    def distributed_inference(self, model: Any, batch: Any) -> "dict | None":
        """`batch`'s logs in inference mode (random layers off) as the model's replicas
        compute them, leaving its metrics as they were: the parity check of a model whose
        replicas draw their own random numbers (None: this backend's training step is
        compared instead, or the batch does not split)."""

    def one_device_inference(self, model: Any, batch: Any,
                             one_device_copy: Callable[[], Any]) -> dict:
        """`batch`'s logs in inference mode on one device, with plain Keras's code, from the
        model's weights now."""

    def evaluate_rest(self, model: Any, rest: tuple,
                      one_device_copy: Callable[[], Any]) -> "dict | None":
        """`evaluate`'s results over every sample, after its whole batches ran on the
        replicas and `rest` (x, y, sample_weight: the last samples, fewer than the replicas
        take in equal shares, of a model whose loss cannot be masked) was left out of them:
        a one-device copy holding the model's weights evaluates `rest`, and its metric states
        are added to the model's (Keras's metric states are sums). None: this backend leaves
        them out (the report counts them)."""

    def shard_rows(self, model: Any) -> list:
        """Each of the model's variables as a `core.layouts.VariableShard`: its layout on the
        mesh and its bytes on one device."""

    def compile_counts(self) -> "CompileCounts | None":
        """Programs compiled and loaded from the persistent cache so far (None: not known)."""

    def release_compiled(self) -> None:
        """The compiled programs the framework keeps for what it ran (every jitted function's
        and eager op's, at every shape), let go: what runs again compiles again, or loads
        from the compile cache. For a process near Linux's limit on memory maps
        (`core.host_maps`); a framework that keeps none does nothing."""

    def training_flops(self, model: Any, batch: Any = None) -> "tuple[float, str] | None":
        """FLOPs of one training sample and where the count comes from (None: not known);
        `batch`: a batch the model is fed, for inputs whose sizes the model leaves open."""



class Named:
    """A backend object shows its name ("tf", "jax")."""

    name = ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
