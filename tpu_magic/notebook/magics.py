"""The IPython face of tpu_magic: parse the line, call the logic, render the result.

Domain errors (`TpuMagicError`) become a plain `UsageError` here and nowhere else,
so IPython prints the message without a traceback.
"""

from __future__ import annotations

import functools
import os

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Float, Unicode
from traitlets.config import Configurable

from tpu_magic.core.errors import TpuMagicError


def usage_errors(method):
    """Turns the logic's domain errors into `UsageError` (message only, no traceback)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True  # noqa: F841 - a cell's own error shows the cell, not us
        try:
            return method(*args, **kwargs)
        except TpuMagicError as exc:
            raise UsageError(str(exc)) from None

    return wrapper


@magics_class
class TpuMagics(Magics, Configurable):
    """`%tpu_connect`, `%%tpu_train`, `%tpu_sync`."""

    timeout = Float(30.0, help="Default seconds a TPU node may take to answer.").tag(config=True)
    precision = Unicode("", help="Default --precision of %%tpu_train: auto, bf16, mixed_bf16, "
                                 "fp16 or fp32 ('': the Keras dtype policy as it is)."
                        ).tag(config=True)
    shard = Unicode("", help="Default --shard of %%tpu_train: data, model or auto ('': data)."
                    ).tag(config=True)
    verify = Unicode("on", help="Default --verify of %%tpu_train: on (the first step of a "
                                "cell's first fit compared with the same step on one device) "
                                "or off.").tag(config=True)

    def __init__(self, shell):
        Configurable.__init__(self, config=shell.config)
        Magics.__init__(self, shell=shell)

    @property
    def workspace(self):
        """This notebook's `Workspace`: the panel, the model trained last, the running job."""
        from tpu_magic.notebook.workspace import workspace_of

        return workspace_of(self.shell)

    @magic_arguments()
    @argument("target", nargs="?", default="auto",
              help="auto (default), local (TPU VM), grpc://HOST:PORT, a TPU name, gpu or cpu")
    @argument("--simulate", metavar="N|HxD",
              help="split the CPU into N logical devices and replicate over them; HxD: H "
                   "local hosts (ipyparallel engines) of D devices each, one JAX run")
    @argument("--hosts", metavar="PROFILE[/CLUSTER_ID]",
              help="several hosts: a running ipyparallel cluster, one engine a host")
    @argument("--timeout", type=float, metavar="SECONDS",
              help="seconds a TPU node may take to answer (default: TpuMagics.timeout, 30); "
                   "with hosts, seconds the engines may take to join and a cell may go without "
                   "progress on any host (default 120)")
    @argument("--check", action="store_true",
              help="device check: devices, memory, versions, measured matmul TFLOP/s")
    @argument("--backend", default="auto", metavar="tf|jax|auto",
              help="the Keras backend (default auto: an imported keras's, KERAS_BACKEND, jax on a "
                   "TPU VM without tensorflow-tpu, else tf); set before keras is imported")
    @argument("--compile-cache", metavar="DIR|off",
              help="JAX backend: keep compiled programs in DIR (default: a mounted Drive, "
                   "/kaggle/working or ~/.cache/tpu_magic/jax; TPU_MAGIC_COMPILE_CACHE), or off")
    @argument("--no-panel", action="store_true", help="text output only, no widget panel")
    @line_magic
    @usage_errors
    def tpu_connect(self, line=""):
        """Connect to the accelerator: TPU, GPU, CPU, or a simulated N-core TPU.

        Examples::

            %tpu_connect                  # auto: a TPU VM, else a GPU, else the CPU; says why
            %tpu_connect --simulate 8     # rehearse an 8-core TPU on the CPU
            %tpu_connect local --check    # a TPU VM, with the device check
            %tpu_connect grpc://10.0.0.2:8470 --timeout 20   # a TPU node, bounded
            %tpu_connect --simulate 2x4   # rehearse 2 hosts of 4 devices (ipyparallel engines)
            %tpu_connect --hosts slice    # a running ipyparallel cluster, one engine a host
        """
        from tpu_magic.notebook.workspace import require_process_idle

        args = _parse(self.tpu_connect, line)
        require_process_idle("%tpu_connect")  # one connection per process: every shell's jobs
        simulate, layout = _simulate(args.simulate)
        _end_hosts()  # a new connection replaces the hosts a notebook drove
        if args.hosts or layout:
            return self._connect_hosts(args.hosts, layout, args.timeout)
        result = self._connect(args, simulate)
        if not args.no_panel:
            self._show_panel(result)
        return result

    def _connect(self, args, simulate: int | None):
        """One host: the connection (`connecting.connect`), the workspace told, and the
        device check where `--check` asks; framework chatter kept out of the cell."""
        from dataclasses import replace

        from tpu_magic.connecting.check import run_check
        from tpu_magic.connecting.connect import connect
        from tpu_magic.core.session import session
        from tpu_magic.notebook.quiet import (native_load_notes_dropped, quiet_native_logs,
                                              tensorflow_info_silenced)

        quiet_native_logs()
        with tensorflow_info_silenced(), native_load_notes_dropped():
            result = connect(args.target, simulate=simulate, backend=args.backend,
                             compile_cache=args.compile_cache,
                             timeout=self.timeout if args.timeout is None else args.timeout)
        self.workspace.connected(session())
        if args.check:
            result = replace(result, check=run_check(session()))
            self.workspace.check = result.check  # its measured peak for the reports' utilization
        return result

    def _connect_hosts(self, name: str | None, layout: tuple[int, int] | None,
                       timeout: float | None):
        """`--hosts`/`--simulate HxD`: the engines, joined into one JAX run."""
        from tpu_magic.core import process
        from tpu_magic.hosts import cluster

        # Starting engines and their runtimes takes longer than a TPU node's answer.
        bound = timeout if timeout is not None else max(self.timeout, HOSTS_TIMEOUT)
        hosts = (cluster.start_local(*layout, bound) if layout
                 else cluster.attach(name, bound))
        process.set_hosts(hosts)
        return hosts

    def _show_panel(self, result) -> None:
        """The panel under the cell, or a one-line warning where widgets cannot show."""
        from tpu_magic.notebook.panel import Panel, widgets_unavailable
        from tpu_magic.core.session import session

        why = widgets_unavailable()
        if why:
            print(f"warning: {why} Copy the trained model with %tpu_sync.")
            return
        current, workspace = session(), self.workspace
        if workspace.panel is None:
            workspace.panel = Panel(
                check=lambda address: self._check_address(address),
                sync=lambda: self._sync_last(None),
                save=lambda path: self._sync_last(path),
                train=self._train_from_panel,
                address="" if result.simulated else result.target,
                device=_device_line(current),
                replicas=current.replicas,
                tpu_rules=current.tpu_rules,
            )
        if getattr(self.shell, "kernel", None) is not None:  # a frontend that can show widgets
            from IPython.display import display

            display(workspace.panel)

    def _check_address(self, address: str) -> str:
        from tpu_magic.connecting.connect import check_target

        return check_target(address, timeout=self.timeout)

    def _train_from_panel(self, batch: int, epochs: int, scale_lr: bool, on_done):
        """The panel's Train: the last %%tpu_train fit again, in a background thread."""
        from tpu_magic.notebook.job import start_training
        from tpu_magic.core.session import session

        workspace = self.workspace
        return start_training(session(), workspace, self.shell.user_ns, batch_size=batch,
                              epochs=epochs, scale_lr=scale_lr, view=workspace.panel,
                              on_done=on_done)

    def _sync_last(self, path: str | None) -> str:
        """The panel's Sync / Save: `%tpu_sync [--save PATH]` for the model trained last."""
        return self._sync(None, None, path, action="Save" if path else "Sync").summary()

    def _sync(self, model: str | None, as_name: str | None, save: str | None,
              action: str = "%tpu_sync", adapters: bool = False):
        """`%tpu_sync` and the panel's buttons: a CPU copy, bound in the user's namespace
        here (the one place it is bound)."""
        from tpu_magic.core import process
        from tpu_magic.notebook.quiet import quiet_native_logs, tensorflow_info_silenced

        workspace = self.workspace
        workspace.require_idle(action)  # a job would change the weights mid-copy
        if process.hosts() is not None:
            from tpu_magic.hosts.run import cpu_copy

            new, report = cpu_copy(process.hosts(), model, as_name, save, self.shell.user_ns,
                                   adapters=adapters)
        else:
            from tpu_magic.core.session import session
            from tpu_magic.training.sync.target import chosen_copy

            # What can be refused is refused before TensorFlow or Keras is imported.
            chosen_copy(self.shell.user_ns, model, as_name, workspace.last_model,
                        workspace.last_model_name)
            quiet_native_logs()
            current = session()
            with tensorflow_info_silenced():
                from tpu_magic.training.sync.cpu_copy import sync_copy

                new, report = sync_copy(
                    self.shell.user_ns, model, as_name, save, last_model=workspace.last_model,
                    last_name=workspace.last_model_name,
                    backend=current.backend if current is not None else None,
                    adapters=adapters)
        self.shell.user_ns[report.as_name] = new
        return report

    @magic_arguments()
    @argument("--batch-size", type=int, metavar="B",
              help="global batch for fit/evaluate/predict calls that name none")
    @argument("--epochs", type=int, metavar="N", help="epochs for fit calls that name none")
    @argument("--scale-lr", action="store_true",
              help="scale the learning rate linearly with the global batch (× replicas)")
    @argument("--steps-per-execution", metavar="K|auto",
              help="run K steps per execution, one dispatch to the device (on JAX a "
                   "compiled loop over K batches); callbacks' batch hooks and the bar once an "
                   "execution. auto (default): the model's own, else chosen from a measured "
                   "step, so the host takes under 5 percent of the time (on TensorFlow not "
                   "under several mirrored replicas)")
    @argument("--checkpoint", metavar="DIR",
              help="after every epoch, write weights, optimizer state and epoch to DIR")
    @argument("--keep", type=int, metavar="K",
              help="with --checkpoint: how many of the newest checkpoints to keep (default 2)")
    @argument("--resume", action="store_true",
              help="with --checkpoint: continue from the newest checkpoint in DIR")
    @argument("--precision", metavar="auto|bf16|mixed_bf16|fp16|fp32",
              help="dtype policy for models built in the cell (auto: mixed bfloat16 on TPUs "
                   "and bf16 GPUs, mixed float16 on older GPUs, float32 on CPUs; default "
                   "TpuMagics.precision, else Keras's policy as it is)")
    @argument("--shard", metavar="data|model|auto",
              help="data: replicate the model, split the batch (default); model (JAX): also "
                   "split the model's large variables over the devices; auto (JAX): data where "
                   "the memory plan fits a device, else the fewest model columns that fit "
                   "(default TpuMagics.shard)")
    @argument("--mesh", metavar="BxM",
              help="with --shard model: B data rows by M model columns (default 1x<devices>)")
    @argument("--plan-for", metavar="CHIP-N",
              help="plan one device's memory before the first step against a chip you may "
                   "not have, e.g. v5e-8 (on as many simulated devices)")
    @argument("--memory", metavar="auto|off",
              help="auto (JAX, default): a step that does not fit a device runs as "
                   "micro-batches and/or with its repeated blocks rematerialized, chosen from "
                   "the compiler's plan, with the full batch's numbers; off: it is refused, "
                   "with what would fit")
    @argument("--microbatches", type=int, metavar="N",
              help="run each batch as N micro-batches inside the step (gradients added up, "
                   "one update; JAX)")
    @argument("--remat", metavar="on|off|auto",
              help="recompute the model's repeated blocks in the backward pass instead of "
                   "keeping their activations (JAX; auto: where the plan needs it)")
    @argument("--verify", metavar="on|off",
              help="on: compare the first step of the cell's first fit with the same step on "
                   "one device, and warn where they differ; off: skip it (default "
                   "TpuMagics.verify, on)")
    @argument("--no-progress", action="store_true", help="no progress bar")
    @cell_magic
    @usage_errors
    def tpu_train(self, line, cell):
        """Run the cell's Keras training on the connected accelerator.

        `%%tpu_train` goes on the first line of the cell (two %); the cell below it runs
        with the strategy in force, and its fit/evaluate/predict calls go through tpu_magic.

        Examples::

            %%tpu_train --epochs 5 --batch-size 1024
            model = build_model()
            model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
            model.fit(x_train, y_train, validation_split=0.1)

            %%tpu_train --checkpoint /content/drive/MyDrive/ckpt --resume
            model.fit(x_train, y_train, epochs=50)
        """
        from tpu_magic.core import process

        __tracebackhide__ = True  # noqa: F841
        from tpu_magic.training.request import as_line

        flags = self._flags(line)
        self.workspace.require_idle("%%tpu_train")
        if process.hosts() is not None:  # every host runs the cell (multi-controller JAX)
            return self._train_on_hosts(process.hosts(), as_line(flags), cell,
                                        flags["no_progress"])
        report = self._train(flags, cell)
        self._leave_a_picture(report)
        return report

    def _flags(self, line: str) -> dict:
        """The cell's flags, this magic's defaults where one was not typed: what the request
        is read from here, and on every host (`request.flag_values`, `as_line`)."""
        from tpu_magic.training.request import flag_values

        return flag_values(vars(_parse(self.tpu_train, line)), precision=self.precision,
                           shard=self.shard, verify=self.verify)

    def _train(self, flags: dict, cell: str):
        """The cell's code run by its `TrainingCell`; the workspace records the cell even
        where it failed. Framework chatter is kept out of the cell."""
        from tpu_magic.notebook.cell_run import cell_work
        from tpu_magic.notebook.quiet import (quiet_native_logs, tensorflow_info_silenced,
                                              tensorflow_load_notes_dropped)

        __tracebackhide__ = True  # noqa: F841
        quiet_native_logs()
        with tensorflow_info_silenced():
            training = self._training_cell(flags)
            try:
                with cell_work(self.shell, cell) as work, tensorflow_load_notes_dropped():
                    return training.run(work)
            finally:
                self.workspace.cell_ended(training)

    def _training_cell(self, flags: dict):
        """The cell's `TrainingCell`: connected (auto, said, where nothing is), its request
        read from `flags` (`request.flag_values`: this magic's defaults in place)."""
        from tpu_magic.training.cell import TrainingCell
        from tpu_magic.training.request import read_request

        workspace, connection = self.workspace, self._connected()
        check = workspace.check
        read = {name: value for name, value in flags.items() if name != "no_progress"}
        request = read_request(
            connection, **read,
            # an engine always draws: the notebook watches its bars
            progress=not flags["no_progress"] or _on_an_engine(),
            measured_tflops=check.measured_tflops if check is not None else None)
        return TrainingCell(connection, request, self.shell.user_ns, bar=_progress_bar(),
                            view=workspace.panel, agreed=frozenset(workspace.agreed),
                            inputs_measured=dict(workspace.inputs_measured),
                            flops_counted=dict(workspace.flops_counted),
                            watch=_call_watch())

    def _connected(self):
        """The session's connection; where there is none, `%tpu_connect auto`, said."""
        from tpu_magic.connecting.connect import connect
        from tpu_magic.core.session import session
        from tpu_magic.notebook.quiet import native_load_notes_dropped

        if session() is None:
            with native_load_notes_dropped():
                connected = connect("auto", timeout=self.timeout)
            print(connected.summary())
            self.workspace.connected(session())
        return session()

    def _train_on_hosts(self, hosts, line: str, cell: str, no_progress: bool):
        """`%%tpu_train` on several hosts: every engine runs the cell (`hosts.run`)."""
        from tpu_magic.hosts import run

        self.workspace.report = run.train(hosts, line, cell, self.shell.user_ns,
                                          _progress_bar(), progress=not no_progress,
                                          shell_own=self.shell.user_ns_hidden)
        return self.workspace.report

    @line_magic("tpu_train")
    def tpu_train_as_a_line(self, line=""):
        """%%tpu_train is a cell magic: see its help below."""
        raise UsageError("%%tpu_train is a cell magic: put `%%tpu_train [flags]` on the first "
                         "line of the cell (two %), with the training code below it. Its flags "
                         "and an example: %%tpu_train? (or %tpu_train?)")

    def _leave_a_picture(self, report) -> None:
        """A static loss chart in the cell's output when training ends (where a frontend
        shows it): the live bar and panel are widgets, which a saved or exported notebook
        shows as `VBox(children=…)`; this picture and the report's text stay."""
        history = getattr(report.history, "history", None) or {}
        series = {k: v for k, v in history.items() if k.endswith("loss") and v}
        if not series or getattr(self.shell, "kernel", None) is None:
            return
        from IPython.display import SVG, display

        from tpu_magic.notebook.lossplot import loss_svg

        picture = loss_svg(series)
        if picture:
            display(SVG(picture))

    @magic_arguments()
    @argument("model", nargs="?", help="the model to copy (default: the model trained last)")
    @argument("--as", dest="as_name", metavar="NAME",
              help="the CPU copy's name in the notebook (default: MODEL_cpu)")
    @argument("--save", metavar="PATH",
              help="also write the weights to PATH (.weights.h5, written atomically)")
    @argument("--adapters", action="store_true",
              help="with --save: write what trains alone, the LoRA adapters and no frozen "
                   "layer (PATH.adapters.h5, a few percent of the model; "
                   "tpu_magic.load_adapters(model, path) reads it)")
    @line_magic
    @usage_errors
    def tpu_sync(self, line=""):
        """Copy the trained model to a CPU model (any batch size) with the trained weights.

        Examples::

            %tpu_sync                               # model → model_cpu
            %tpu_sync cnn --as cnn_small --save drive/cnn   # also writes drive/cnn.weights.h5
            %tpu_sync lm --save lora --adapters     # LoRA adapters alone: lora.adapters.h5
        """
        args = _parse(self.tpu_sync, line)
        return self._sync(args.model, args.as_name, args.save, adapters=args.adapters)


