"""Checkpoint files (training/checkpoints/store.py): their names and order, the sequence a new
one gets, what is kept, which one `--resume` takes, and what is moved aside; on real files in
a temporary directory, without Keras (the writer asks it only its version)."""

import subprocess
import sys
import types

import numpy as np
import pytest

from tpu_magic.core.errors import CheckpointError
from tpu_magic.training.checkpoints.one_file import read_checkpoint, write_file
from tpu_magic.training.checkpoints.state import Variables, mismatch, not_finite
from tpu_magic.training.checkpoints.store import CheckpointStore

WEIGHTS = (np.arange(4, dtype="float32").reshape(2, 2), np.ones(3, "float32"))


@pytest.fixture
def write(monkeypatch):
    """Writes `ckpt-SEQUENCE-epoch-EPOCH.h5` as a store does, with these weights."""
    monkeypatch.setitem(sys.modules, "keras", types.SimpleNamespace(__version__="3.test"))

    def write(directory, sequence, epoch, weights=WEIGHTS):
        path = directory / f"ckpt-{sequence:06d}-epoch-{epoch:04d}.h5"
        write_file(path, epoch, 11, sequence, Variables(("kernel", "bias"), tuple(weights)),
                    Variables(("iterations",), (np.array(5),)), "SGD")
        return path

    return write


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_a_checkpoint_reads_back_as_written(tmp_path, write):
    checkpoint = read_checkpoint(write(tmp_path, 3, 2))
    assert (checkpoint.sequence, checkpoint.epoch, checkpoint.seed) == (3, 2, 11)
    assert checkpoint.weights.names == ("kernel", "bias") and checkpoint.optimizer_class == "SGD"
    for got, want in zip(checkpoint.weights.arrays, WEIGHTS):
        np.testing.assert_array_equal(got, want)
    assert checkpoint.optimizer.shapes == [()] and not checkpoint.adapters_only


def test_a_file_that_is_not_a_whole_checkpoint_says_why(tmp_path):
    garbage = tmp_path / "ckpt-000001-epoch-0001.h5"
    garbage.write_bytes(b"\x89HDF half written")
    with pytest.raises(CheckpointError, match=r"ckpt-000001-epoch-0001.h5 is unreadable \("):
        read_checkpoint(garbage)
    import h5py

    with h5py.File(tmp_path / "other.h5", "w") as handle:
        handle.attrs["format"] = "somebody else's"
    with pytest.raises(CheckpointError, match="other.h5 is not a tpu_magic checkpoint"):
        read_checkpoint(tmp_path / "other.h5")


def test_keep_must_be_one_or_more(tmp_path):
    with pytest.raises(CheckpointError, match="--keep 0 must be 1 or more"):
        CheckpointStore(tmp_path, keep=0)


def test_the_listing_is_by_sequence_and_names_nothing_else(tmp_path):
    for name in ("ckpt-000002-epoch-0005.h5", "ckpt-000003-epoch-0002.h5",
                 ".ckpt-000004-epoch-0004.h5.123.tmp", "ckpt-000001-epoch-0001.h5.damaged",
                 "ckpt-1-epoch-1.h5", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "ckpt-000010-epoch-0001.orbax").mkdir()
    # a run resumed from an earlier epoch writes a higher sequence: newest by sequence
    assert [(s, e, p.name) for s, e, p in CheckpointStore(tmp_path).listing()] == [
        (2, 5, "ckpt-000002-epoch-0005.h5"), (3, 2, "ckpt-000003-epoch-0002.h5"),
        (10, 1, "ckpt-000010-epoch-0001.orbax")]
    assert CheckpointStore(tmp_path / "missing").listing() == []


