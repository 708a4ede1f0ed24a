"""The Keras backends tpu_magic trains on, and which one runs (`--backend tf|jax|auto`).

Everything that differs between TensorFlow and JAX lives in one object per backend,
`backends/tf.py` and `backends/jax.py`, behind the `Backend` protocol below: the rest
of tpu_magic asks the connection's backend and never branches on its name (the split
follows Keras's own `backend/{tensorflow,jax}/trainer.py`).

Keras reads `KERAS_BACKEND` once, when it is first imported, and the backend cannot
change in a running process. So the choice is made before keras is imported, and a
request that contradicts an already imported keras is refused with the fix (restart).
Importing this package imports neither TensorFlow nor JAX; `get` imports a backend's
module, which imports its framework only when asked to do something.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Collection, ContextManager, Iterable, Mapping,
                    Protocol)

from tpu_magic.errors import ConnectError

if TYPE_CHECKING:
    from tpu_magic.check import DeviceView
    from tpu_magic.compile_cache import CompileCounts
    from tpu_magic.session import Connection
    from tpu_magic.target import Target

BACKENDS = ("tf", "jax")
KERAS_NAME = {"tf": "tensorflow", "jax": "jax"}
_FROM_KERAS = {"tensorflow": "tf", "jax": "jax"}


@dataclass(frozen=True)
class BackendChoice:
    """The backend to use ("tf" or "jax") and why."""

    backend: str
    reason: str


def imported_keras_backend() -> str | None:
    """The backend of an already imported keras ("tensorflow", "jax", ...), else None."""
    keras = sys.modules.get("keras")
    if keras is None:
        return None
    try:
        return keras.backend.backend()
    except AttributeError:  # keras is being imported right now
        return None


def choose_backend(requested: str, keras_backend: str | None, env: Mapping[str, str],
                   tpu_vm: bool, installed: Mapping[str, str],
                   importable: Collection[str] | None = None) -> BackendChoice:
    """Decides the backend without importing anything.

    Args:
        requested: "tf", "jax" or "auto" (as typed after --backend).
        keras_backend: the backend of an already imported keras, or None.
        env: the environment (`KERAS_BACKEND`).
        tpu_vm: whether this machine shows TPU VM signs.
        installed: installed package versions by distribution name.
        importable: which of "tensorflow" and "jax" can be imported (None: not known, as if
            both could).

    Raises:
        ConnectError: an unknown backend, or one that contradicts the imported keras.
    """
    wanted = requested.strip().lower()
    wanted = {"tensorflow": "tf"}.get(wanted, wanted)
    if wanted not in BACKENDS + ("auto",):
        raise ConnectError(f"--backend {requested!r}: use tf, jax or auto")
    imported = _FROM_KERAS.get(keras_backend) if keras_backend else None
    if keras_backend and imported is None:
        raise ConnectError(
            f"keras is already imported with the {keras_backend} backend; tpu_magic trains with "
            "tensorflow or jax. Restart the runtime, then run `%tpu_connect` before importing keras.")
    if wanted == "auto":
        if imported:
            return BackendChoice(imported, f"keras is already imported with the {keras_backend} "
                                           "backend")
        from_env = _FROM_KERAS.get(env.get("KERAS_BACKEND", "").strip().lower())
        if from_env:
            return BackendChoice(from_env, f"KERAS_BACKEND={env['KERAS_BACKEND']}")
        if importable is not None and "tensorflow" not in importable and "jax" in importable:
            return BackendChoice("jax", "TensorFlow cannot be imported here and JAX can, as on "
                                        "Colab's TPU runtimes")
        if tpu_vm and "tensorflow-tpu" not in installed and "jax" in installed:
            return BackendChoice("jax", "a TPU VM where TensorFlow has no TPU runtime "
                                        "(no tensorflow-tpu) and JAX has, as on Kaggle's TPUs")
        return BackendChoice("tf", "the default")
    if imported and imported != wanted:
        raise ConnectError(
            f"keras is already imported with the {keras_backend} backend, and a running process "
            f"cannot switch it to {KERAS_NAME[wanted]}. Restart the runtime, then run "
            f"`%tpu_connect --backend {wanted}` before importing keras.")
    return BackendChoice(wanted, f"--backend {wanted}")


def importable_modules(names: Iterable[str] = ("tensorflow", "jax")) -> frozenset[str]:
    """Which of `names` can be imported, without importing them (an import hook that refuses
    one counts as 'cannot')."""
    found = set()
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                found.add(name)
        except (ImportError, ValueError):
            pass
    return frozenset(found)


def select(choice: BackendChoice) -> None:
    """Sets `KERAS_BACKEND` for a keras not imported yet (an imported one already agrees)."""
    if imported_keras_backend() is None:
        os.environ["KERAS_BACKEND"] = KERAS_NAME[choice.backend]


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
    keras_name: str  # "tensorflow" or "jax", as Keras names it
    label: str  # "TensorFlow" or "JAX", for people
    static_batch_is_global: bool  # a batch fixed in an Input is the global batch (JAX traces it)

    def connect(self, chosen: "Target", simulate: int | None, *, explicit_gpu: bool,
                compile_cache: str | None, env: Mapping[str, str],
                probe_node: Callable[["Target"], Any] = ...
                ) -> "tuple[Connection, Target]":
        """The connection to `chosen`; `probe_node` is the bounded reachability check a
        backend that reaches TPU nodes runs before connecting to one."""

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

    def compile_counts(self) -> "CompileCounts | None":
        """Programs compiled and loaded from the persistent cache so far (None: not known)."""

    def training_flops(self, model: Any) -> "tuple[float, str] | None":
        """FLOPs of one training sample and where the count comes from (None: not known)."""



class Named:
    """A backend object equals its name ("tf", "jax"), so `connection.backend == "jax"` reads
    as it did when the connection held the name."""

    name = ""

    def __eq__(self, other: object) -> bool:
        return other == self.name if isinstance(other, str) else other is self

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


_MODULES = {"tf": "tpu_magic.backends.tf", "jax": "tpu_magic.backends.jax"}


def get(name: str) -> Backend:
    """The backend object for "tf" or "jax" (its module is imported here, its framework not)."""
    return importlib.import_module(_MODULES[name]).BACKEND


def active() -> Backend:
    """The backend of the imported keras (importing keras if it is not yet)."""
    import keras

    return get(_FROM_KERAS[keras.backend.backend()])
