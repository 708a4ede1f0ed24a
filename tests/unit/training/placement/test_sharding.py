"""`--shard`/`--mesh` and the layout of variables a model's own layout map does not name
(pure: no JAX here; the JAX suite trains sharded models)."""

import pytest

from tpu_magic.core.errors import ShardError
from tpu_magic.core.layouts import SHARD_FROM_BYTES, VariableShard, derived_spec
from tpu_magic.training.request import Shard, parse_mesh, read_shard
from tpu_magic.training.placement.sharding import table


@pytest.mark.parametrize("text, mesh", [(None, (1, 8)), ("1x8", (1, 8)), ("2x4", (2, 4)),
                                        ("8X1", (8, 1)), ("4×2", (4, 2))])
def test_meshes(text, mesh):
    assert parse_mesh(text, 8) == mesh


@pytest.mark.parametrize("text, words", [("3x3", "3×3 is not the 8 devices here; use one of "
                                                 "8x1, 4x2, 2x4, 1x8"),
                                         ("2by4", "write it as BxM"), ("0x8", "0×8 is not")])
def test_bad_meshes_name_the_value_and_the_ones_that_fit(text, words):
    with pytest.raises(ShardError, match=words):
        parse_mesh(text, 8)


def test_shard_values():
    assert read_shard(None, None, 8) == (Shard.DATA, None)
    assert read_shard(None, "2x4", 8) == (Shard.MODEL, (2, 4))
    assert read_shard("MODEL", None, 8) == (Shard.MODEL, (1, 8))
    assert read_shard("auto", None, 8) == (Shard.AUTO, None)
    with pytest.raises(ShardError, match="--shard 'tensor': use data .*, model .* or auto"):
        read_shard("tensor", None, 8)
    with pytest.raises(ShardError, match="--mesh 2x4 lays out the model"):
        read_shard("auto", "2x4", 8)
    with pytest.raises(ShardError, match="--mesh 2x4 lays out the model over its columns: use "
                                         "it with --shard model"):
        read_shard("data", "2x4", 8)


@pytest.mark.parametrize("shape, columns, spec", [
    ((4096, 1024), 4, (None, "model")),        # a Dense kernel: its output units
    ((50000, 512), 8, (None, "model")),        # an embedding: its hidden size
    ((512, 12, 64), 4, (None, "model", None)),  # an attention kernel: 12 heads divide by 4
    ((1024, 6, 100), 4, (None, None, "model")),  # heads do not divide: the head dimension
    ((16384, 6, 10), 4, ("model", None, None)),  # only the first dimension divides
    ((1000, 7, 3), 8, (None, None, None)),      # nothing divides: replicated
    ((4096,), 4, (None,)),                      # a bias
    ((64, 64), 4, (None, None)),                # too small to be worth it
    ((4096, 1024), 1, (None, None)),            # one column: nothing to split
])
def test_the_derived_layout(shape, columns, spec):
    assert derived_spec(shape, 4, columns) == spec


def test_the_threshold_is_in_bytes():
    rows = SHARD_FROM_BYTES // (4 * 8)
    assert derived_spec((rows, 8), 4, 8) == (None, "model")
    assert derived_spec((rows - 1, 8), 4, 8) == (None, None)


def test_the_table_lists_the_largest_and_names_a_large_replicated_variable():
    mib = 2 ** 20
    rows = [VariableShard("dec/kernel", (4096, 1024), (None, "model"), 4 * mib, 16 * mib),
            VariableShard("odd/kernel", (1000, 7, 3), (None, None, None), 3 * mib, 3 * mib),
            VariableShard("dec/bias", (1024,), (None,), 4096, 4096)]
    lines, notes = table(rows, (2, 4), device_bytes=16 * mib)
    assert lines[0].startswith("sharding: mesh 2x4 (data × model); weights 7.00 MiB per "
                               "device of 19.00 MiB")
    assert lines[1] == "  dec/kernel (4096, 1024) (·, model): 4.00 MiB per device"
    assert len(notes) == 1 and notes[0].startswith("odd/kernel (1000, 7, 3) is replicated on "
                                                   "every device (3.00 MiB, 19 % of one device")
