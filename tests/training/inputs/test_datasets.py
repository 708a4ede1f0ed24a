"""The examples' datasets: the offline stand-ins have the real loaders' shapes and dtypes.

Nothing here downloads: `offline=True`, or a download host on a closed loopback port.
"""

import sys

import numpy as np
import pytest

from tpu_magic import datasets


@pytest.fixture(autouse=True)
def empty_keras_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))


@pytest.mark.parametrize("name, image, label", [
    ("cifar10", (32, 32, 3), (1,)), ("mnist", (28, 28), ()), ("fashion_mnist", (28, 28), ()),
])
def test_image_stand_ins_have_the_real_shapes(name, image, label):
    said = []
    (x, y), (xt, yt) = datasets.load(name, offline=True, say=said.append)
    assert x.shape[1:] == xt.shape[1:] == image and x.dtype == np.uint8
    assert y.shape[1:] == label and set(np.unique(y)) == set(range(10))
    assert len(x) > len(xt) > 0 and x.max() > 200
    assert said == [f"{name}: offline (offline=True), so small stand-in data of the same "
                    "shapes (digits upscaled)"]


def test_imdb_stand_in_is_learnable_word_sequences():
    (x, y), (xt, yt) = datasets.load("imdb", offline=True, num_words=15000, say=lambda _: None)
    assert x.dtype == object and isinstance(x[0], list) and len(x) == len(y) == 2000
    assert min(min(r) for r in x) >= 2 and max(max(r) for r in x) < 15000
    assert set(np.unique(y)) == {0, 1}
    # The label is in the words: even cue words mark positive reviews.
    even = np.array([sum(w % 2 == 0 for w in r if w < 82) - sum(w % 2 for w in r if w < 82) for r in x])
    assert np.mean((even > 0) == (y == 1)) > 0.95


def test_samples_keeps_that_many_and_a_sixth_for_testing():
    (x, y), (xt, yt) = datasets.load("mnist", samples=120, offline=True, say=lambda _: None)
    assert (len(x), len(y), len(xt), len(yt)) == (120, 120, 20, 20)


def test_a_host_that_does_not_answer_means_the_stand_in(closed_port):
    said = []
    datasets.load("mnist", host=("127.0.0.1", closed_port), say=said.append)
    assert said[0].startswith("mnist: offline (127.0.0.1 does not answer)")


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset 'cifar100'"):
        datasets.load("cifar100", offline=True)


def test_image_stand_ins_need_no_scikit_learn(monkeypatch):
    # a plain `pip install tpu_magic[jax]` has no scikit-learn: the README's first cell
    # died there with ModuleNotFoundError (issue 34)
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    (x, y), (xt, yt) = datasets.load("mnist", offline=True, say=lambda _: None)
    assert x.shape[1:] == (28, 28) and x.dtype == np.uint8 and x.max() > 200
    assert set(np.unique(y)) == set(range(10)) and len(x) > len(xt) > 0
    # learnable: the nearest class mean of the training images names most test digits
    means = np.stack([x[y == k].reshape((y == k).sum(), -1).mean(0) for k in range(10)])
    nearest = np.argmin(((xt.reshape(len(xt), 1, -1) - means) ** 2).sum(-1), axis=1)
    assert 0.3 < np.mean(nearest == yt) < 1.0


@pytest.mark.parametrize("name, real_first, stand_in_first", [
    ("cifar10", "airplane", "digit 0"), ("fashion_mnist", "T-shirt", "digit 0"),
    ("mnist", "0", "digit 0"), ("imdb", "negative", "negative"),
])
def test_the_stand_in_names_its_labels_for_what_they_are(name, real_first, stand_in_first):
    # the CIFAR page captioned an upscaled digit "frog": a caption must name the stand-in's class
    loaded = datasets.load(name, offline=True, samples=12, say=lambda _: None)
    (x, y), _ = loaded
    assert loaded.stand_in and loaded.classes[0] == stand_in_first and len(x) == 12
    assert datasets.CLASSES[name][0] == real_first
    assert len(loaded.classes) == (2 if name == "imdb" else 10)
