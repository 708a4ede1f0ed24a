"""The engines a notebook trains on, one a host: an ipyparallel cluster started here
(`%tpu_connect --simulate HxD`: H local engines of D CPU devices each) or one that is
running already (`%tpu_connect --hosts PROFILE`), each engine joined to one JAX run with
engine 0 as its coordinator. Everything that waits on an engine is bounded by `timeout`."""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from tpu_magic.core.errors import HostsError, MissingDependencyError

HOSTS_FIX = ("ipyparallel is not installed: `pip install \"tpu_magic[hosts]\"` (it brings "
             "ipyparallel; JAX runs each host's process), then restart the runtime.")


@dataclass(frozen=True)
class Engine:
    """One engine: its process index in the JAX run, ipyparallel id, host, pid, devices."""

    index: int
    engine_id: int
    host: str
    pid: int
    devices: int

    @property
    def label(self) -> str:
        return f"host {self.index} ({self.host})"


@dataclass
class Hosts:
    """What `%tpu_connect --hosts/--simulate HxD` made (the process's, in `core.process`).

    `last_model` and `outputs` are what the last cell left: the model `%tpu_sync` copies
    by default, and every host's printed output, by host label.
    """

    engines: tuple[Engine, ...]
    client: Any
    cluster: Any  # the local cluster started here (None: one that was running already)
    coordinator: str
    timeout: float
    last_model: str | None = None
    outputs: dict[str, str] = field(default_factory=dict)

    @property
    def simulated(self) -> bool:
        return self.cluster is not None

    @property
    def devices(self) -> int:
        return sum(e.devices for e in self.engines)

    @property
    def replicas(self) -> int:
        """Model replicas a global batch is split over: every device of every host (as
        `Connection.replicas`)."""
        return self.devices

    @property
    def target(self) -> str:
        """"hosts:HxD", as a `Connection`'s target names where it trains."""
        return f"hosts:{len(self.engines)}x{self.engines[0].devices}"

    def summary(self) -> str:
        per = self.engines[0].devices
        where = ("a rehearsal: local engines, CPU devices, gloo collectives"
                 if self.simulated else "ipyparallel engines, one a host")
        lines = [f"tpu_connect: {len(self.engines)} hosts × {per} devices = {self.devices} "
                 f"devices, Keras on JAX, DataParallel over all of them ({where})",
                 f"  coordinator: {self.coordinator} (engine of process 0)"]
        lines += [f"  {e.label}: engine {e.engine_id}, pid {e.pid}, {e.devices} devices"
                  for e in self.engines]
        lines.append("  %%tpu_train runs each cell on every host; %tpu_sync brings the model "
                     "back here as a CPU model")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.summary())

    def dead(self) -> list[Engine]:
        """Engines whose process ended (local ones: by pid; others: gone from the hub)."""
        if self.cluster is not None:
            return [e for e in self.engines if not _alive(e.pid)]
        ids = set(self.client.ids)
        return [e for e in self.engines if e.engine_id not in ids]

    def last_output(self, engine: Engine, lines: int = 12) -> str | None:
        """The last lines a local engine's process wrote (stdout and stderr: why it ended,
        where XLA or Python said so), read before the cluster's stop removes them; None
        where there is no such file (an engine that was running already)."""
        if self.cluster is None:
            return None
        for engine_set in list(getattr(self.cluster, "engines", {}).values()):
            for launcher in list(getattr(engine_set, "launchers", {}).values()):
                path = getattr(launcher, "output_file", None)
                if getattr(launcher, "pid", None) != engine.pid or not path:
                    continue
                try:
                    with open(path, errors="replace") as handle:
                        text = [line.rstrip() for line in handle if line.strip()]
                except OSError:
                    return None
                return "\n".join(text[-lines:]) or None
        return None

    def interrupt(self) -> None:
        """Ctrl-C to every engine (local ones by signal; others through ipyparallel)."""
        if self.cluster is not None:
            for engine in self.engines:
                _signal(engine.pid, signal.SIGINT)
        else:
            self.client.abort()

    def stop(self) -> None:
        """Ends a cluster started here (its engines first: they may wait in a collective on
        a dead peer, which no request reaches); leaves one that was running. Also run when
        the notebook's process exits (`start_local` registers it)."""
        atexit.unregister(self.stop)
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - a client of a dead hub
            pass
        if self.cluster is None:
            return
        for engine in self.engines:
            _signal(engine.pid, signal.SIGKILL)
        try:
            self.cluster.stop_cluster_sync()
        except Exception:  # noqa: BLE001 - already gone
            pass


