"""A call's batch and what becomes of the samples that do not fill it (training/inputs/planning.py),
against a stand-in connection: no Keras, no arrays."""

from dataclasses import dataclass, field

import pytest

from tpu_magic.core.batching import BatchPlan, plan_batches
from tpu_magic.core.errors import BatchSizeError
from tpu_magic.training.inputs.planning import (batched_input, choose_batch, is_dataset, padded_batch,
                                         pads, read_once, remainder_for, scale_learning_rate,
                                         static_batch, static_per_replica, validation_cut,
                                         validation_plan)

ROWS = ((0.0,),) * 10  # array-like input, not batched


@dataclass
class Backend:
    """The parts of `backends.protocol.Backend` that planning asks."""

    static_batch_is_global: bool = False  # True on JAX
    short: bool = False  # runs a short last batch as it is (JAX in one process)
    dataset_batch: int | None = None

    def runs_short_batches(self) -> bool:
        return self.short

    def dataset_batch_size(self, data) -> int | None:
        return self.dataset_batch


@dataclass
class Connection:
    replicas: int = 8
    tpu_rules: bool = False
    kind: str = "simulated"
    backend: Backend = field(default_factory=Backend)


@dataclass
class Tensor:
    shape: tuple


@dataclass
class Model:
    """A model whose Inputs have these shapes (a batch fixed where the first is a number)."""

    inputs: list


def fixed(batch):
    return Model([Tensor((batch, 64))])


FREE = Model([Tensor((None, 64))])


class Dataset:
    element_spec = None  # what tf.data's datasets have


def choose(method="fit", call=None, named=(), connection=None, flag=None, static=None):
    call = {"x": ROWS} if call is None else call
    connection = connection or Connection()
    requested = None if flag is None else plan_batches(  # as the request plans --batch-size
        flag, connection.replicas, tpu_rules=connection.tpu_rules, what="--batch-size")
    return choose_batch(method, call, set(named), connection, requested, static)


# -- which batch a call means ---------------------------------------------------------------

def test_the_calls_own_batch_then_the_flag_then_the_input_then_keras_default():
    own = {"x": ROWS, "batch_size": 64}
    assert choose(call=own, named={"batch_size"}, flag=128).global_batch == 64
    assert choose(call=own, flag=128).global_batch == 128  # not named: Keras's default value
    assert choose(call={"x": ROWS, "batch_size": None}, named={"batch_size"},
                  flag=128).global_batch == 128
    assert choose(static=16).global_batch == 128  # 16 fixed per replica, 8 replicas
    assert choose() == BatchPlan(32, 8, 4)


def test_keras_default_gets_tpu_advice_in_fit_and_none_in_evaluate_or_predict():
    tpu = Connection(tpu_rules=True)
    assert "4 samples per replica (batch_size 32 / 8)" in choose(connection=tpu).warnings[0]
    assert choose("evaluate", connection=tpu) == BatchPlan(32, 8, 4)
    assert choose("predict", connection=tpu) == BatchPlan(32, 8, 4)


def test_a_default_evaluate_batch_that_does_not_split_is_rounded_up_to_whole_replicas():
    assert choose("evaluate", connection=Connection(replicas=3)) == BatchPlan(33, 3, 11)
    # on a TPU whole 8-row tiles a replica: 3 x 8 = 24 rows a step, 48 covers 32
    assert choose("predict", connection=Connection(replicas=3, tpu_rules=True)
                  ).global_batch == 48
    with pytest.raises(BatchSizeError, match="batch_size 32 is not divisible by 3 replicas: "
                                             "use 30 or 33"):
        choose("fit", connection=Connection(replicas=3))


def test_a_dataset_brings_its_own_batch_or_none_that_can_be_told():
    batched = Connection(backend=Backend(dataset_batch=64))
    plan = choose(call={"x": Dataset(), "batch_size": 16}, named={"batch_size"},
                  connection=batched, flag=128)
    assert plan == BatchPlan(64, 8, 8)
    with pytest.raises(BatchSizeError, match="the dataset's batch 60 is not divisible by 8 "
                                             "replicas: use 56 or 64"):
        choose(call={"x": Dataset()}, connection=Connection(backend=Backend(dataset_batch=60)))
    assert choose(call={"x": Dataset()}) == BatchPlan(0, 8, 0)


def test_what_comes_in_batches_of_its_own():
    grain = type("MapDataset", (), {"__module__": "grain._src.python.dataset.dataset"})
    assert is_dataset(Dataset()) and is_dataset(grain())
    assert not is_dataset(type("MapDataset", (), {})())  # the name alone is not grain's
    assert read_once(iter([1, 2])) and read_once(x for x in ())
    assert not read_once([1, 2]) and not read_once(ROWS)
    assert batched_input(Dataset()) and batched_input(iter(ROWS))
    assert not batched_input(ROWS) and not batched_input(None)