def test_a_new_checkpoints_sequence_is_never_one_used_before(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store._next_sequence(store.listing()) == 1
    for name in ("ckpt-000002-epoch-0002.h5", "ckpt-000005-epoch-0004.h5.damaged"):
        (tmp_path / name).write_bytes(b"")
    assert store._next_sequence(store.listing()) == 6  # one moved aside counts too


def test_prepare_creates_the_directory_and_clears_what_dead_writers_left(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    directory = tmp_path / "new" / "checkpoints"
    store = CheckpointStore(directory)
    store.prepare()
    for name in (f".ckpt-000004-epoch-0004.h5.{dead}.tmp", ".ckpt-000005-epoch-0005.h5.1.tmp"):
        (directory / name).write_bytes(b"")
    (directory / "ckpt-000006-epoch-0006.orbax.orbax-checkpoint-tmp-1").mkdir()
    store.prepare()
    # pid 1 is alive: its file may still become a checkpoint
    assert names(directory) == [".ckpt-000005-epoch-0005.h5.1.tmp"]


def test_a_directory_that_cannot_be_written_is_refused(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"--checkpoint .*file/checkpoints: cannot write "
                                              r"there \(.*\)\. Choose a directory"):
        CheckpointStore(tmp_path / "file" / "checkpoints").prepare()


def test_the_newest_k_usable_checkpoints_are_kept(tmp_path, write):
    for epoch in (1, 2, 3, 4):
        write(tmp_path, epoch, epoch)
    (tmp_path / "ckpt-000003-epoch-0003.h5").write_bytes(b"damaged")
    store = CheckpointStore(tmp_path, keep=2)
    store._prune()
    assert names(tmp_path) == ["ckpt-000002-epoch-0002.h5", "ckpt-000003-epoch-0003.h5.damaged",
                               "ckpt-000004-epoch-0004.h5"]
    assert store.take_moved_aside()[0].endswith(
        "moved aside to ckpt-000003-epoch-0003.h5.damaged")


def test_only_the_leading_process_removes_or_moves_files(tmp_path, write):
    for epoch in (1, 2, 3):
        write(tmp_path, epoch, epoch)
    (tmp_path / "ckpt-000003-epoch-0003.h5").write_bytes(b"damaged")
    store = CheckpointStore(tmp_path, keep=1)
    store.leads = False  # another host leads
    store._prune()
    assert len(names(tmp_path)) == 3  # the leader moves the damaged one, once
    assert store.take_moved_aside()[0].endswith("moved aside to ckpt-000003-epoch-0003.h5.damaged")


def test_resume_takes_the_newest_whole_finite_checkpoint_and_moves_the_rest_aside(tmp_path,
                                                                                   write):
    write(tmp_path, 1, 1)
    write(tmp_path, 2, 2, (np.full((2, 2), np.nan, "float32"), np.ones(3, "float32")))
    (write(tmp_path, 3, 3)).write_bytes(b"damaged")
    store = CheckpointStore(tmp_path)
    found = store.newest()
    assert found.checkpoint.epoch == 1
    assert [why.split(" ")[0] for why in found.skipped] == ["ckpt-000003-epoch-0003.h5",
                                                            "ckpt-000002-epoch-0002.h5"]
    assert "NaN or infinite" in found.skipped[1]
    assert names(tmp_path) == ["ckpt-000001-epoch-0001.h5", "ckpt-000002-epoch-0002.h5.damaged",
                               "ckpt-000003-epoch-0003.h5.damaged"]
    assert len(store.take_moved_aside()) == 2 and store.take_moved_aside() == []  # said once
    assert store._next_sequence(store.listing()) == 4


def test_nothing_to_resume_from_where_every_checkpoint_is_damaged(tmp_path):
    (tmp_path / "ckpt-000001-epoch-0001.h5").write_bytes(b"damaged")
    found = CheckpointStore(tmp_path).newest()
    assert found.checkpoint is None and len(found.skipped) == 1


def test_weights_that_are_nan_or_infinite():
    assert not_finite([np.ones(2, "float32"), np.array([np.inf], "float16")])
    assert not_finite([np.array([np.nan], "float64")])
    assert not not_finite([np.ones(2, "float32"), np.arange(3)])  # integers hold no NaN
    assert not not_finite([])


class Weight:
    def __init__(self, path, shape):
        self.path, self.shape = path, shape


def test_a_checkpoint_and_a_model_that_differ_are_told_apart_by_count_and_shape():
    saved = Variables(("a", "b"), (), described=((2, 2), (3,)))
    assert mismatch(saved, [Weight("dense/kernel", (2, 2)), Weight("dense/bias", (3,))],
                    "weights") is None
    assert mismatch(saved, [Weight("dense/kernel", (2, 2))], "weights") == (
        "the checkpoint has 2 weights, the model has 1")
    assert mismatch(saved, [Weight("dense/kernel", (2, 2)), Weight("dense/bias", (4,))],
                    "weights") == ("weights 1 (dense/bias) has shape (4,) in the model but (3,) "
                                   "in the checkpoint (b)")
