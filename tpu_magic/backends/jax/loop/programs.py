"""A model's compiled programs for its grouped calls, kept in its record (`core.record`: a
retrace drops them): one jitted program a kind, group length and batch type, Keras's own
stateless step or a `jax.lax.scan` over a group of them, its state donated and returned on
each variable's layout. Each is compiled once, and shared by everything that asks: the memory
plan compiles the run's own train step from abstract inputs (`Programs.abstract_train`),
and the call then runs that executable; a group's program may be compiled on a thread of
its own while the call's first steps run (`Programs.ahead`). JAX reuses an executable for a
later call whose arguments have the same shapes and layouts.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from tpu_magic.backends.jax import step_forms
from tpu_magic.backends.jax.beside import Beside
from tpu_magic.backends.jax.loop.reading import Group, spec
from tpu_magic.core import record
from tpu_magic.core.deps import require_jax
from tpu_magic.core.steps import StepForm, state_groups

CPU_UNROLLED = 8  # on the CPU, a group of at most this many steps runs unrolled
# a group's loop compiles in about this many compiles of its one step (an estimate, for
# whether grouping pays for its compile: docs/benchmarks.md)
LOOP_COMPILES = 2
CONVOLUTION = "stablehlo.convolution"


def programs_of(model: Any) -> "Programs":
    """The model's programs, made again where its state is no longer the one they were
    compiled for (a program compiled for one set of variables cannot take another)."""
    kept = record.of(model)
    found = kept.programs
    if found is None or found.state is not None and found.state != _state_of(model):
        found = kept.programs = Programs(model)
    return found


class Programs:
    """One model's programs (see the module's docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.state: tuple | None = None  # the variables its programs take, once one exists
        self._jitted: dict[tuple, Callable[..., Any]] = {}
        self._compiled: dict[tuple, Any] = {}  # the same keys, compiled ahead of the call
        # (kind, batch shapes) -> the longest compile of its one step, in any form and
        # layout (the same program asked for again, its batch's layout written another way,
        # compiles from JAX's own caches in milliseconds)
        self._seconds: dict[tuple, float] = {}
        self._layouts: dict[str, tuple | None] = {}  # kind -> each state value's layout
        self._last: dict[str, Any] = {}  # kind -> the state its last execution returned
        self.convolves: dict[tuple, bool] = {}  # a train step's batch type -> it convolves
        self.form = StepForm()  # the train step's form for the call running (`use`)

    def use(self, form: StepForm | None) -> None:
        """The train step's form for the call about to run (as written where None)."""
        self.form = form or StepForm()

    def _key(self, kind: str, single: bool, length: int, signature: tuple) -> tuple:
        return (kind, single, length, signature, self.form if kind == "train" else None)

    def program(self, kind: str, group: Group) -> Callable[..., Any]:
        """`kind`'s program for `group`, jitted once (compiled at its first call, or ahead)."""
        key = self._key(kind, group.single, group.length, group.signature)
        found = self._jitted.get(key)
        if found is None:
            self.state = _state_of(self.model)
            found = self._jitted[key] = _jitted(self.model, kind, group.length, group.single,
                                                self.targets(kind), self.form)
        return found

    def first_run(self, kind: str, group: Group, state: Any) -> bool:
        """Before `group`'s program first runs: lowered and compiled here, once (the call
        then runs that executable), and a train step's text read for convolutions. Whether
        it compiled it now."""
        key = self._key(kind, group.single, group.length, group.signature)
        if key in self._compiled:
            return False
        self._compile(key, kind, group, state, group.data)
        return True

    def _compile(self, key: tuple, kind: str, group: Group, state: Any, data: Any) -> None:
        """`group`'s program lowered and compiled now, its seconds kept (what a group of
        such steps is estimated to cost to compile: `ahead_seconds`), a train step's text
        read for convolutions."""
        started = time.perf_counter()
        lowered = self.program(kind, group).lower(state, data)
        if kind == "train" and group.single:
            self.convolves[group.signature] = CONVOLUTION in lowered.as_text()
        self._compiled[key] = lowered.compile()
        if group.single:
            seconds = time.perf_counter() - started
            shapes = (kind, _shapes(group.signature))
            self._seconds[shapes] = max(seconds, self._seconds.get(shapes, 0.0))

    def ahead(self, kind: str, template: Group, length: int, state: Any) -> Beside:
        """The program of a group of `length` batches like `template` (one batch), compiled
        from abstract inputs on a thread of its own while the call runs on (`beside`)."""
        jax = require_jax()
        stacked = spec(template.data, length)
        shapes = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        group = _abstract_group(stacked, length)
        key = self._key(kind, False, length, group.signature)
        if key in self._compiled:  # an earlier call's
            return Beside(self.model, lambda: None)
        program = self.program(kind, group)
        context = _keras_context()

        def compile_it() -> None:
            _enter_keras_context(context)
            self._compiled[key] = program.lower(shapes, stacked).compile()

        return Beside(self.model, compile_it)

    def ahead_seconds(self, kind: str, template: Group, length: int) -> float | None:
        """The estimated seconds to compile the program of a group of `length` batches like
        `template` (0: compiled already; None: its step's compile was not timed here):
        from its one step's compile, as many of them as the group unrolls steps, or
        `LOOP_COMPILES` for a loop."""
        group = _abstract_group(spec(template.data, length), length)
        if self._key(kind, False, length, group.signature) in self._compiled:
            return 0.0
        one = self._seconds.get((kind, _shapes(template.signature)))
        if one is None:
            return None
        return one * (length if _unrolled(length) is True else LOOP_COMPILES)

    def abstract_train(self, state: Any, batch: Any, form: StepForm | None = None) -> Any:
        """The train step's program for one batch in `form` (`batch`, `state`: their
        abstract shapes and layouts, `reading.spec`), compiled now: the executable the fit
        then runs, where the fit's batch and state have these layouts and its step this
        form. Its memory analysis plans memory, its cost analysis counts FLOPs."""
        group = _abstract_group(batch, 1, single=True)
        running, self.form = self.form, form or StepForm()
        try:
            key = self._key("train", True, 1, group.signature)
            if key not in self._compiled:
                self._compile(key, "train", group, state, batch)
            return self._compiled[key]
        finally:
            self.form = running

    def abstract(self, kind: str, state: Any, batch: Any) -> Any:
        """`kind`'s program ("test", "predict") for one batch, compiled now from abstract
        shapes (`batch`, `state`: as `abstract_train` takes them): the executable the call
        then runs. Its memory analysis plans the call's memory."""
        if kind == "train":
            return self.abstract_train(state, batch)
        group = _abstract_group(batch, 1, single=True)
        key = self._key(kind, True, 1, group.signature)
        if key not in self._compiled:
            self._compile(key, kind, group, state, batch)
        return self._compiled[key]

    def bound(self, signature: tuple) -> tuple[int, str] | None:
        """The longest group of train steps that runs as fast a step as one step alone, and
        why; None: any. On the CPU a step that convolves: a convolution's kernel gradient
        in a loop's body runs tens of times slower on XLA:CPU than outside one (measured:
        docs/benchmarks.md), so its groups stay short enough to run unrolled."""
        if require_jax().default_backend() != "cpu" or not self.convolves.get(signature):
            return None
        return (CPU_UNROLLED, "a convolution's gradient, which XLA:CPU runs slowly in a "
                              f"loop, so groups of at most {CPU_UNROLLED} run unrolled")

    def laid_out(self, kind: str, state: Any) -> Any:
        """The state as the programs take it: each value on its variable's layout. Keras's
        fresh values (a new model's weights, the metrics' zeros) may lack it, and a program
        compiled for one type recompiles for the other; the state a program returned has it
        already (checked once a pass, where Keras hands over a state of its own)."""
        if state is self._last.get(kind):
            return state
        jax = require_jax()
        targets = self.targets(kind)
        if targets is None:
            return state
        return tuple([value if value.sharding == target else jax.device_put(value, target)
                      for value, target in zip(group, group_targets)]
                     for group, group_targets in zip(state, targets))

    def returned(self, kind: str, state: Any) -> None:
        self._last[kind] = state

    def finished(self) -> None:
        """The call ended: the state it last returned is let go."""
        self._last.clear()

    def targets(self, kind: str) -> tuple | None:
        """Each state value's layout for `kind`'s steps (None: no distribution in force)."""
        if kind not in self._layouts:
            self._layouts[kind] = _layouts(self.model, kind)
        return self._layouts[kind]