def parse_layout(text: str) -> tuple[int, int]:
    """`--simulate HxD`: H hosts of D devices.

    Raises:
        HostsError: not HxD with both at least 1.
    """
    match = re.fullmatch(r"\s*(\d+)\s*[x×]\s*(\d+)\s*", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise HostsError(f"--simulate {text!r}: write N for one host of N devices, or HxD for H "
                         "hosts of D devices each, e.g. --simulate 2x4")
    return int(match.group(1)), int(match.group(2))


def start_local(hosts: int, devices: int, timeout: float) -> Hosts:
    """H local engines, joined into one JAX run of CPU devices with gloo collectives."""
    ipp = _ipyparallel()
    cluster = ipp.Cluster(n=hosts, log_level=40)
    try:
        client = cluster.start_and_connect_sync(activate=False)
        client.wait_for_engines(hosts, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - ipyparallel's TimeoutError and launch failures
        _stop_quietly(cluster)
        raise HostsError(f"--simulate {hosts}x{devices}: the {hosts} local engines did not all "
                         f"start within {timeout:g} s ({exc}); raise --timeout, or check "
                         "`ipcluster` works here") from None
    coordinator = f"127.0.0.1:{_free_port()}"
    started = _join(client, cluster, sorted(client.ids)[:hosts], coordinator, devices, timeout)
    # the engines end with this process: at its exit, before ipyparallel's own slower stop
    # (a kernel's runner kills it a few seconds into its shutdown), and, where it is killed
    # outright, by themselves (`engine.end_with_parent`)
    atexit.register(started.stop)
    return started


def attach(name: str, timeout: float) -> Hosts:
    """A running ipyparallel cluster (`PROFILE` or `PROFILE/CLUSTER_ID`), one engine a host."""
    ipp = _ipyparallel()
    profile, _, cluster_id = name.partition("/")
    try:
        client = ipp.Client(profile=profile or "default", cluster_id=cluster_id or None,
                            timeout=timeout)
        client.wait_for_engines(1, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - no such profile, no hub, no engine
        raise HostsError(f"--hosts {name}: no ipyparallel cluster answered within {timeout:g} s "
                         f"({exc}). Start one engine a host first (see the docs' guide 'More "
                         "than one host'), then connect again.") from None
    from tpu_magic.hosts import engine

    ids = sorted(client.ids)
    try:  # the coordinator listens on engine 0's host
        coordinator = client[ids[0]].apply_async(engine.coordinator_address).get(timeout=timeout)
    except Exception:  # noqa: BLE001
        client.close()
        raise HostsError(f"--hosts {name}: engine {ids[0]} did not answer within "
                         f"{timeout:g} s") from None
    return _join(client, None, ids, coordinator, None, timeout)


def _join(client: Any, cluster: Any, ids: list[int], coordinator: str, devices: int | None,
          timeout: float) -> Hosts:
    from tpu_magic.hosts import engine

    # engines started here end with this process, and end the controller it started
    here = os.getpid() if cluster is not None else None
    controller = getattr(getattr(cluster, "controller", None), "pid", None)
    pending = [client[i].apply_async(engine.join, index, len(ids), coordinator, devices,
                                     timeout, here, controller)
               for index, i in enumerate(ids)]
    deadline = time.monotonic() + timeout + 10
    joined, missing = [], []
    for index, (engine_id, result) in enumerate(zip(ids, pending)):
        try:
            info = result.get(timeout=max(deadline - time.monotonic(), 0.1))
            joined.append(Engine(index, engine_id, info["host"], info["pid"], info["devices"]))
        except Exception as exc:  # noqa: BLE001 - a timeout, or the engine's own error
            missing.append(f"engine {engine_id} (process {index}): {_first_line(exc)}")
    if missing:
        hosts = Hosts(tuple(joined), client, cluster, coordinator, timeout)
        hosts.stop()
        raise HostsError("these engines did not join the JAX run within "
                         f"{timeout:g} s: " + "; ".join(missing))
    return Hosts(tuple(joined), client, cluster, coordinator, timeout)


def _ipyparallel() -> Any:
    try:
        import ipyparallel
    except ImportError:
        raise MissingDependencyError(HOSTS_FIX) from None
    return ipyparallel


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except (ProcessLookupError, PermissionError):
        pass


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop_quietly(cluster: Any) -> None:
    try:
        cluster.stop_cluster_sync()
    except Exception:  # noqa: BLE001
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[-1] if "RemoteError" in type(exc).__name__ else text.splitlines()[0]
