"""A rehearsal never hangs: on simulated CPU devices XLA runs each device's part of a program,
and launches the programs, on threads of one pool; `%tpu_connect --simulate N` sizes it so
that a host dispatching steps ahead of the devices can never leave a device's part of a
collective without a thread (`backends/jax/connect.py`, docs/limits.md).

What once hung runs in a process of its own (tests/support/rehearsal_run.py), bounded: a
hang fails the test instead of stalling the suite, with every thread's stack.
"""

import os
import subprocess
import sys
from pathlib import Path

from support.jax_process import blocked_env

RUN = Path(__file__).parent.parent / "support" / "rehearsal_run.py"
ROUNDS = 20
SECONDS = 150  # the run's own limit (about 55 s on the 2-core machine); then its stacks


def test_steps_dispatched_ahead_and_the_cells_that_hung_run_20_times_in_a_row():
    # before the pools were sized, each part hung on the 2-core machine: the steps from two
    # threads in 3 runs of 3, the cells within 11 rounds in 5 runs of 5 (docs/limits.md)
    run = subprocess.run([sys.executable, str(RUN), str(ROUNDS), str(SECONDS)],
                         env=blocked_env(), capture_output=True, text=True,
                         timeout=SECONDS + 60)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-12000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("dispatched ahead: ") for line in lines), run.stdout
    assert [line.split(":")[0] for line in lines if line.startswith("round ")] == \
        [f"round {index}" for index in range(ROUNDS)], run.stdout


def test_this_process_started_jax_with_pools_that_fit_its_devices(ip):
    from tpu_magic.backends.jax.connect import host_pool_size, schedulable_cpus

    assert ip.connected.replicas == 8
    assert host_pool_size(os.environ, 8, schedulable_cpus()) is None


JAX_FIRST = """
import jax
jax.devices()  # JAX starts: its pools sized from the cores
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
ip.run_line_magic("load_ext", "tpu_magic")
try:
    ip.run_line_magic("tpu_connect", "--simulate 8 --no-panel")
    print("connected")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_jax_started_with_pools_too_small_for_the_devices_is_refused_with_the_fix():
    from tpu_magic.backends.jax.connect import host_pool_size, schedulable_cpus

    env = blocked_env(XLA_FLAGS="--xla_force_host_platform_device_count=8",
                      JAX_PLATFORMS="cpu")
    for name in ("PJRT_NPROC", "NPROC"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", JAX_FIRST], env=env, capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).parent.parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    needed = host_pool_size({}, 8, schedulable_cpus())
    if needed is None:  # a machine with cores enough: XLA's own pools fit
        assert "connected" in run.stdout, run.stdout
        return
    said = run.stdout.strip().splitlines()[-1]
    assert said.startswith("UsageError --simulate 8 needs XLA:CPU's thread pools of "
                           f"{needed} threads, but JAX already started with fewer"), said
    assert f"set `%env PJRT_NPROC={needed}` before JAX starts" in said, said