def _shapes(signature: tuple) -> tuple:
    """A batch type's shapes and dtypes, without the layouts."""
    return tuple(entry[:2] for entry in signature)


def _abstract_group(data: Any, length: int, single: bool = False) -> Group:
    return Group(data, length, single=single)


def _keras_context() -> tuple[dict, dict]:
    """Keras's thread-local state on this thread (its distribution, dtype policy): a thread
    that traces the model's step must trace it as this one would."""
    from keras.src.backend.common import global_state

    return (dict(vars(global_state.GLOBAL_STATE_TRACKER)),
            dict(vars(global_state.GLOBAL_SETTINGS_TRACKER)))


def _enter_keras_context(context: tuple[dict, dict]) -> None:
    from keras.src.backend.common import global_state

    vars(global_state.GLOBAL_STATE_TRACKER).update(context[0])
    vars(global_state.GLOBAL_SETTINGS_TRACKER).update(context[1])


def _state_of(model: Any) -> tuple:
    """Which variables the model's steps take, by identity."""
    return tuple(tuple(id(v) for v in group) for group in state_groups(model))


def _jitted(model: Any, kind: str, length: int, single: bool, layouts: tuple | None,
            form: StepForm) -> Callable[..., Any]:
    """Keras's own step for `kind` as one jitted program: a scan over `length` stacked
    batches, or (`single`) one step; its state donated, and returned on `layouts` (each
    variable's, as Keras's own `make_*_function` fixes its outputs'; None: no distribution).
    On the CPU a short scan is unrolled (`_unrolled`)."""
    jax = require_jax()
    step = step_forms.train_step(model, form) if kind == "train" else _step(model, kind)
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
