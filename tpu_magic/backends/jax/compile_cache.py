"""JAX's persistent compilation cache: compile a cell's programs once, not after every restart.

A TPU notebook compiles its train step again in every new process: after a runtime
restart, after a crash, on the next day. JAX can keep the compiled programs on disk
(`jax_compilation_cache_dir`) and load them instead of compiling. `%tpu_connect` turns it
on, on the JAX backend, in a directory that outlives the process where one exists:

- a mounted Google Drive (`/content/drive/MyDrive`): survives a restart and a new VM;
- Kaggle's `/kaggle/working`: survives a restart of the notebook's session;
- otherwise `~/.cache/tpu_magic/jax` (`$XDG_CACHE_HOME`): survives a kernel restart.

Inside it one folder per jax/jaxlib/libtpu version set, so an upgrade starts a new cache
instead of reading programs another version compiled. `TPU_MAGIC_COMPILE_CACHE=DIR` or
`%tpu_connect --compile-cache DIR` puts it elsewhere; `off` turns it off. A directory the
user gave JAX already (`JAX_COMPILATION_CACHE_DIR` or `jax.config`) is kept as it is.

`counts()` reads JAX's own monitoring events: how many programs came from the cache, how
many were compiled, and the seconds spent in XLA's compile (or in reading the cache).
Nothing here imports JAX until `enable`.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Mapping

DRIVE = "/content/drive/MyDrive"
KAGGLE_WORKING = "/kaggle/working"
OFF = ("off", "none", "0", "false", "no")
# Cache every program: on a CPU rehearsal each compiles in well under JAX's default
# threshold of 1 s, and a train step's few small helper programs cost little disk.
MIN_COMPILE_SECONDS = 0.0


@dataclass(frozen=True)
class CacheChoice:
    """Where the compilation cache goes (`directory` None: off) and why."""

    directory: str | None
    reason: str

    def note(self, home: str | None = None) -> str:
        """One line for the connect summary; a directory in the `home` folder (default the
        user's) is written from ~, as a notebook shared or published should show it."""
        if self.directory is None:
            return f"JAX's compilation cache is off ({self.reason})"
        home = os.path.expanduser("~") if home is None else home
        shown = self.directory
        if home not in ("", os.sep) and shown.startswith(home.rstrip(os.sep) + os.sep):
            shown = "~" + shown[len(home.rstrip(os.sep)):]
        return f"compiled programs are cached in {shown} ({self.reason})"


def version_key(versions: Mapping[str, str]) -> str:
    """One folder name per jax/jaxlib/libtpu version set, e.g. `jax-0.7.2_jaxlib-0.7.2_libtpu-none`."""
    parts = [f"{name}-{versions.get(name, 'none')}" for name in ("jax", "jaxlib", "libtpu")]
    return re.sub(r"[^A-Za-z0-9._-]", "_", "_".join(parts))


def choose_directory(setting: str | None, env: Mapping[str, str], versions: Mapping[str, str],
                     configured: str | None = None, is_dir=os.path.isdir) -> CacheChoice:
    """Where JAX's compilation cache goes.

    Args:
        setting: `--compile-cache` (a directory or "off"), or None.
        env: the environment (`TPU_MAGIC_COMPILE_CACHE`, `JAX_COMPILATION_CACHE_DIR`, `HOME`).
        versions: installed package versions, for the version folder.
        configured: the directory JAX is already configured with, if any.
        is_dir: tells whether a directory exists (tests give a fake one).
    """
    setting = setting if setting is not None else env.get("TPU_MAGIC_COMPILE_CACHE")
    if setting is not None and setting.strip().lower() in OFF:
        return CacheChoice(None, "turned off by --compile-cache off or TPU_MAGIC_COMPILE_CACHE")
    if setting:
        return CacheChoice(os.path.join(os.path.expanduser(setting), version_key(versions)),
                           "the directory you chose")
    if configured or env.get("JAX_COMPILATION_CACHE_DIR"):
        return CacheChoice(configured or env["JAX_COMPILATION_CACHE_DIR"],
                           "JAX was already given this directory, so it is kept")
    if is_dir(DRIVE):
        base, reason = (os.path.join(DRIVE, "tpu_magic_cache"),
                        "on your mounted Drive, so it survives a runtime restart and a new VM")
    elif is_dir(KAGGLE_WORKING):
        base, reason = (os.path.join(KAGGLE_WORKING, "tpu_magic_cache"),
                        "in /kaggle/working, so it survives a restart of the notebook")
    else:
        home = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"),
                                                         ".cache")
        base, reason = (os.path.join(home, "tpu_magic", "jax"),
                        "it survives a kernel restart on this machine")
    return CacheChoice(os.path.join(base, version_key(versions)), reason)


