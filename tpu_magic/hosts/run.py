"""`%%tpu_train` and `%tpu_sync` on several hosts, from the notebook.

The cell goes to every engine with the values it names (NumPy arrays, functions, classes;
modules as imports), and runs there through the engine's own `%%tpu_train`: each host
feeds its own rows of every batch, with the same padding and masking as one host. The
notebook draws process 0's bar, watches the engines (a host whose process ends stops the
cell at once, naming it, and the others with it: they would wait for it in every step),
and gathers every host's outcome: process 0's report, or each distinct error once.
"""

from __future__ import annotations

import random
import sys
import time
import types
from typing import Any, Callable, Mapping, MutableMapping

from tpu_magic.core import process
from tpu_magic.core.errors import HostsError, SyncError
from tpu_magic.hosts import engine
from tpu_magic.hosts.cluster import Hosts
from tpu_magic.hosts.outcome import HostOutcome, failure_message
from tpu_magic.hosts.progress import MirroredBars, StallWatch
from tpu_magic.training.cell_code import names_in

POLL = 0.2  # seconds between looks at the engines
# what IPython puts in every shell's namespace itself (`InteractiveShell.init_user_ns`), where
# the notebook's shell does not say (`train`'s `shell_own`)
_SHELL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


def train(hosts: Hosts, line: str, cell: str, namespace: MutableMapping[str, Any],
          bar_class: Callable[..., Any] | None, progress: bool = True,
          shell_own: Mapping[str, Any] | None = None) -> Any:
    """Runs the cell on every host; returns process 0's `TrainReport`.

    `shell_own`: what the notebook's shell put in `namespace` itself (IPython's
    `user_ns_hidden`: its `open`, `exit`, `get_ipython`, `In`, ...): never sent, since every
    host's shell has its own (see `_shells_own`).

    Raises:
        HostsError: a host's process ended, values could not be sent, or the cell failed
            on a host (each distinct error once, with its hosts and the cell's line).
    """
    ids = [e.engine_id for e in hosts.engines]
    view = hosts.client[ids]
    _send(view, hosts, names_in(cell), namespace, shell_own)
    result = view.apply_async(engine.run_cell, line, cell, _draw_seed())
    bars = MirroredBars(bar_class if progress else None)
    watch = StallWatch(len(ids), hosts.timeout, time.monotonic())
    try:
        while not result.ready():
            result.wait(POLL)
            data = result.data
            bars.show(data[0] if data else None)
            dead = hosts.dead()
            if dead:
                said = _last_words(hosts, dead)  # read before the stop removes them
                _stop(hosts)
                raise HostsError(
                    ", ".join(e.label for e in dead) + " ended mid-cell (its process is gone). "
                    "The other hosts were stopped too: they wait for it in every step. "
                    "Connect again (`%tpu_connect ...`) and re-run the cell; with "
                    "--checkpoint DIR --resume it goes on from the last epoch saved." + said)
            stuck = watch.stuck(data or [], time.monotonic())
            if stuck:
                _stop(hosts)
                raise HostsError(_stuck_message(hosts, stuck))
        bars.show(result.data[0] if result.data else None)
    except KeyboardInterrupt:
        hosts.interrupt()  # each host stops at its next batch, as one host does
        result.wait(hosts.timeout)
        raise
    finally:
        bars.close()
    outcomes: list[HostOutcome] = result.get(timeout=hosts.timeout)
    try:  # the engines' last printed lines may come after their results
        result.wait_for_output(timeout=5)
    except Exception:  # noqa: BLE001 - output that never came is left out
        pass
    hosts.outputs = {e.label: (out or "") + (err or "") for e, out, err
                     in zip(hosts.engines, result.stdout, result.stderr)}
    message = failure_message(outcomes)
    if message:
        raise HostsError(message + ". Every host's printed output: "
                         "tpu_magic.hosts_outputs()")
    hosts.last_model = outcomes[0].model_name or hosts.last_model
    report = outcomes[0].report
    for note in report.notes:  # said on process 0 as they came; the report under counts them
        print(f"note: {note}")
    return report


def _draw_seed() -> int:
    """One seed a cell for every host, so an unseeded cell builds the same model on each
    (`engine.run_cell`); fresh each cell, as an unseeded notebook's draws are."""
    return random.SystemRandom().randrange(2**31)


def _last_words(hosts: Hosts, dead: list) -> str:
    """What the dead engines wrote last (why a process ended, where it said), as a few
    lines for the message; empty where nothing is known."""
    said = [(e, hosts.last_output(e)) for e in dead]
    return "".join(f"\n{e.label} wrote last:\n{text}" for e, text in said if text)


def _stop(hosts: Hosts) -> None:
    """Ends the connection with its hosts (a host stuck in a collective answers nothing)."""
    process.set_hosts(None)  # the engines go with it; the next connect starts anew
    hosts.stop()


