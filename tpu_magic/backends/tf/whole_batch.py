"""Every replica the whole batch: a fit whose model's losses the replicas cannot split (a
loss summed over the batch with `add_loss`, a loss or layer combining the batch's rows)
runs with each replica computing the whole global batch, as one device does.

Each replica's loss is then one device's (`replica_steps` keeps it its batch's mean), the
gradients averaged over identical replicas are one device's, and the metrics are read from
the first replica, whose states hold the whole batch's (summed over the replicas they would
count every row once a replica). Correct numbers at the replicas' count times the work.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from tpu_magic.backends.tf.parity import step_state
from tpu_magic.backends.tf.variables import reading, replica_values
from tpu_magic.core.deps import require_tensorflow
from tpu_magic.core.steps import StepState, frozen_variables, host_copy, state_groups


def for_fit(model: Any, call: Mapping[str, Any]) -> WholeBatch | None:
    """The means to run a fit (`call`: its inputs as built) with every replica taking the
    whole batch; None where its training input cannot be given so (not tpu_magic's cut
    into the replicas' parts: Keras distributes it)."""
    from tpu_magic.backends.tf.batch_parts import ReplicaParts

    train = call.get("x")
    if not isinstance(train, ReplicaParts) or not train.gives_whole:
        return None
    validation = call.get("validation_data")
    return WholeBatch(model, train, validation if isinstance(validation, ReplicaParts)
                      else None)


class WholeBatch:
    """A fit's switch to every replica taking the whole batch: from its start (`start`),
    or after its first steps ran split, by running them again (`rerun`) and then keeping
    (`keep`) or undoing (`undo`) that. `close` ends it with the fit."""

    def __init__(self, model: Any, train: Any, validation: Any = None):
        self._model, self._train, self._validation = model, train, validation
        self._aggregations: list = []  # (metric variable, its own aggregation) while changed
        self._split: list = []  # the split steps' state, each replica's, while a rerun is kept

    def start(self) -> None:
        """Every replica takes the whole batch from the fit's first step."""
        self._first_replica_metrics()
        self.keep()

    def rerun(self, before: StepState, steps: int) -> tuple[dict, StepState]:
        """The fit's first `steps` steps again from `before` (the state they started from),
        every replica taking the whole batch: their logs and the state after. The split
        steps' state is kept until `keep` or `undo`."""
        model = self._model
        with reading(model):
            self._split = _replica_copies(model)
            for group, values in zip(state_groups(model)[:3], before.groups[:3]):
                for variable, value in zip(group, values):
                    if value is not None:
                        for part in replica_values(variable):
                            part.assign(value)
            self._first_replica_metrics()
            model.reset_metrics()
        for batch in self._train.whole_batches(steps):
            model.train_function(iter([batch]))
        with reading(model):
            logs = {key: float(np.asarray(value))
                    for key, value in model.get_metrics_result().items()
                    if np.ndim(np.asarray(value)) == 0}
        return logs, step_state(model)

    def keep(self) -> None:
        """The fit's inputs go on with every replica taking the whole batch."""
        self._split = []
        self._train.every_replica_whole()
        if self._validation is not None:
            self._validation.every_replica_whole()

    def undo(self) -> None:
        """The rerun undone: the model holds the split steps' state again, each replica its
        own, and the metrics are read over the replicas again."""
        with reading(self._model):
            for variable, values in self._split:
                parts = replica_values(variable)
                for part, value in zip(parts, values if len(values) == len(parts)
                                       else values * len(parts)):
                    part.assign(value)
        self._split = []
        self.close()

    def close(self) -> None:
        """The metrics read over the replicas again, as their variables were made."""
        for variable, aggregation in self._aggregations:
            variable._aggregation = aggregation
        self._aggregations = []

    def _first_replica_metrics(self) -> None:
        """The model's metric variables read from the first replica (TensorFlow's own
        aggregation `ONLY_FIRST_REPLICA`, set on each while the fit runs whole)."""
        if self._aggregations:
            return
        tf = require_tensorflow()
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA
        for variable in self._model.metrics_variables:
            inner = getattr(variable, "value", variable)
            if hasattr(inner, "_aggregation") and len(replica_values(variable)) > 1:
                self._aggregations.append((inner, inner._aggregation))
                inner._aggregation = first


def _replica_copies(model: Any) -> list[tuple[Any, list[np.ndarray]]]:
    """Every variable of the model's training state as host arrays: one where its replicas
    hold the same value (written in sync), each replica's where they may differ (a
    variable read in sync: metrics, a replica's own statistics)."""
    tf = require_tensorflow()
    on_read = tf.VariableSynchronization.ON_READ
    frozen = frozen_variables(model)  # no step changes them
    found = []
    for group in state_groups(model):
        for variable in group:
            if id(variable) in frozen:
                continue
            parts = replica_values(variable)
            inner = getattr(variable, "value", variable)
            own = getattr(inner, "synchronization", None) == on_read
            found.append((variable, [host_copy(p) for p in (parts if own else parts[:1])]))
    return found
