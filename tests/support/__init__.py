"""What the test suites share: the shell, the data, the models and cells, and the comparison
with plain Keras on one device.

- `support.shell`: the real IPython shell the tests drive.
- `support.data`: the data cells (sklearn's digits, as rows and as images).
- `support.cells`: the models and notebook cells (each defined once), and `train`.
- `support.same`: "the same as plain Keras on one device", the one comparison.
- `support.jax_process`: a JAX process of its own with TensorFlow blocked.
- `support/*_run.py`: the helper processes some tests start (a checkpoint killed while it
  is written, the compilation cache across processes, one device's compile counts, orbax
  killed mid-commit, a step's measured peak, tf.data on several hosts).

Found as `support` because tests/ is on sys.path: pytest puts it there for tests/conftest.py,
tests/jax_backend/conftest.py puts it there for its own process, and the `*_run.py` scripts
put it there themselves (the folder above their own). Nothing here imports TensorFlow or Keras at import time: the JAX
suite imports it before `%tpu_connect` has chosen Keras's backend.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent  # tests/, whichever folder a test file is in
RUNS = TESTS / "support"  # the helper processes (`*_run.py`)