# -- a batch fixed in the model's Input -----------------------------------------------------

def test_the_batch_fixed_in_the_input():
    assert static_batch(fixed(128)) == 128 and static_batch(FREE) is None
    assert static_batch(Model([Tensor((64, 8)), Tensor((64, 3))])) == 64
    assert static_batch(Model([Tensor((64, 8)), Tensor((32, 3))])) is None  # no one batch
    assert static_batch(object()) is None  # no Inputs (a subclassed model not built)


def test_a_fixed_batch_is_each_replicas_except_where_the_backend_traces_the_global_one():
    assert static_per_replica(fixed(64), Connection()) == 64  # TensorFlow: per replica
    jax = Connection(backend=Backend(static_batch_is_global=True))
    assert static_per_replica(fixed(64), jax) == 8
    assert static_per_replica(FREE, jax) is None
    with pytest.raises(BatchSizeError, match="the batch fixed in the model's Input 12 is not "
                                             "divisible by 8 replicas: use 8 or 16"):
        static_per_replica(fixed(12), jax)


def test_the_validation_pass_takes_its_own_batch_else_the_training_one():
    plan = BatchPlan(256, 8, 32)
    assert validation_plan({}, plan, FREE, Connection()) == plan
    assert validation_plan({"validation_batch_size": 64}, plan, FREE, Connection()
                           ) == BatchPlan(64, 8, 8)
    with pytest.raises(BatchSizeError, match="validation_batch_size 64 does not fit the model"):
        validation_plan({"validation_batch_size": 64}, plan, fixed(32), Connection())


# -- the samples that do not fill the last batch -------------------------------------------

def test_padding_everywhere_but_where_a_short_batch_runs_as_it_is():
    short = Connection(backend=Backend(short=True))
    assert pads(FREE, Connection()) and not pads(FREE, short)
    assert pads(fixed(64), short)  # a fixed batch is always whole
    assert remainder_for(FREE, short, has_targets=True) == "short"


@pytest.mark.parametrize("remainder, samples, tpu, batch", [
    ("pad", 13, False, 16),     # 13 rows: 2 rows a replica, 3 padded
    ("pad", 13, True, 64),      # a TPU pads to 8-row tiles a replica
    ("pad", 10**9, False, 256),  # more data than a batch: the batch
    ("pad", 0, False, 8),
    ("short", 13, False, 13),
    ("drop", 13, False, 8),     # 5 left out
    ("drop", 13, True, 8),      # too few for one tile a replica: whole replicas instead
    ("drop", 1000, True, 256),
])
def test_the_batch_numpy_data_is_cut_into(remainder, samples, tpu, batch):
    connection = Connection(tpu_rules=tpu)
    assert padded_batch(BatchPlan(256, 8, 32), FREE, samples, connection, remainder) == batch


def test_dropping_needs_a_sample_for_every_replica():
    for samples, words in ((5, "5 samples"), (1, "1 sample cannot")):
        with pytest.raises(BatchSizeError, match=f"{words}.* over 8 replicas.* pass at least 8"):
            padded_batch(BatchPlan(256, 8, 32), FREE, samples, Connection(), "drop")


def test_a_fixed_batch_is_never_cut():
    assert padded_batch(BatchPlan(256, 8, 32), fixed(32), 13, Connection(), "pad") == 256


@pytest.mark.parametrize("samples, fraction, cut", [
    (1797, 0.1, 1617), (203, 0.1, 182), (203, 0.2, 162), (10, 0.3, 7), (10, 0.7, 3), (5, 1.0, 0),
])
def test_validation_split_holds_out_the_last_rows_as_keras_does(samples, fraction, cut):
    assert validation_cut(samples, fraction) == cut


# -- --scale-lr -------------------------------------------------------------------------------

class Rate:
    def __init__(self, value):
        self.value = value

    def numpy(self):
        return self.value


class Optimizer:
    def __init__(self, rate):
        self.learning_rate = Rate(rate)


class Trained:
    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_scale_lr_multiplies_by_the_replicas_once_per_model():
    model, plan = Trained(Optimizer(0.1)), BatchPlan(256, 8, 32)
    said = scale_learning_rate(model, plan)
    assert model.optimizer.learning_rate == pytest.approx(0.8)
    assert said == ("--scale-lr: learning rate 0.1 → 0.8 (×8: global batch 256 = 8 × 32 per "
                    "replica)")
    # the next cell scales the first rate again, not the scaled one
    assert scale_learning_rate(model, BatchPlan(128, 4, 32)).startswith(
        "--scale-lr: learning rate 0.1 → 0.4 (×4")
    assert model.optimizer.learning_rate == pytest.approx(0.4)
    assert scale_learning_rate(Trained(None), plan) is None