@dataclass(frozen=True)
class CompileCounts:
    """JAX's compilations so far in this process (or between two `counts()`).

    Attributes:
        hits: programs loaded from the persistent cache.
        misses: programs compiled (and written to the cache).
        seconds: time in XLA's backend compile, loading from the cache included.
    """

    hits: int = 0
    misses: int = 0
    seconds: float = 0.0

    def __sub__(self, earlier: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.hits - earlier.hits, self.misses - earlier.misses,
                             self.seconds - earlier.seconds)

    def describe(self) -> str | None:
        """e.g. "XLA compile 0.05 s, from cache (13 programs)"; None when nothing compiled."""
        if not self.hits and not self.misses:
            return None
        text = f"XLA compile {self.seconds:.2f} s"
        if not self.misses:
            return f"{text}, from cache ({self.hits} program{'s' * (self.hits != 1)})"
        text += f", {self.misses} program{'s' * (self.misses != 1)} compiled and cached"
        return text + (f", {self.hits} from cache" if self.hits else "")


_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"
_COMPILE = "/jax/core/compile/backend_compile_duration"


class _Counter:
    """Listens to JAX's monitoring events once per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits = self.misses = 0
        self.seconds = 0.0
        self.listening = False

    def listen(self, jax: Any) -> None:
        with self.lock:
            if self.listening:
                return
            self.listening = True
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **_: Any) -> None:
        if event in (_HIT, _MISS):
            with self.lock:
                if event == _HIT:
                    self.hits += 1
                else:
                    self.misses += 1

    def _duration(self, event: str, seconds: float, **_: Any) -> None:
        if event == _COMPILE:
            with self.lock:
                self.seconds += seconds


_counter = _Counter()


def counts() -> CompileCounts | None:
    """Compilations so far in this process; None where the cache was never turned on."""
    if not _counter.listening:
        return None
    with _counter.lock:
        return CompileCounts(_counter.hits, _counter.misses, _counter.seconds)


def enable(setting: str | None, env: Mapping[str, str], versions: Mapping[str, str]) -> CacheChoice:
    """Turns JAX's persistent compilation cache on (or leaves it off) and starts counting.

    Raises:
        OSError: the directory cannot be made (the caller turns it into a note).
    """
    import jax

    configured = jax.config.jax_compilation_cache_dir
    choice = choose_directory(setting, env, versions, configured)
    if choice.directory is None:
        if configured:
            jax.config.update("jax_compilation_cache_dir", None)
        return choice
    os.makedirs(choice.directory, exist_ok=True)
    if choice.directory != configured:
        jax.config.update("jax_compilation_cache_dir", choice.directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    _counter.listen(jax)
    _writes_whole()
    return choice


_whole_writes = threading.Lock()


def _writes_whole() -> None:
    """JAX's file cache writes an entry in place (`LRUCache.put`: `write_bytes`): a process
    ended while it writes (a kernel shut down or killed mid-compile, a program compiled on
    a thread of its own when the process exits) leaves a cut entry, which a later process
    reads back and crashes on (a segmentation fault in `get_executable_and_time`, seen).
    Here, once a process, an entry is written to a temporary file beside it and renamed
    into place: it is whole or absent."""
    from jax._src import lru_cache

    with _whole_writes:
        if getattr(lru_cache.LRUCache.put, "writes_whole", False):
            return
        own = lru_cache.LRUCache.put

        def put(self: Any, key: str, value: bytes) -> None:
            final = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
            part = self.path / f".{key}.{os.getpid()}.{threading.get_ident()}.part"
            if final.exists() or self.eviction_enabled or not str(final).startswith(os.sep):
                return own(self, key, value)  # there already, JAX's LRU, or not a local file
            part.write_bytes(value)
            try:
                os.replace(str(part), str(final))  # whole, or not there
            except OSError:
                part.unlink(missing_ok=True)
                raise
            return None

        put.writes_whole = True  # type: ignore[attr-defined]
        lru_cache.LRUCache.put = put
