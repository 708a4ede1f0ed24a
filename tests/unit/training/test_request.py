"""A cell's request (`training.request.read_request`): every flag read and checked once,
before anything runs. Pure: no framework is imported (the subprocess test holds that)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from tpu_magic.core.errors import (BatchSizeError, FlagError, MemoryPlanError,
                                   PrecisionError, ShardError)
from tpu_magic.training.request import Shard, TrainRequest, on_or_off, read_request

EIGHT = SimpleNamespace(replicas=8, devices=[object()] * 8, tpu_rules=False, kind="cpu")


def test_a_request_holds_typed_values():
    request = read_request(EIGHT, batch_size=64, epochs=3, shard="model", mesh="2x4",
                           plan_for="v5e-8", verify="off", precision="fp32", keep=3,
                           checkpoint="ckpt", resume=True)
    assert request.batch.global_batch == 64 and request.batch.per_replica == 32  # 2 data rows
    assert request.shard is Shard.MODEL and request.mesh == (2, 4)
    assert request.plan_for[0].name == "TPU v5e" and request.plan_for[1] == 8
    assert request.verify is False and request.precision.policy == "float32"
    assert (request.epochs, request.keep, request.checkpoint, request.resume) == (3, 3, "ckpt",
                                                                                 True)
    with pytest.raises(AttributeError):
        request.epochs = 4  # frozen


def test_defaults_are_a_plain_cell():
    request = read_request(EIGHT)
    assert request == TrainRequest() and request.batch_size is None
    assert request.shard is Shard.DATA and request.mesh is None and request.keep == 2
    assert read_request(EIGHT, shard="model").mesh == (1, 8)
    assert read_request(EIGHT, batch_size=64).batch.per_replica == 8


@pytest.mark.parametrize("flags, error, words", [
    (dict(epochs=0), FlagError, "--epochs 0 must be 1 or more"),
    (dict(epochs=True), FlagError, "--epochs True must be 1 or more"),
    (dict(steps_per_execution=-2), FlagError, "--steps-per-execution -2 must be 1 or more"),
    (dict(checkpoint="c", keep=0), FlagError, "--keep 0 must be 1 or more"),
    (dict(resume=True), FlagError, "--resume works with --checkpoint DIR"),
    (dict(keep=3), FlagError, "--keep works with --checkpoint DIR"),
    (dict(verify="maybe"), FlagError, "--verify 'maybe': use on or off"),
    (dict(batch_size=100), BatchSizeError, "--batch-size 100 is not divisible by 8 replicas: "
                                           "use 96 or 104"),
    (dict(batch_size=6, shard="model", mesh="4x2"), BatchSizeError, "by 4 replicas"),
    (dict(shard="tensor"), ShardError, "--shard 'tensor'"),
    (dict(mesh="3x3"), ShardError, "3×3 is not the 8 devices here"),
    (dict(plan_for="v5e-4"), MemoryPlanError, "plans for 4 devices, and this connection has 8"),
    (dict(plan_for="z80-8"), MemoryPlanError, "name a chip and its device count"),
    (dict(precision="fp8"), PrecisionError, "--precision 'fp8' is not one of"),
])
def test_bad_flags_are_refused_naming_the_value(flags, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(")):
        read_request(EIGHT, **flags)


def test_on_or_off():
    assert [on_or_off("--verify", v) for v in ("on", "YES", "1", True)] == [True] * 4
    assert [on_or_off("--verify", v) for v in ("off", "no", "false", False)] == [False] * 4


def test_reading_a_request_imports_no_framework():
    code = ("import sys; from types import SimpleNamespace as S\n"
            "from tpu_magic.training.request import read_request\n"
            "read_request(S(replicas=8, devices=[0]*8, tpu_rules=True, kind='cpu'), "
            "batch_size=64, shard='model', mesh='2x4', plan_for='v5e-8', precision='auto')\n"
            "print(sorted({'keras', 'tensorflow', 'jax', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# -- the flags as the magic reads them, and as several hosts get them -------------------------

EVERY_FLAG = ("--batch-size 64 --epochs 3 --scale-lr --steps-per-execution auto "
              "--checkpoint 'my ckpt' --keep 4 --resume --precision bf16 --shard model "
              "--mesh 2x4 --plan-for v5e-8 --memory auto --microbatches 2 --remat off "
              "--verify off --no-progress")


def _parsed(line):
    from tpu_magic.notebook.magics import TpuMagics, _parse

    return vars(_parse(TpuMagics.tpu_train, line))


def test_every_flag_of_tpu_train_reaches_the_hosts_as_typed():
    from tpu_magic.training.request import TRAIN_FLAGS, as_line, flag_values

    typed = _parsed(EVERY_FLAG)
    assert sorted(typed) == sorted(TRAIN_FLAGS)  # a new flag must be listed to travel
    assert all(value not in (None, False) for value in typed.values())
    values = flag_values(typed)
    assert flag_values(_parsed(as_line(values))) == values


def test_the_notebooks_defaults_reach_the_hosts_and_typed_flags_win():
    from tpu_magic.training.request import as_line, flag_values

    defaults = dict(precision="bf16", shard="auto", verify="off")
    line = as_line(flag_values(_parsed("--epochs 2"), **defaults))
    assert flag_values(_parsed(line)) == flag_values(_parsed(
        "--epochs 2 --precision bf16 --shard auto --verify off"))
    typed = flag_values(_parsed("--shard data --verify on"), **defaults)
    assert (typed["shard"], typed["verify"], typed["precision"]) == ("data", "on", "bf16")
    assert as_line(flag_values(_parsed(""))) == "--verify on"