# `%tpu_train?` (one %) finds the line magic: it shows the cell magic's whole help.
TpuMagics.tpu_train_as_a_line.__doc__ = TpuMagics.tpu_train.__doc__


def _without_comment(line: str) -> str:
    """The line without a trailing `# comment` (as in Python; a quoted # stays), so a magic
    line copied with its comment, `%tpu_connect --simulate 8   # rehearse`, works."""
    import shlex

    if "#" not in line:
        return line
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    return shlex.join(list(lexer))


def _with_suggestion(magic, message: str) -> str:
    """"unrecognized arguments: --batchsize 64" with "did you mean --batch-size?"."""
    if not message.startswith("unrecognized arguments:"):
        return message
    import difflib

    name = _typed(magic)
    flags = sorted(magic.parser._option_string_actions)
    hints = []
    for token in message.split(":", 1)[1].split():
        if token.startswith("-"):
            near = difflib.get_close_matches(token.split("=")[0], flags, n=1, cutoff=0.6)
            hints.append(f"{token}: did you mean {near[0]}?" if near else f"{token}: no such flag")
    said = f"{name}: {message}" + (f" ({'; '.join(hints)})" if hints else "")
    return said + f". See {name}? for every flag and an example."


def _typed(magic) -> str:
    """The magic as a user types it: %%tpu_train for a cell magic, %tpu_sync for a line one."""
    import inspect

    cell = "cell" in inspect.signature(magic).parameters
    return ("%%" if cell else "%") + magic.__name__


