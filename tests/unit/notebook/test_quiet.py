"""TensorFlow 2.21 writes its load-time notes (the absl preamble, the oneDNN line) to the
process's stderr whatever TF_CPP_MIN_LOG_LEVEL says; a connect drops them and keeps the rest."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tpu_magic.notebook.quiet import load_notes_dropped

PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
ONEDNN = (b"I0000 00:00:1795528254.390807   30505 port.cc:153] oneDNN custom operations are on. "
          b"You may see slightly different numerical results\n")


def test_load_notes_are_dropped_and_every_other_line_kept_in_order():
    warning = b"W1123 20:01:02.123456  1234 some_file.cc:12] a real warning\n"
    text = PREAMBLE + ONEDNN + b"my own line, I0000 inside\n" + warning + b"E error\n"
    assert load_notes_dropped(text) == b"my own line, I0000 inside\n" + warning + b"E error\n"
    assert load_notes_dropped(b"") == b""


def test_a_connect_window_drops_native_notes_and_gives_the_rest_back():
    # A child process, so the test's own stderr descriptor is not redirected under pytest.
    code = textwrap.dedent(f"""
        import os
        from tpu_magic.notebook.quiet import native_load_notes_dropped
        with native_load_notes_dropped():
            os.write(2, {PREAMBLE!r} + {ONEDNN!r} + b"kept while loading\\n")
        os.write(2, b"after\\n")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert done.returncode == 0, done.stderr
    assert done.stderr == b"kept while loading\nafter\n"


def test_a_training_cell_drops_the_notes_of_a_tensorflow_it_loads_and_only_then():
    # issue 34: on Kaggle's image (JAX beside tensorflow-cpu) `import keras_hub` in a JAX
    # training cell loads TensorFlow, whose notes reached the cell
    code = textwrap.dedent(f"""
        import os, sys, types
        from tpu_magic.notebook.quiet import tensorflow_load_notes_dropped
        with tensorflow_load_notes_dropped():  # not loaded yet: the cell may load it
            os.write(2, {PREAMBLE!r} + {ONEDNN!r} + b"the cell's own\\n")
        sys.modules["tensorflow"] = types.ModuleType("tensorflow")
        with tensorflow_load_notes_dropped():  # loaded: stderr untouched
            os.write(2, b"I0000 00:00:1.0   1 later.cc:1] passes through\\n")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert done.returncode == 0, done.stderr
    assert done.stderr == b"the cell's own\nI0000 00:00:1.0   1 later.cc:1] passes through\n"


def test_grains_note_on_kerashubs_read_options_stays_out_of_every_cell_after_load_ext(caplog):
    # issue 34: a KerasHub task's predict in a plain cell printed grain's prefetch note
    import logging

    from IPython.core.interactiveshell import InteractiveShell

    def logged(message, *args):
        caplog.clear()
        logging.getLogger("absl").warning(message, *args)
        return caplog.text

    note = "prefetch_buffer_size=%s is smaller than num_threads=%s. This will limit ..."
    shell = InteractiveShell.instance()  # the unit suite's shell
    shell.run_line_magic("load_ext", "tpu_magic")
    assert "prefetch_buffer_size" not in logged(note, 8, 16)
    assert "a warning of its own" in logged("a warning of its own")
    shell.run_line_magic("unload_ext", "tpu_magic")
    try:
        assert "prefetch_buffer_size=8" in logged(note, 8, 16)
    finally:
        shell.run_line_magic("load_ext", "tpu_magic")


def test_where_tensorflow_cannot_be_imported_a_training_cell_holds_nothing_back():
    # Colab's TPU image: nothing can load TensorFlow, so the cell's native stderr (an XLA
    # warning, or an abort's last words) goes out as it is written
    code = textwrap.dedent(f"""
        import os, sys
        from tpu_magic.notebook.quiet import tensorflow_load_notes_dropped
        with tensorflow_load_notes_dropped():
            os.write(2, {ONEDNN!r})
            os._exit(3)  # the process dies inside the cell
    """)
    root = Path(__file__).resolve().parents[3]
    blocked = f"{root / 'tests' / 'without_tensorflow'}{os.pathsep}{root}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": blocked})
    assert done.returncode == 3 and done.stderr == ONEDNN