def _stuck_message(hosts: Hosts, stuck: list[int]) -> str:
    named = ", ".join(hosts.engines[i].label for i in stuck)
    every = len(stuck) == len(hosts.engines)
    return (f"{named} made no progress for {hosts.timeout:g} s"
            + (" (every host: a hang in a collective)" if every else
               ", while the other hosts waited for it inside the step (an engine busy or hung "
               "outside it)")
            + ". The hosts were stopped, since none can go on without the others. Connect "
            "again (`%tpu_connect ...`) and re-run the cell (with --checkpoint DIR --resume it "
            "goes on from the last epoch saved); if it was only slow, connect with a larger "
            "--timeout")


def _send(view: Any, hosts: Hosts, names: set[str], namespace: MutableMapping[str, Any],
          shell_own: Mapping[str, Any] | None = None) -> None:
    """The values the cell names, to every host: modules as imports, the rest pickled; the
    shell's own names stay each host's own."""
    imports, values = [], {}
    for name in sorted(names):
        if name.startswith("_") or name not in namespace or \
                _shells_own(name, namespace[name], shell_own):
            continue
        value = namespace[name]
        if _framework_object(value):  # a model here is not the hosts' (they hold their own)
            continue
        if isinstance(value, types.ModuleType):
            imports.append(f"import {value.__name__} as {name}" if value.__name__ != name
                           else f"import {name}")
        else:
            values[name] = value
    try:
        if imports:
            view.execute("\n".join(imports), block=False).get(timeout=hosts.timeout)
        if values:
            view.push(values, block=False).get(timeout=hosts.timeout)
    except Exception as exc:  # noqa: BLE001 - pickling, or an engine that does not answer
        raise HostsError(f"could not send {', '.join(sorted(values)) or 'the imports'} to the "
                         f"hosts within {hosts.timeout:g} s ({str(exc).splitlines()[0]}); build "
                         "what cannot be pickled inside the cell") from None


def _shells_own(name: str, value: Any, shell_own: Mapping[str, Any] | None) -> bool:
    """Whether `name` holds what the notebook's shell itself put there (`shell_own`, else the
    names IPython always puts). Sent, IPython's `open` would fail on every host (pickled by
    value, its module's `io_open` missing there: "NameError: name 'io_open' is not defined");
    each host's shell has its own. A value the user bound to such a name is theirs, and is sent."""
    if shell_own is not None and name in shell_own:
        return shell_own[name] is value
    return name in _SHELL_NAMES


def _framework_object(value: Any) -> bool:
    """A Keras object of this process (a model, a layer, a variable, one of your subclasses):
    never sent, so a stale one here cannot replace what a host built under the same name."""
    keras = sys.modules.get("keras")
    return (type(value).__module__ or "").split(".")[0] == "keras" or (
        keras is not None and isinstance(value, keras.layers.Layer))


def cpu_copy(hosts: Hosts, name: str | None, as_name: str | None, save: str | None,
             namespace: Mapping[str, Any], adapters: bool = False) -> tuple[Any, Any]:
    """`%tpu_sync` on several hosts: process 0's model `name` (None: the one trained last),
    rebuilt on this kernel's CPU as a JAX model; `save` written here (`adapters`: what
    trains alone, as on one process). Returns (the copy, its `SyncReport`).

    Raises:
        SyncError: nothing trained on the hosts, or a bad copy name.
        HostsError: see `model_state`.
    """
    from tpu_magic.training.sync.target import copy_name

    name = name or hosts.last_model
    if name is None:
        raise SyncError("nothing trained on the hosts yet: run a %%tpu_train cell first, "
                        "or name the model: %tpu_sync MODEL")
    target = copy_name(name, as_name)
    state = model_state(hosts, name)
    if "keras" not in sys.modules:  # the copy is a JAX model on this kernel's CPU
        process.set_environment("KERAS_BACKEND", "jax", "the hosts' model is Keras on "
                                "JAX; its copy here is too")
        process.set_environment("JAX_PLATFORMS", "cpu", "the copy lives on the CPU",
                                keep_users=True)
    from tpu_magic.training.sync.cpu_copy import copy_from_state

    classes = {k: v for k, v in namespace.items() if isinstance(v, type)}
    return copy_from_state(state, name=name, as_name=target, custom_objects=classes,
                           save=save, adapters=adapters, source=f"{hosts.engines[0].label}, gathered from "
                                             f"{len(hosts.engines)} hosts")


def model_state(hosts: Hosts, name: str) -> dict:
    """Process 0's model `name`: its config and weights, whole (gathered from every host
    where they are sharded across them).

    Raises:
        HostsError: no such model on the hosts, or engine 0 did not answer.
    """
    first = hosts.engines[0]
    ids = [e.engine_id for e in hosts.engines]
    try:  # on every engine: a weight sharded across the hosts is gathered by all of them
        state = hosts.client[ids].apply_async(engine.model_state, name).get(
            timeout=hosts.timeout)[0]
    except Exception as exc:  # noqa: BLE001
        raise HostsError(f"{first.label} did not give model {name!r} within "
                         f"{hosts.timeout:g} s: {str(exc).splitlines()[0]}") from None
    if state.get("missing"):
        raise HostsError(f"the hosts have no Keras model named {name!r}: name one a "
                         "%%tpu_train cell built there")
    return state