def show_domain_errors(shell) -> None:
    """A domain error raised in a plain cell (e.g. by a model tpu_magic adopted) prints as a
    `UsageError` does: its message, no traceback. Left alone where another extension set
    IPython's custom exception handler."""
    if shell.custom_exceptions:
        return

    def handler(shell, etype, value, tb, tb_offset=None):
        shell.show_usage_error(UsageError(str(value)))

    shell.set_custom_exc((TpuMagicError,), handler)


def _parse(magic, line: str):
    """`parse_argstring`, with unreadable quoting as a `UsageError` too (shlex raises
    ValueError), and the nearest flag suggested for an unknown one."""
    try:
        return parse_argstring(magic, _without_comment(line))
    except UsageError as exc:
        raise UsageError(_with_suggestion(magic, str(exc))) from None
    except ValueError as exc:
        name = _typed(magic)
        raise UsageError(f"{name} could not read its arguments ({exc}): {line!r}. Quote a value "
                         f"that has spaces with matching quotes; see {name}?") from None


def _device_line(current) -> str:
    """kind · replicas · memory, for the panel."""
    kind = (f"simulated {current.replicas}-core TPU on the CPU" if current.simulated
            else current.kind.upper())
    from tpu_magic.connecting.check import device_view

    memory = device_view(current).memory
    parts = [kind, f"{current.strategy_name}, {current.replicas} "
                   f"replica{'s' * (current.replicas != 1)}"]
    return " · ".join(parts + ([str(memory)] if memory else []))


