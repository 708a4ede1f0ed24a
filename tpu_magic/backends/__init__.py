"""The Keras backends tpu_magic trains on, and which one runs (`--backend tf|jax|auto`).

Everything that differs between TensorFlow and JAX lives in one object per backend,
`BACKEND` of `tf/backend.py` and of `jax/backend.py` (each package's other modules do its
jobs), behind the `Backend` protocol (`protocol.py`): the rest
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
import sys
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

from tpu_magic.core import process
from tpu_magic.core.deps import JAX_FIX, TENSORFLOW_FIX
from tpu_magic.core.errors import ConnectError, MissingDependencyError

from tpu_magic.backends.protocol import Backend

KERAS_NAME = {"tf": "tensorflow", "jax": "jax"}  # each backend (as after --backend): Keras's name
BACKENDS = tuple(KERAS_NAME)
_FROM_KERAS = {keras: name for name, keras in KERAS_NAME.items()}
_TRAINS_WITH = " or ".join(KERAS_NAME.values())  # "tensorflow or jax", for messages
_INSTALL = {"tf": TENSORFLOW_FIX, "jax": JAX_FIX}  # a backend's framework missing: the fix


@dataclass(frozen=True)
class BackendChoice:
    """The backend to use ("tf" or "jax") and why; `imported`: keras was already imported
    with it (the choice followed it)."""

    backend: str
    reason: str
    imported: bool = False


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
                   importable: Collection[str] | None = None,
                   configured: str | None = None) -> BackendChoice:
    """Decides the backend without importing anything.

    Args:
        requested: "tf", "jax" or "auto" (as typed after --backend).
        keras_backend: the backend of an already imported keras, or None.
        env: the environment (`KERAS_BACKEND`).
        tpu_vm: whether this machine shows TPU VM signs.
        installed: installed package versions by distribution name.
        importable: which of "tensorflow" and "jax" can be imported (None: not known, as if
            both could).
        configured: the backend keras.json names (`configured_keras_backend`), or None.
            `auto` follows it where it names another than Keras's default, TensorFlow: Keras
            writes its default there on its first import, so "tensorflow" is no one's choice.

    Raises:
        ConnectError: an unknown backend, or one that contradicts the imported keras.
        MissingDependencyError: the backend asked for, whose framework cannot be imported.
    """
    wanted = requested.strip().lower()
    wanted = _FROM_KERAS.get(wanted, wanted)
    if wanted not in BACKENDS + ("auto",):
        raise ConnectError(f"--backend {requested!r}: use {', '.join(BACKENDS)} or auto")
    imported = _FROM_KERAS.get(keras_backend) if keras_backend else None
    if keras_backend and imported is None:
        raise ConnectError(
            f"keras is already imported with the {keras_backend} backend; tpu_magic trains with "
            f"{_TRAINS_WITH}. Restart the runtime, then run `%tpu_connect` before importing keras.")
    if wanted == "auto":
        if imported:
            return BackendChoice(imported, f"keras is already imported with the {keras_backend} "
                                           "backend", imported=True)
        set_in_env = env.get("KERAS_BACKEND", "").strip()
        from_env = _FROM_KERAS.get(set_in_env.lower())
        if from_env:
            return BackendChoice(from_env, f"KERAS_BACKEND={set_in_env}")
        from_json = _FROM_KERAS.get(configured or "")
        if not set_in_env and from_json and configured != KERAS_NAME["tf"] and (
                importable is None or configured in importable):
            return BackendChoice(from_json, f"keras.json names {configured}")
        choice = _auto(tpu_vm, installed, importable)
        if set_in_env:  # e.g. torch, a common Colab GPU setting: said, not silently replaced
            return BackendChoice(choice.backend, f"KERAS_BACKEND={set_in_env} is set, but "
                                 f"tpu_magic trains with {_TRAINS_WITH}, so it uses "
                                 f"{KERAS_NAME[choice.backend]} ({choice.reason})")
        return choice
    if importable is not None and not imported and KERAS_NAME[wanted] not in importable:
        raise MissingDependencyError(f"--backend {wanted}: " + _INSTALL.get(
            wanted, f"{KERAS_NAME[wanted]} cannot be imported here."))
    if imported and imported != wanted:
        raise ConnectError(
            f"keras is already imported with the {keras_backend} backend, and a running process "
            f"cannot switch it to {KERAS_NAME[wanted]}. Restart the runtime, then run "
            f"`%tpu_connect --backend {wanted}` before importing keras.")
    return BackendChoice(wanted, f"--backend {wanted}", imported=imported == wanted)


def _auto(tpu_vm: bool, installed: Mapping[str, str],
          importable: Collection[str] | None) -> BackendChoice:
    """`auto` where nothing (an imported keras, KERAS_BACKEND) has chosen yet."""
    if importable is not None and "tensorflow" not in importable and "jax" in importable:
        return BackendChoice("jax", "TensorFlow cannot be imported here and JAX can, as on "
                                    "Colab's TPU runtimes")
    if tpu_vm and only_jax_reaches_the_tpu(installed):
        return BackendChoice("jax", "a TPU VM where TensorFlow has no TPU runtime "
                                    "(no tensorflow-tpu) and JAX has, as on Kaggle's TPUs")
    return BackendChoice("tf", "the default")


def tensorflow_took_a_jax_tpu(choice: BackendChoice, tpu_vm: bool,
                              installed: Mapping[str, str]) -> bool:
    """keras was already imported with TensorFlow on a TPU VM where only JAX reaches the TPU
    (Kaggle's image: keras imported first follows tensorflow-cpu, which has no TPU)."""
    return choice.imported and choice.backend == "tf" and tpu_vm and \
        only_jax_reaches_the_tpu(installed)


def only_jax_reaches_the_tpu(installed: Mapping[str, str]) -> bool:
    """JAX is installed and TensorFlow's TPU build is not (Kaggle's TPU image)."""
    return "tensorflow-tpu" not in installed and "jax" in installed


def tensorflow_may_load() -> bool:
    """Whether something may still import TensorFlow in this process (Keras, KerasHub, grain):
    it is not imported yet, and it can be."""
    return "tensorflow" not in sys.modules and "tensorflow" in importable_modules(("tensorflow",))


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


def keras_default_is_jax(keras_imported: bool, env: Mapping[str, str],
                         configured: str | None, importable: Collection[str]) -> bool:
    """Whether `%load_ext tpu_magic` makes JAX Keras's backend: Keras is not imported yet,
    `KERAS_BACKEND` is not set, keras.json (`configured`) names no backend or names
    TensorFlow, and TensorFlow cannot be imported while JAX can (Colab's TPU image, a `[jax]`
    install). Then `import keras` before `%tpu_connect` works, as it does where TF is.

    keras.json naming TensorFlow is no choice of the user's there: Keras writes it, with
    its default backend, on its first import, whatever `KERAS_BACKEND` says, so a `[jax]`
    install's second session would otherwise start Keras on a TensorFlow it cannot import.
    """
    return (not keras_imported and not env.get("KERAS_BACKEND", "").strip()
            and configured in (None, "tensorflow") and "tensorflow" not in importable
            and "jax" in importable)


def keras_json(env: Mapping[str, str], shown: bool = False) -> str:
    """Where Keras keeps its configuration: `$KERAS_HOME/keras.json`, else ~/.keras/keras.json
    (/tmp/.keras where the home cannot be written, as Keras decides); `shown`: the home
    written as ~, for a message."""
    import os

    home = env.get("KERAS_HOME")
    base = os.path.expanduser("~")
    if not home:
        home = os.path.join(base if os.access(base, os.W_OK) else "/tmp", ".keras")
    path = os.path.join(home, "keras.json")
    if shown and base != os.sep and path.startswith(base + os.sep):
        return "~" + path[len(base):]
    return path


def configured_keras_backend(env: Mapping[str, str]) -> str | None:
    """The backend keras.json names (see `keras_json`), or None."""
    import json

    try:
        with open(keras_json(env)) as handle:
            return json.load(handle).get("backend") or None
    except (OSError, ValueError, AttributeError):
        return None


def default_keras_to_jax() -> str | None:
    """Sets `KERAS_BACKEND=jax` where `keras_default_is_jax`; returns the line saying so."""
    import os

    configured = configured_keras_backend(os.environ)
    if not keras_default_is_jax("keras" in sys.modules, os.environ, configured,
                                importable_modules()):
        return None
    process.set_environment("KERAS_BACKEND", "jax", "TensorFlow, Keras's backend by default "
                            "or by keras.json, cannot be imported here and JAX can")
    if configured:
        return (f"tpu_magic: Keras will run on JAX (KERAS_BACKEND=jax): "
                f"{keras_json(os.environ, shown=True)}"
                " names tensorflow, which cannot be imported here (to make JAX Keras's "
                'default without tpu_magic too, set "backend": "jax" there)')
    return ("tpu_magic: Keras will run on JAX (KERAS_BACKEND=jax): TensorFlow, its default, "
            "cannot be imported here")


def later_sessions_note(backend: str, users_env: Mapping[str, str], configured: str | None,
                        importable: Collection[str], path: str) -> str | None:
    """What a later session's `import keras` before `%tpu_connect` would start Keras on, where
    that differs from `backend` (the one this connection runs): keras.json (at `path`) names
    another backend that can be imported there, and `KERAS_BACKEND` (`users_env`: as the user
    set it, not tpu_magic) does not override it. None where nothing differs, or where
    `%load_ext tpu_magic` already puts it right (`keras_default_is_jax`)."""
    wanted = KERAS_NAME[backend]
    if users_env.get("KERAS_BACKEND", "").strip() or configured is None or \
            configured == wanted or configured not in importable:
        return None
    return (f"{path} names {configured}, so a later session that imports keras before "
            f"%tpu_connect starts Keras on {configured}; to make {wanted} its default, set "
            f'"backend": "{wanted}" there (or KERAS_BACKEND={wanted})')


def select(choice: BackendChoice) -> None:
    """Sets `KERAS_BACKEND` for a keras not imported yet (an imported one already agrees)."""
    if imported_keras_backend() is None:
        process.set_environment("KERAS_BACKEND", KERAS_NAME[choice.backend],
                                "Keras reads its backend once, when first imported")


# Each backend's module holding its `BACKEND` (named here, not built from the name: the
# architecture test reads these strings as imports).
_MODULES = {"tf": "tpu_magic.backends.tf.backend", "jax": "tpu_magic.backends.jax.backend"}


def get(name: str) -> Backend:
    """The backend object for "tf" or "jax" (its module is imported here, its framework not)."""
    return importlib.import_module(_MODULES[name]).BACKEND


def active() -> Backend:
    """The backend of the imported keras (importing keras if it is not yet)."""
    import keras

    return get(_FROM_KERAS[keras.backend.backend()])
