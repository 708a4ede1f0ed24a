"""Domain errors raised by tpu_magic's logic.

The logic modules know nothing of IPython. The magics module converts every
``TpuMagicError`` into a plain ``UsageError`` in one place, so IPython prints the
message without a traceback. Anything else that escapes is a bug and keeps its
traceback.
"""


class TpuMagicError(Exception):
    """A user-facing problem: the message says what was wrong and what to do."""


class AddressError(TpuMagicError):
    """A connect target that is not one of the accepted forms."""


class ConnectError(TpuMagicError):
    """The accelerator could not be reached or set up."""


class MissingDependencyError(TpuMagicError):
    """A package tpu_magic needs is not installed."""


class BatchSizeError(TpuMagicError):
    """A batch size that cannot be split over the replicas."""


class InputError(TpuMagicError):
    """Training data a model cannot take on the connected device (e.g. strings on a TPU)."""


class RewrapError(TpuMagicError):
    """A model that cannot be rebuilt inside the distribution strategy."""


class SyncError(TpuMagicError):
    """A model that cannot be copied to the CPU."""


class TrainJobError(TpuMagicError):
    """A training job from the panel that cannot start."""


class CheckpointError(TpuMagicError):
    """A checkpoint directory or file that cannot be used."""


class BusyError(TpuMagicError):
    """An action refused while a training job from the panel is running."""


class PrecisionError(TpuMagicError):
    """A --precision value that is not one of the known ones."""


class ShardError(TpuMagicError):
    """A --shard or --mesh that cannot be used on this connection."""


class MemoryPlanError(TpuMagicError):
    """A training step that will not fit a device's memory, or a --plan-for that cannot be."""


class HostsError(TpuMagicError):
    """Several hosts: an engine that did not answer, died, or a cell that failed on hosts."""


class FlagError(TpuMagicError):
    """A flag's value, or flags that do not go together."""


class KerasBuildError(Exception):
    """Keras's own build of a model for a call (`_symbolic_build`: its compiled loss and
    metrics from the first batch), run early by a plan, raised the user's error: the call
    raises `original`, as plain Keras's would at its start (a retry from the half-built
    model raises another). Not a `TpuMagicError`: the error is the cell's."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original
