"""The IPython face of tpu_magic: parse the line, call the logic, render the result.

Domain errors (`TpuMagicError`) become a plain `UsageError` here and nowhere else,
so IPython prints the message without a traceback.
"""

from __future__ import annotations

import functools

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Float
from traitlets.config import Configurable

from tpu_magic.errors import TpuMagicError


def usage_errors(method):
    """Turns the logic's domain errors into `UsageError` (message only, no traceback)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except TpuMagicError as exc:
            raise UsageError(str(exc)) from None

    return wrapper


@magics_class
class TpuMagics(Magics, Configurable):
    """`%tpu_connect`, `%%tpu_train`, `%tpu_sync`."""

    timeout = Float(30.0, help="Default seconds a TPU node may take to answer.").tag(config=True)

    def __init__(self, shell):
        Configurable.__init__(self, config=shell.config)
        Magics.__init__(self, shell=shell)

    @magic_arguments()
    @argument("target", nargs="?", default="auto",
              help="auto (default), local (TPU VM), grpc://HOST:PORT, a TPU name, gpu or cpu")
    @argument("--simulate", type=int, metavar="N",
              help="split the CPU into N logical devices and replicate over them")
    @argument("--timeout", type=float, metavar="SECONDS",
              help="seconds a TPU node may take to answer (default: TpuMagics.timeout, 30)")
    @argument("--check", action="store_true",
              help="device check: devices, memory, versions, measured matmul TFLOP/s")
    @argument("--no-panel", action="store_true", help="text output only, no widget panel")
    @line_magic
    @usage_errors
    def tpu_connect(self, line=""):
        """Connect to the accelerator: TPU, GPU, CPU, or a simulated N-core TPU."""
        from dataclasses import replace

        from tpu_magic.check import run_check
        from tpu_magic.connect import connect
        from tpu_magic.quiet import quiet_native_logs, tensorflow_info_silenced
        from tpu_magic.session import session

        args = parse_argstring(self.tpu_connect, line)
        quiet_native_logs()
        with tensorflow_info_silenced():
            result = connect(
                args.target, simulate=args.simulate,
                timeout=self.timeout if args.timeout is None else args.timeout,
            )
        if args.check:
            result = replace(result, check=run_check(session()))
        return result

    @magic_arguments()
    @argument("--batch-size", type=int, metavar="B",
              help="global batch for fit/evaluate/predict calls that name none")
    @argument("--epochs", type=int, metavar="N", help="epochs for fit calls that name none")
    @argument("--scale-lr", action="store_true",
              help="scale the learning rate linearly with the global batch (× replicas)")
    @argument("--steps-per-execution", type=int, metavar="K",
              help="run K steps per call into the device (the main speed knob on TPUs)")
    @argument("--no-progress", action="store_true", help="no progress bar")
    @cell_magic
    @usage_errors
    def tpu_train(self, line, cell):
        """Run the cell's Keras training on the connected accelerator."""
        from tpu_magic.connect import connect
        from tpu_magic.quiet import quiet_native_logs, tensorflow_info_silenced
        from tpu_magic.session import session

        args = parse_argstring(self.tpu_train, line)
        for flag, value in (("--epochs", args.epochs),
                            ("--steps-per-execution", args.steps_per_execution)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} {value} must be 1 or more")
        quiet_native_logs()
        with tensorflow_info_silenced():
            if session() is None:
                print(connect("auto", timeout=self.timeout).summary())
            from tpu_magic.train import TrainingCell, TrainOptions

            options = TrainOptions(batch_size=args.batch_size, epochs=args.epochs,
                                   scale_lr=args.scale_lr,
                                   steps_per_execution=args.steps_per_execution,
                                   progress=not args.no_progress)
            training = TrainingCell(session(), options, self.shell.user_ns, bar=_progress_bar())
            code = self.shell.transform_cell(cell)
            # `ex` lets the cell's own exceptions reach the user unchanged (run_cell swallows them).
            return training.run(lambda: self.shell.ex(code), cell)


def _progress_bar():
    """tqdm's notebook widget bar where widgets can show, else its text bar."""
    from tqdm.auto import tqdm

    return tqdm


def register(ipython) -> None:
    ipython.register_magics(TpuMagics)


def unregister(ipython) -> None:
    manager = ipython.magics_manager
    for kind, names in (("line", ("tpu_connect", "tpu_sync")), ("cell", ("tpu_train",))):
        for name in names:
            manager.magics[kind].pop(name, None)
    manager.registry.pop("TpuMagics", None)
