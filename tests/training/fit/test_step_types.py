"""On a mesh of one JAX device (Colab's v5e-1, one GPU) a later fit runs the train step the
first compiled, with plain Keras's losses on the one device (`backends/jax/step_types.py`).
Each way runs in a process of its own (tests/support/one_device_run.py): this one's Keras is on
TensorFlow, and a process has one device split."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from support import TESTS
from support.jax_process import blocked_env, require_jax

HERE = TESTS


def _run(way: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{way}.json"
    env = blocked_env(TPU_MAGIC_COMPILE_CACHE=str(tmp_path / f"cache-{way}"))
    run = subprocess.run([sys.executable, str(HERE / "support" / "one_device_run.py"), str(out),
                          "--way", way], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_later_fit_on_one_device_compiles_nothing_and_matches_plain_keras(tmp_path):
    require_jax()
    magic, plain = _run("magic", tmp_path), _run("plain", tmp_path)
    assert magic["devices"] == plain["devices"] == 1 and not magic["tensorflow_imported"]
    # Keras under DataParallel on one device compiles its step twice in the first fit and
    # once more in the second (the magic without step_types: [14, 1, 0] programs here); plain
    # Keras with no distribution compiles it once. The magic's first fit runs its steps in
    # one compiled loop (`device_loop`) and measures one step first: at most two programs
    # more than plain Keras (the measured step, the copy of the state it runs on; the loop
    # takes the place of Keras's step), and none in a later fit.
    assert magic["compiles"][1:] == [0, 0], magic["compiles"]
    assert 0 < magic["compiles"][0] <= plain["compiles"][0] + 2, \
        (magic["compiles"], plain["compiles"])
    np.testing.assert_allclose(magic["losses"], plain["losses"], rtol=1e-5)
    print(f"\nprograms compiled by fit: magic {magic['compiles']}, plain Keras {plain['compiles']}")
