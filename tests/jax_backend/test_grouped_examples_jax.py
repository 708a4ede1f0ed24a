"""Published Keras code whose numbers a grouped loop could change, on 8 simulated devices:
each example of `support.grouped_examples` (per-step randomness, learning-rate schedules,
optimizer state, stateful metrics, callbacks that stop, a model's own JAX `train_step`,
mixed precision, sample and class weights, `steps_per_epoch`, several inputs and outputs;
each names its keras-io path or Keras docstring there) runs plainly on one device, then
through `%%tpu_train --steps-per-execution 4` (steps in groups, whatever the model's size)
and through `%%tpu_train` with K chosen, from the same seed. The histories, the weights, the
data a later cell draws, its predictions and the notebook's random state must be plain
Keras's within the suite's tolerance (the replicas sum in another order). One device, to
1e-5: tests/training/published/test_grouped_examples_one_device.py.
"""

import pytest

from support.grouped_examples import EXAMPLES, compare
from support.same import TOLERANCE

GROUPED = "--steps-per-execution 4"


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_a_grouped_published_example_trains_as_plain_keras(ip, name):
    example = EXAMPLES[name]
    found = compare(ip, name, [GROUPED, ""], example.replicas_tolerance or TOLERANCE)["lines"]
    shown = {line or "(auto)": run["differ"] for line, run in found.items() if run["differ"]}
    assert not shown, f"{example.source}\n" + "\n".join(
        f"{line}:\n  " + "\n  ".join(differ) for line, differ in shown.items())
    assert found[GROUPED]["k"] == 4
