"""How close a run came to the device's limit: FLOPs, achieved TFLOP/s, and input-bound.

The FLOPs of one training sample come from the backend: on JAX, XLA's own cost analysis
of the compiled gradient step; on TensorFlow, a count from the layers (`core.flops`).

Achieved TFLOP/s = FLOPs per sample × samples per second; its share of the peak is
against every replica's nominal peak (`chips`) and, where `--check` ran, its measured one.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tpu_magic.core.flops import counted_training_flops

# Keras reads the next batch inside its step function on both backends (and reads ahead:
# tf.data's prefetch, the JAX trainer's prefetch thread), so the wait cannot be timed from
# outside the step. After `fit`, a few batches are drawn from the same input on their own;
# an input that alone needs nine tenths of a step's time is what sets the pace.
PROBE_BATCHES = 4
INPUT_BOUND = 0.9


@dataclass(frozen=True)
class Utilization:
    """A `fit`'s use of the device.

    Attributes:
        flops_per_sample: training FLOPs of one sample (forward and backward).
        source: where that count comes from.
        achieved_tflops: FLOPs per sample × steady samples/s, in TFLOP/s.
        nominal_tflops / measured_tflops: the peak of all replicas, nominal (the chip table)
            and measured by `--check`, where known.
        input_share: the share of a step's time the input alone needs for a batch (see
            `input_need`); input_how: what it took against a step, and how that was
            measured; input_bound: the verdict.
        input_key / input_batch_seconds: what the input alone needed for a batch, and the
            key of tpu_magic's own pipeline it was measured on (`Inputs.measurable_key`;
            "" for a user's input): a later fit of the same key reuses the measurement.
    """

    flops_per_sample: float | None
    source: str
    achieved_tflops: float | None = None
    nominal_tflops: float | None = None
    measured_tflops: float | None = None
    input_share: float | None = None
    input_how: str = ""
    input_bound: bool = False
    input_key: str = ""
    input_batch_seconds: float | None = None

    @property
    def input_measured(self) -> tuple[str, float] | None:
        """(key, a batch's input seconds) for a later fit of the same pipeline to reuse;
        None where there is nothing to reuse (a user's input, or nothing measured)."""
        if not self.input_key or self.input_batch_seconds is None:
            return None
        return self.input_key, self.input_batch_seconds

    def lines(self) -> list[str]:
        found = []
        if self.achieved_tflops is not None:
            shares = []
            if self.measured_tflops:
                shares.append(f"{_percent(self.achieved_tflops / self.measured_tflops)} of "
                              "the measured peak")
            if self.nominal_tflops:
                shares.append(f"{_percent(self.achieved_tflops / self.nominal_tflops)} of "
                              "the nominal peak (MFU)")
            found.append(f"utilization: {_tflops(self.achieved_tflops)} TFLOP/s"
                         + (" = " + ", ".join(shares) if shares else
                            " (no peak known: run %tpu_connect --check to measure one)")
                         + f"; {self.flops_per_sample / 1e6:,.3g} MFLOP a sample "
                           f"({self.source})")
        if self.input_share is not None:
            share = _percent(self.input_share) if self.input_share >= 0.01 else "<1 %"
            found.append(
                f"input-bound: {self.input_how} ({share}): the data, not the device, sets the "
                "pace; cache, prefetch or simplify the input pipeline" if self.input_bound else
                f"not input-bound: {self.input_how} ({share})")
        return found


def _percent(share: float) -> str:
    return f"{100 * share:.0f} %" if share >= 0.095 else f"{100 * share:.2g} %"


def _tflops(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def input_need(dataset: Any, step_seconds: float | None, known: float | None = None
               ) -> tuple[float, str, bool, float] | None:
    """The share of a step's time the input alone needs for a batch, how that was measured,
    whether it makes the run input-bound, and the seconds a batch needed; None without a
    step time, or for an input that neither timed its own reads (a user's, read through
    `keras_inputs.whole_batches`) nor can be drawn again without changing what the next
    pass reads (tpu_magic's own pipelines of NumPy arrays can). `known`: a batch's seconds
    measured on an earlier fit of the same pipeline (same types, shapes, samples, batch,
    replicas): not drawn again (drawing starts the input's iterator again, a cost of its
    own at every fit)."""
    if not step_seconds:
        return None
    if known is not None:
        share = min(1.0, known / step_seconds)
        return (share, _how(known, step_seconds, "drawn after an earlier fit of the same "
                                                  "pipeline in this notebook"),
                share >= INPUT_BOUND, known)
    timed = getattr(dataset, "read_seconds", None)
    if callable(timed):
        seconds, count = timed()
        if not count:
            return None
        per_batch = seconds / count
        share = min(1.0, per_batch / step_seconds)
        return (share, _how(per_batch, step_seconds, f"{count} batches timed as fit read "
                                                     "them"),
                share >= INPUT_BOUND, per_batch)
    try:
        if hasattr(dataset, "element_spec"):  # tf.data, distributed or not
            batches = iter(dataset)
            next(batches)  # the iterator's start-up is not a batch's cost
            start = time.perf_counter()
            for _ in range(PROBE_BATCHES):
                next(batches)
            drawn = PROBE_BATCHES
        elif hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and \
                not isinstance(dataset, (list, tuple, dict)) and not hasattr(dataset, "shape"):
            count = len(dataset)  # a PyDataset: tpu_magic's own reads without a new pass
            if not count:
                return None
            read = getattr(dataset, "read_again", dataset.__getitem__)
            read(0)
            drawn = min(PROBE_BATCHES, count)
            start = time.perf_counter()
            for i in range(drawn):
                read(i % count)
        else:
            return None
    except StopIteration:
        return None
    per_batch = (time.perf_counter() - start) / drawn
    share = min(1.0, per_batch / step_seconds)
    return (share, _how(per_batch, step_seconds, f"{drawn} batches drawn on their own "
                                                 "after fit"),
            share >= INPUT_BOUND, per_batch)


def _how(batch_seconds: float, step_seconds: float, measured: str) -> str:
    """What the input alone takes against a step, and how that was measured."""
    return (f"reading a batch takes {_ms(batch_seconds)} of a {_ms(step_seconds)} step "
            f"({measured})")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3g} ms" if seconds < 1 else f"{seconds * 1e3:,.0f} ms"


def achieved(flops_per_sample: float | None, samples_per_second: float | None) -> float | None:
    if not flops_per_sample or not samples_per_second:
        return None
    return flops_per_sample * samples_per_second / 1e12


# -- counting from the layers ------------------------------------------------------------------


def of_fit(connection: Any, counted: tuple[float, str] | None, samples_per_second: float | None,
           step_seconds: float | None, dataset: Any,
           measured_tflops: float | None, key: str | None = None,
           known: Mapping[str, float] | None = None) -> Utilization | None:
    """A `fit`'s achieved TFLOP/s against the peaks, and the input's share of a step.

    Args:
        counted: the backend's training FLOPs of a sample and their source (None: unknown).
        measured_tflops: one device's matmul TFLOP/s from `--check`, if it ran.
        key: tpu_magic's own pipeline's key (`Inputs.measurable_key`), None for a user's.
        known: a batch's input seconds measured on earlier fits, by key.
    """
    if not samples_per_second:
        return None
    replicas = connection.replicas
    chip = connection.backend.device_view(connection, {}).chip
    wait = input_need(dataset, step_seconds, (known or {}).get(key) if key else None)
    return Utilization(
        flops_per_sample=counted[0] if counted else None,
        source=counted[1] if counted else "",
        achieved_tflops=achieved(counted[0] if counted else None, samples_per_second),
        nominal_tflops=chip.device_peak_tflops * replicas if chip else None,
        # simulated replicas share one CPU: its measured peak is all they have together
        measured_tflops=(measured_tflops * (1 if connection.simulated else replicas)
                         if measured_tflops else None),
        input_share=wait[0] if wait else None, input_how=wait[1] if wait else "",
        input_bound=bool(wait and wait[2]), input_key=(key or "") if wait else "",
        input_batch_seconds=wait[3] if wait else None)


class FlopCounts:
    """Training FLOPs of one sample per model, asked of the backend once per model and
    shape (XLA's count lowers the model's gradient, which takes long for a language model),
    also across cells: `known` holds the counts of earlier cells by `flops_key`, and
    `found` what this one counted."""

    def __init__(self, backend: Any, known: Mapping[str, tuple[float, str] | None] | None = None,
                 note: Callable[[str], None] = lambda text: None):
        self.backend, self.note = backend, note
        self.found: dict[str, tuple[float, str] | None] = dict(known or {})

    def counted(self, model: Any, first: Callable[[], Any] = lambda: None,
                planned: float | None = None) -> tuple[float, str] | None:
        """(FLOPs, where the count comes from), None where it cannot be told; `first()`: a
        batch the model is fed (the sizes its inputs leave open: a sequence's length), read
        only for a backend that counts from one; `planned`: the count from the cost
        analysis of the train step the memory plan compiled (then nothing is lowered to
        count, `_planned`)."""
        batch = first() if self.backend.flops_from_batch else None
        key = flops_key(model, batch)
        if key not in self.found:
            try:
                self.found[key] = self._planned(model, planned) or \
                    self.backend.training_flops(model, batch)
            except Exception as exc:  # noqa: BLE001 - counting adds a note, never an error
                self.note(f"the FLOPs of a sample could not be counted ({type(exc).__name__}: "
                          f"{exc}), so the report has no TFLOP/s")
                self.found[key] = None
        return self.found[key]

    @staticmethod
    def _planned(model: Any, planned: float | None) -> tuple[float, str] | None:
        """The plan's count, where the layers' count does not show it short (XLA counts a
        loop's body once: a recurrent layer's scan); None: not planned, or short."""
        if not planned:
            return None
        counted = counted_training_flops(model)
        if counted and planned < 0.5 * counted:
            return None
        return planned, "XLA cost analysis of the train step"

    def per_sample(self, model: Any, first: Callable[[], Any] = lambda: None,
                   planned: float | None = None) -> float | None:
        counted = self.counted(model, first, planned)
        return None if counted is None else counted[0]


def flops_key(model: Any, batch: Any = None) -> str:
    """What a sample's FLOPs depend on: the model object, the variables it computes with
    (each by identity, path, shape and dtype: a layer swapped or built again changes it),
    its inputs' shapes, a fed batch's (a row's shapes) and its dtype policy."""
    import keras

    variables = [(id(v), v.path, tuple(v.shape), str(v.dtype))
                 for v in list(model.trainable_variables) + list(model.non_trainable_variables)]
    inputs = [tuple(getattr(t, "shape", ())) for t in (getattr(model, "inputs", None) or [])]
    rows = None if batch is None else [tuple(getattr(a, "shape", ()))[1:]
                                       for a in keras.tree.flatten(batch)]
    policy = str(getattr(getattr(model, "dtype_policy", None), "name", ""))
    text = repr((id(model), type(model).__qualname__, variables, inputs, rows, policy))
    return hashlib.sha1(text.encode()).hexdigest()


def tokens_per_sample(x: Any) -> float | None:
    """Real tokens a row of a language model's input: a KerasHub dict's `padding_mask` where
    it has one, else the non-zero ids of an integer array of token ids (`token_ids`),
    (samples, sequence) (0 is the padding id of Keras's and KerasHub's tokenizers); None for
    other inputs."""
    import numpy as np

    if isinstance(x, dict):
        mask, ids = np.asarray(x.get("padding_mask", [])), x.get("token_ids")
        if mask.ndim == 2 and len(mask) and isinstance(ids, np.ndarray) and \
                mask.shape == ids.shape:
            return float(np.count_nonzero(mask)) / len(mask)
        x = ids
    if isinstance(x, np.ndarray) and x.ndim == 2 and x.dtype.kind in "iu" and len(x):
        return float(np.count_nonzero(x)) / len(x)
    return None


def first_batch_tokens(first_batches: Callable[[int], list] | None) -> float | None:
    """`tokens_per_sample` of the first batch a `fit` read (see `Inputs.first_batches`):
    for an input Keras reads itself, a dataset of KerasHub's dicts say."""
    import keras
    import numpy as np

    batches = first_batches(1) if first_batches is not None else None
    if not batches:
        return None
    x = keras.utils.unpack_x_y_sample_weight(batches[0])[0]
    return tokens_per_sample(keras.tree.map_structure(np.asarray, x))
