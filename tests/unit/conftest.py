"""The unit suite: tpu_magic's pure modules, in seconds, without TensorFlow, Keras or JAX.

Run it on its own with `python -m pytest tests/unit` (tests/conftest.py starts no
TensorFlow for it). The main suite runs it in a subprocess with TensorFlow blocked
(tests/test_unit.py); this conftest fails the run if anything heavy was imported.
"""

import sys

HEAVY = ("tensorflow", "keras", "jax", "ipywidgets")


def pytest_sessionfinish(session, exitstatus):
    imported = [name for name in HEAVY if name in sys.modules]
    if imported and exitstatus == 0:
        print(f"\nunit suite imported {', '.join(imported)}: it must stay pure", file=sys.stderr)
        session.exitstatus = 1
