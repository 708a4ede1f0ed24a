"""K steps a dispatch on JAX: a fit's, an evaluation's or a prediction's steps run in groups,
each group one compiled program, a `jax.lax.scan` over its K stacked batches.

Keras 3.15's JAX trainer runs `steps_per_execution` as a host loop of one-step calls, so the
host pays a dispatch, a transfer and Keras's own loop for every step, and a small model's
chip waits for it. Here, while tpu_magic runs a model's call, the model's train, test and
predict functions are replaced by ones that take the execution's batches together: from
tpu_magic's own pipeline of NumPy arrays, a group is gathered on the host at once and put
on the devices in one transfer (`PaddedBatches.group`); from any other input, the batches
Keras's iterator placed are stacked on the devices. The scan's body is Keras's own stateless
step (`train_step`, `test_step`, `predict_step`), its carry the same state Keras carries
(weights, optimizer slots, metrics, the random generators' seeds, BatchNorm statistics), so
K scanned steps compute what K single steps compute, and the logs are the last step's, as
Keras's own `steps_per_execution` gives them. Each execution reads the steps one step an
execution would read there (`epoch_reads`: K, or fewer where the epoch or the pass ends). A
group whose batches differ in shape (a short last batch) runs each different batch as one
step of its own. On the CPU a short group runs unrolled, and a convolving model's groups
stay short (`_unrolled`, `_loop_bound`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from tpu_magic.backends.jax.epoch_reads import COUNTED, Reads
from tpu_magic.core.deps import require_jax
from tpu_magic.core.overrides import overridden
from tpu_magic.core.steps import TRACED, batch_signature, state_groups

_LOOP = "_tpu_magic_device_loop"  # on the model: its compiled programs, kept across calls
CPU_UNROLLED = 8  # on the CPU, a group of at most this many steps runs unrolled


@contextlib.contextmanager
def grouped(model: Any, steps: int, sources: dict[str, Any] | None = None) -> Iterator[None]:
    """While a call runs: `steps` steps a dispatch for the model's train, test and predict
    functions (see the module's docstring). `sources`: tpu_magic's own pipelines by role
    ("train", "test", "predict"), read a group at a time where Keras would read a batch
    (`PaddedBatches.group`). One step a dispatch (`steps` 1), or a model Keras runs eagerly
    or without XLA: Keras's own functions, untouched."""
    if steps <= 1 or model.run_eagerly or not model.jit_compile:
        yield
        return
    loop = _loop_of(model)
    # several processes read a batch at a time, each its own rows (Keras's iterator)
    loop.k, loop.sources = steps, dict(sources or {}) if _one_process() else {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(COUNTED.during())
        for kind in ("train", "test", "predict"):
            stack.enter_context(overridden(model, f"make_{kind}_function",
                                           loop.maker(kind)))
        saved = (model.train_function, model.test_function, model.predict_function,
                 model.steps_per_execution)
        model.train_function = model.test_function = model.predict_function = None
        model.steps_per_execution = steps  # Keras's loop hands over K batches an execution
        try:
            yield
        finally:
            loop.finished()
            (model.train_function, model.test_function, model.predict_function,
             model.steps_per_execution) = saved


def _loop_of(model: Any) -> "Loop":
    """The model's loop, made again where its functions were retraced since (tpu_magic's
    `models.setup.prepare` marks a retrace on the model: `core.steps.TRACED`) or its state
    is no longer the one its programs were compiled for."""
    loop = model.__dict__.get(_LOOP)
    if loop is None or loop.generation is not model.__dict__.get(TRACED) or \
            (loop.state is not None and loop.state != _state_of(model)):
        loop = Loop(model)
        object.__setattr__(model, _LOOP, loop)
    return loop


def _state_of(model: Any) -> tuple:
    """Which variables the model's steps take, by identity: a program compiled for one
    cannot take another (its outputs' layouts are fixed)."""
    return tuple(tuple(id(v) for v in group) for group in state_groups(model))


def measured(model: Any, kind: str, batch: Any, repeats: int = 7
             ) -> tuple[float, float, tuple[int, str] | None] | None:
    """One `kind` step of the model on `batch` (NumPy, one batch), timed on a copy of its
    state (the model is left as it was): its device seconds, the host's seconds to put
    the batch on the devices and dispatch the step, and the longest group that runs as
    fast a step, with why (`_loop_bound`). The step's program is the loop's own, so the fit
    compiles it once. Measured once a model, step and batch type. None where it is not
    measured (`_measurable`)."""
    import time

    jax = require_jax()
    from keras.src.backend.jax.trainer import _distribute_data

    if not _measurable(model, kind):
        return None
    if kind != "predict":
        model._symbolic_build(data_batch=batch)  # what Keras builds first: metrics, optimizer
    loop = _loop_of(model)
    key = (kind, batch_signature(batch))
    if key not in loop.measured:
        start = time.perf_counter()
        placed = jax.block_until_ready(_distribute_data(batch))
        transfer = time.perf_counter() - start
        group = Group(placed, 1, single=True)
        state = loop.state_copy(kind)
        program = loop._program(kind, group)
        bound = _loop_bound(kind, program, state, placed)
        out, state = jax.block_until_ready(program(state, placed))  # compiles
        dispatches, totals = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            out, state = program(state, placed)
            returned = time.perf_counter()
            jax.block_until_ready((out, state))
            dispatches.append(returned - start)
            totals.append(time.perf_counter() - start)
        dispatch, total = sorted(dispatches)[repeats // 2], sorted(totals)[repeats // 2]
        loop.measured[key] = (max(total - dispatch, 1e-7), dispatch + transfer, bound)
    return loop.measured[key]


def measured_group(model: Any, kind: str, batch: Any, k: int) -> float | None:
    """Seconds a `kind` step takes when `k` of them run as one group on `batch` repeated,
    the whole dispatch timed (its call and its steps), on a copy of the state: the program
    the call then runs, compiled here (once). A group's program is not always as fast a
    step as the step alone (XLA schedules it as a whole); `training.fit.steps` keeps one
    step a dispatch where it is slower. Measured once a model, step, batch type and K;
    None where it is not measured (`_measurable`)."""
    import time

    import keras
    import numpy as np

    jax = require_jax()
    if not _measurable(model, kind):
        return None
    loop = _loop_of(model)
    key = (kind, batch_signature(batch), k)
    if key not in loop.timed_groups:
        def repeated(array: Any) -> Any:  # a marked batch (`WholeRows`) stays marked
            stacked = np.stack([np.asarray(array)] * k)
            return stacked.view(type(array)) if isinstance(array, np.ndarray) else stacked

        group = Group.gathered(keras.tree.map_structure(repeated, batch))
        program = loop._program(kind, group)
        state = loop.state_copy(kind)
        out, state = jax.block_until_ready(program(state, group.data))  # compiles
        start = time.perf_counter()
        jax.block_until_ready(program(state, group.data))
        loop.timed_groups[key] = (time.perf_counter() - start) / k
    return loop.timed_groups[key]


def _measurable(model: Any, kind: str) -> bool:
    """Whether `kind`'s step can be timed here: one process (several would each time their
    own and choose their own K, where every process must run the same programs), and a
    model built (predict) or compiled (train, test) for the step."""
    if not _one_process():
        return False
    return model.built if kind == "predict" else model.compiled


def _loop_bound(kind: str, program: Any, state: Any, placed: Any) -> tuple[int, str] | None:
    """The longest group of `kind` steps that runs as fast a step as one step alone, and
    why; None: any. On the CPU a train step that convolves: a convolution's kernel gradient
    in a loop's body runs tens of times slower on XLA:CPU than outside one (measured:
    docs/benchmarks.md), so its groups stay short enough to run unrolled (`_unrolled`)."""
    if kind != "train" or require_jax().default_backend() != "cpu":
        return None
    try:
        convolves = "stablehlo.convolution" in program.lower(state, placed).as_text()
    except Exception:  # noqa: BLE001 - not read: the groups are not bounded
        return None
    return (CPU_UNROLLED, "a convolution's gradient, which XLA:CPU runs slowly in a loop, "
                          f"so groups of at most {CPU_UNROLLED} run unrolled") \
        if convolves else None


def _one_process() -> bool:
    return require_jax().process_count() == 1


def _copied(state: Any) -> Any:
    """A copy of the state on the devices, in one program (the measured steps consume it)."""
    return _shared_programs()["copy"](state)


@functools.cache
def _shared_programs() -> dict[str, Callable[..., Any]]:
    """The small programs every loop shares, made once a process: a copy of a state, and a
    stack of batches already on the devices along a new first axis."""
    jax = require_jax()
    import jax.numpy as jnp

    return {"copy": jax.jit(lambda tree: jax.tree_util.tree_map(lambda a: a.copy(), tree)),
            "stack": jax.jit(lambda *parts: jax.tree_util.tree_map(
                lambda *xs: jnp.stack(xs), *parts))}


def _state(model: Any, kind: str) -> tuple:
    """The model's state as Keras's `kind` step takes it (`_get_jax_state`)."""
    return model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                optimizer_variables=kind == "train",
                                metrics_variables=kind != "predict")


class Loop:
    """One model's grouped functions and their compiled programs (a scan for each group
    length and batch type, a step for a batch of its own), kept while its state's
    structure stays."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.generation = model.__dict__.get(TRACED)
        self.state: tuple | None = None  # the state its programs take, once one is compiled
        self.k = 1
        self.sources: dict[str, Any] = {}
        self._programs: dict[tuple, Callable[..., Any]] = {}
        self.measured: dict[tuple, tuple] = {}  # (kind, batch type) -> a step's times
        self.timed_groups: dict[tuple, float] = {}  # (kind, batch type, K) -> seconds a step
        self._layouts: dict[str, tuple | None] = {}  # kind -> each state value's layout
        self._last: dict[str, Any] = {}  # kind -> the state its last execution returned
        self._ahead: dict[str, tuple] = {}  # kind -> (pass, first step, staged groups)

    def maker(self, kind: str) -> Callable[..., Any]:
        function = {"train": self.train, "test": self.test, "predict": self.predict}[kind]

        def make(force: bool = False) -> Any:
            setattr(self.model, f"{kind}_function", function)
            return function

        return make

    # -- the three functions Keras calls, one an execution ------------------------------------

    def train(self, state: Any, iterator: Any) -> Any:
        return self._run("train", state, iterator)

    def test(self, state: Any, iterator: Any) -> Any:
        return self._run("test", state, iterator)

    def predict(self, state: Any, iterator: Any) -> Any:
        outputs = []
        state = self._laid_out("predict", state)
        for group in self._groups("predict", iterator):
            out, state = self._program("predict", group)(state, group.data)
            outputs.append(out if group.single else _unstacked(out))
        self._stage("predict", iterator)
        self._last["predict"] = state
        return _joined(outputs), state

    def _run(self, kind: str, state: Any, iterator: Any) -> Any:
        logs = None
        state = self._laid_out(kind, state)
        for group in self._groups(kind, iterator):
            logs, state = self._program(kind, group)(state, group.data)
        self._stage(kind, iterator)
        self._last[kind] = state
        return logs, state

    def state_copy(self, kind: str) -> Any:
        """A copy of the model's state for `kind`'s programs, laid out as they take it (a
        timed run consumes it; the model keeps its own)."""
        return _copied(self._laid_out(kind, _state(self.model, kind)))

    def _laid_out(self, kind: str, state: Any) -> Any:
        """The state as the programs take it: each value on its variable's layout. Keras's
        fresh values (a new model's weights, the metrics' zeros) may lack it, and a program
        compiled for one type recompiles for the other; the state a program returned has it
        already (checked once a pass, where Keras hands over a state of its own)."""
        if state is self._last.get(kind):
            return state
        jax = require_jax()
        targets = self._targets(kind)
        if targets is None:
            return state
        return tuple([value if value.sharding == target else jax.device_put(value, target)
                      for value, target in zip(group, group_targets)]
                     for group, group_targets in zip(state, targets))

    def _targets(self, kind: str) -> tuple | None:
        """Each state value's layout for `kind`'s steps (None: no distribution in force)."""
        if kind not in self._layouts:
            self._layouts[kind] = _layouts(self.model, kind)
        return self._layouts[kind]

    # -- reading an execution's batches -------------------------------------------------------

    def _groups(self, kind: str, iterator: Any) -> list["Group"]:
        """The execution's batches (its steps: `Reads.limit`; StopIteration where there is
        none), as groups of consecutive batches of one type: each a stack, or a batch run on
        its own. From tpu_magic's own pipeline, gathered a group at a time without Keras's
        iterator, which then reads nothing (each pass is a new `Reads`, from batch 0)."""
        limit = iterator.limit if isinstance(iterator, Reads) else self.k
        source = self.sources.get(kind) if isinstance(iterator, Reads) else None
        if source is None:
            return _alike(_taken(iterator, limit))
        done = iterator.done
        if done >= len(source):
            raise StopIteration
        steps = min(limit, len(source) - done)
        ahead = self._ahead.pop(kind, None)
        groups = ahead[2] if ahead is not None and ahead[:2] == (iterator, done) and \
            sum(len(group) for group in ahead[2]) == steps else self._read(source, done, steps)
        iterator.took(steps)
        return groups

    def _read(self, source: Any, done: int, steps: int) -> list["Group"]:
        """`steps` batches from tpu_magic's own pipeline, from its `done`th, on the devices."""
        return [Group.gathered(data) if stacked else Group.one(data)
                for data, stacked in source.group(done, steps)]

    def _stage(self, kind: str, iterator: Any) -> None:
        """The next execution's batches of this pass read and on their way to the devices
        while the device runs the one just dispatched (the host's reading and the transfer
        overlap the device's steps); only within the pass, whose order is fixed, and as
        many as an execution reads (K, or the rest of the pass)."""
        source = self.sources.get(kind)
        if source is None or not isinstance(iterator, Reads):
            return
        done = iterator.done
        if done < len(source):
            self._ahead[kind] = (iterator, done,
                                 self._read(source, done, min(self.k, len(source) - done)))

    def finished(self) -> None:
        """The call ended: what it staged and the state it last returned are let go."""
        self._ahead.clear()
        self._last.clear()

    # -- the programs ------------------------------------------------------------------------

    def _program(self, kind: str, group: "Group") -> Callable[..., Any]:
        key = (kind, group.single, group.length, group.signature)
        found = self._programs.get(key)
        if found is None:
            self.state = _state_of(self.model)
            found = self._programs[key] = _compiled(self.model, kind, group.length,
                                                    group.single, self._targets(kind))
        return found


class Group:
    """Batches of one type run as one program: `data` stacked (length `length`), or one
    batch (`single`)."""

    def __init__(self, data: Any, length: int, single: bool) -> None:
        self.data, self.length, self.single = data, length, single
        jax = require_jax()
        self.signature = tuple((tuple(a.shape), str(a.dtype))
                               for a in jax.tree_util.tree_leaves(data))

    @classmethod
    def gathered(cls, stacked: Any) -> "Group":
        """A group gathered on the host (`PaddedBatches.group`): put on the devices at once."""
        return cls(_placed_stack(stacked), len(_leaves(stacked)[0]), single=False)

    @classmethod
    def one(cls, batch: Any) -> "Group":
        """A batch of its own, from the host: placed as Keras places a batch."""
        from keras.src.backend.jax.trainer import _distribute_data

        return cls(_distribute_data(batch), 1, single=True)

    def __len__(self) -> int:
        return 1 if self.single else self.length


def _taken(iterator: Any, k: int) -> list:
    """Up to `k` batches from Keras's iterator (placed on the devices); StopIteration where
    it has none, as Keras's own loop expects."""
    batches = [next(iterator)]
    for _ in range(k - 1):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    return batches


def _alike(batches: list) -> list[Group]:
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


def _kind(batch: Any) -> tuple:
    jax = require_jax()
    leaves, tree = jax.tree_util.tree_flatten(batch)
    return tree, tuple((tuple(a.shape), str(a.dtype), getattr(a, "sharding", None))
                       for a in leaves)


def _leaves(data: Any) -> list:
    return require_jax().tree_util.tree_leaves(data)


def _stacked_on_device(batches: list) -> Any:
    """Batches already on the devices, stacked along a new first axis there (one program)."""
    return _shared_programs()["stack"](*batches)


def _placed_stack(stacked: Any) -> Any:
    """A group gathered on the host, (K, batch, ...) arrays, put on the devices laid out as
    the distribution lays out one batch, along the second axis (one transfer; one process);
    a group marked `WholeRows`, whole on every device."""
    import keras
    import numpy as np

    from tpu_magic.backends.jax.data import WholeRows

    jax = require_jax()
    distribution = keras.distribution.distribution()

    def place(array: Any) -> Any:
        if distribution is None:
            return jax.device_put(array)
        layout = distribution.get_data_layout(tuple(array.shape[1:])).backend_layout
        if layout.num_devices == 1:  # the program's own call moves it, in C++
            return array
        if isinstance(array, WholeRows):  # whole on every device (a small prediction's)
            return jax.device_put(np.asarray(array), jax.sharding.NamedSharding(
                layout.mesh, jax.sharding.PartitionSpec()))
        spec = jax.sharding.PartitionSpec(None, *layout.spec)
        sharding = jax.sharding.NamedSharding(layout.mesh, spec)
        try:
            sharding.shard_shape(tuple(array.shape))
        except Exception:  # noqa: BLE001 - jax's IndivisibleError: a batch the rows do not divide
            # goes whole to every device, as `replica_steps` gives such a batch
            sharding = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
        return jax.device_put(array, sharding)

    return keras.tree.map_structure(place, stacked)


def _unstacked(out: Any) -> Any:
    """A group's predictions, (K, batch, ...), as Keras joins an execution's: (K × batch, ...)."""
    import keras

    return keras.tree.map_structure(
        lambda a: a.reshape((a.shape[0] * a.shape[1],) + tuple(a.shape[2:])), out)


def _joined(outputs: list) -> Any:
    if len(outputs) == 1:
        return outputs[0]
    import jax.numpy as jnp
    import keras

    return keras.tree.map_structure(lambda *parts: jnp.concatenate(parts), *outputs)


def _compiled(model: Any, kind: str, length: int, single: bool,
              layouts: tuple | None) -> Callable[..., Any]:
    """Keras's own step for `kind` as one jitted program: a scan over `length` stacked
    batches, or (`single`) one step; its state donated, and returned on `layouts` (each
    variable's, as Keras's own `make_*_function` fixes its outputs'; None: no distribution).
    On the CPU a short scan is unrolled (`_unrolled`)."""
    jax = require_jax()
    step = _step(model, kind)
    unroll = _unrolled(length)

    def scanned(state: Any, stacked: Any) -> Any:
        def body(carry: Any, batch: Any) -> Any:
            out, carry = step(carry, batch)
            return carry, out

        state, outs = jax.lax.scan(body, state, stacked, unroll=unroll)
        if kind == "predict":
            return outs, state
        return jax.tree_util.tree_map(lambda a: a[-1], outs), state

    return jax.jit(step if single else scanned, donate_argnums=0,
                   out_shardings=None if layouts is None else (None, layouts))


def _unrolled(length: int) -> int | bool:
    """How the scan of a group of `length` steps is laid out: a loop (1) on TPUs and GPUs;
    on the CPU straight-line code where the group is short. XLA:CPU runs a convolution's
    gradient in a loop's body many times slower than outside one (docs/benchmarks.md);
    unrolled, a group compiles in about a step's compile for each step it holds, so only
    short groups are (a long group's steps are short, and a loop of dense layers costs
    nothing there)."""
    if length <= CPU_UNROLLED and require_jax().default_backend() == "cpu":
        return True
    return 1


def _layouts(model: Any, kind: str) -> tuple | None:
    """Each value of `kind`'s state on its variable's layout (`_layout`, set by the
    distribution), or replicated over the distribution's mesh where the variable has none;
    None where no distribution is in force."""
    import keras

    jax = require_jax()
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    mesh = distribution.device_mesh.backend_mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def layout(variable: Any) -> Any:
        own = getattr(variable, "_layout", None)
        own = getattr(own, "backend_layout", own)
        return own if isinstance(own, jax.sharding.NamedSharding) else replicated

    trainable, non_trainable, optimizer, metrics = state_groups(model)
    groups = {"train": (trainable, non_trainable, optimizer, metrics),
              "test": (trainable, non_trainable, metrics),
              "predict": (trainable, non_trainable)}[kind]
    return tuple([layout(v) for v in group] for group in groups)


def _step(model: Any, kind: str) -> Callable[..., Any]:
    """Keras's stateless step of `kind`, as its own `make_*_function` takes it."""
    from keras.src.backend.config import is_nnx_enabled

    own = getattr(type(model), f"{kind}_step")
    bound = (lambda state, data: own(model, state, data)) if is_nnx_enabled() else \
        getattr(model, f"{kind}_step")
    if kind != "predict":
        return bound

    def predict_step(state: Any, data: Any) -> Any:  # Keras's wrapping in make_predict_function
        outputs, non_trainable = bound(state, data)
        return outputs, (state[0], non_trainable)

    return predict_step