def _on_an_engine() -> bool:
    """Whether this process is an engine of several hosts (`hosts.engine` marks them)."""
    from tpu_magic.hosts.engine import PROGRESS_VARIABLE

    return bool(os.environ.get(PROGRESS_VARIABLE))


def _call_watch():
    """On an engine of several hosts, what tells the notebook where the cell is (see
    `TrainingCell`'s `watch`); None elsewhere."""
    if not _on_an_engine():
        return None
    from tpu_magic.hosts.progress import in_call

    return in_call


def _progress_bar():
    """tqdm's notebook widget bar where widgets can show, else its text bar; on an engine of
    several hosts, a bar the notebook draws (`hosts.progress`)."""
    if _on_an_engine():
        from tpu_magic.hosts.progress import PublishedBar

        return PublishedBar
    from tqdm.auto import tqdm

    return tqdm


HOSTS_TIMEOUT = 120.0  # seconds engines may take to start and join, unless --timeout says


def _simulate(text: str | None) -> tuple[int | None, tuple[int, int] | None]:
    """`--simulate N` (one host of N devices) or `--simulate HxD` (H hosts of D)."""
    if text is None:
        return None, None
    if text.strip().isdigit():
        return int(text), None
    from tpu_magic.hosts.cluster import parse_layout

    return None, parse_layout(text)


def _end_hosts() -> None:
    """Stops the engines of the previous several-hosts connection, if any."""
    from tpu_magic.core import process

    previous = process.hosts()
    if previous is not None:
        process.set_hosts(None)
        previous.stop()


def register(ipython) -> None:
    ipython.register_magics(TpuMagics)
    show_domain_errors(ipython)


def unregister(ipython) -> None:
    manager = ipython.magics_manager
    for kind, names in (("line", ("tpu_connect", "tpu_sync", "tpu_train")),
                        ("cell", ("tpu_train",))):
        for name in names:
            manager.magics[kind].pop(name, None)
    manager.registry.pop("TpuMagics", None)
    if TpuMagicError in ipython.custom_exceptions:
        ipython.set_custom_exc((), None)
