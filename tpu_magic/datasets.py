"""The classic tutorials' datasets, with small stand-ins of the same shapes when offline.

`load(name)` returns what `keras.datasets.<name>.load_data()` returns (as a `Loaded`,
which also names the labels' classes and says whether it is the stand-in). It uses Keras's
cache (~/.keras/datasets) when the file is there; otherwise it checks in at most a few
seconds that the download host answers, and downloads. Offline (no answer, a failed
download, or `offline=True`) it says so in one line and returns small data of the same
shapes and dtypes: scikit-learn's bundled digits upscaled for the image sets (digits
drawn from a bitmap font where scikit-learn is not installed), generated
word sequences for IMDB. Nothing here is imported by `import tpu_magic`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

DOWNLOAD_HOST = ("storage.googleapis.com", 443)
PROBE_SECONDS = 3.0
IMDB_WORDS = 15000


@dataclass(frozen=True)
class Dataset:
    """One tutorial dataset: its Keras loader, cache file, and image shape (None: text)."""

    loader: str
    cache_file: str
    image_shape: tuple[int, ...] | None


CLASSES = {
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                "truck"),
    "mnist": tuple(str(digit) for digit in range(10)),
    "fashion_mnist": ("T-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt",
                      "sneaker", "bag", "boot"),
    "imdb": ("negative", "positive"),
}
# the image stand-ins are digits whatever the dataset: their labels are digits' names
STAND_IN_CLASSES = tuple(f"digit {digit}" for digit in range(10))


class Loaded(tuple):
    """`((x_train, y_train), (x_test, y_test))`, unpacked as Keras's loaders' result is, and
    what the labels mean: `classes` (the name of each label, e.g. CIFAR-10's ten, or
    "digit 3" for the image stand-ins) and `stand_in` (True: the offline stand-in, not the
    dataset), so a notebook's captions stay true offline."""

    classes: tuple[str, ...]
    stand_in: bool

    def __new__(cls, data: Any, classes: tuple[str, ...], stand_in: bool) -> "Loaded":
        loaded = super().__new__(cls, data)
        loaded.classes, loaded.stand_in = classes, stand_in
        return loaded


DATASETS = {
    "cifar10": Dataset("cifar10", "cifar-10-batches-py", (32, 32, 3)),
    "mnist": Dataset("mnist", "mnist.npz", (28, 28)),
    "fashion_mnist": Dataset("fashion_mnist", "fashion-mnist", (28, 28)),
    "imdb": Dataset("imdb", "imdb.npz", None),
}


def load(name: str, *, samples: int | None = None, offline: bool = False,
         num_words: int = IMDB_WORDS, say: Callable[[str], None] = print,
         host: tuple[str, int] = DOWNLOAD_HOST) -> Loaded:
    """`(x_train, y_train), (x_test, y_test)` of a tutorial dataset, as a `Loaded` (its
    `classes` and `stand_in` say what the labels are).

    Args:
        name: "cifar10", "mnist", "fashion_mnist" or "imdb".
        samples: keep at most this many training samples (and a sixth as many test ones).
        offline: do not try to download; use the stand-in unless Keras has the file cached.
        num_words: IMDB's vocabulary size.
        say: prints the one line about where the data came from.
        host: the download host probed before downloading.

    Raises:
        ValueError: an unknown name.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    spec = DATASETS[name]
    cached = _cached(spec)
    data, why = None, None
    if cached or (not offline and _answers(host)):
        try:
            data = _keras_load(spec, num_words)
            say(f"{name}: the real dataset ({'Keras cache' if cached else 'downloaded'})")
        except Exception as exc:  # noqa: BLE001 - any failure means "use the stand-in"
            why = f"the download failed ({type(exc).__name__})"
    else:
        why = "offline=True" if offline else f"{host[0]} does not answer"
    stand_in = data is None
    if stand_in:
        data = _stand_in(spec, num_words)
        say(f"{name}: offline ({why}), so small stand-in data of the same shapes "
            f"({'digits upscaled' if spec.image_shape else 'generated word sequences'})")
    classes = STAND_IN_CLASSES if stand_in and spec.image_shape else CLASSES[name]
    return Loaded(_first(data, samples), classes, stand_in)


def _cached(spec: Dataset) -> bool:
    home = os.environ.get("KERAS_HOME", os.path.join(os.path.expanduser("~"), ".keras"))
    return os.path.exists(os.path.join(home, "datasets", spec.cache_file))


def _answers(host: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(host, timeout=PROBE_SECONDS):
            return True
    except OSError:
        return False


def _keras_load(spec: Dataset, num_words: int):
    import keras

    module = getattr(keras.datasets, spec.loader)
    return module.load_data(num_words=num_words) if spec.loader == "imdb" else module.load_data()


def _first(data, samples: int | None):
    (x_train, y_train), (x_test, y_test) = data
    if samples is None:
        return data
    test = max(samples // 6, 1)
    return (x_train[:samples], y_train[:samples]), (x_test[:test], y_test[:test])


def _stand_in(spec: Dataset, num_words: int):
    if spec.image_shape is None:
        return _word_sequences(num_words)
    return _upscaled_digits(spec.image_shape, column_labels=spec.loader == "cifar10")


def _upscaled_digits(shape: tuple[int, ...], column_labels: bool):
    """1,797 8×8 digits as uint8 images of `shape` (nearest-neighbour upscale): sklearn's
    handwritten ones where scikit-learn is installed, else drawn ones (`_drawn_digits`)."""
    import numpy as np

    try:
        from sklearn.datasets import load_digits
    except ImportError:  # a plain `pip install tpu_magic[jax]`: no scikit-learn
        small, target = _drawn_digits()
    else:
        digits = load_digits()
        small, target = digits.images, digits.target
    height, width = shape[:2]
    rows = np.arange(height) * 8 // height
    cols = np.arange(width) * 8 // width
    images = (small[:, rows][:, :, cols] * (255 / 16)).astype("uint8")
    if len(shape) == 3:
        images = np.repeat(images[..., None], shape[2], axis=-1)
    labels = target.astype("uint8")
    if column_labels:
        labels = labels[:, None]  # CIFAR-10's labels are (n, 1)
    cut = len(images) - 300
    return (images[:cut], labels[:cut]), (images[cut:], labels[cut:])


# 5×7 bitmaps of the digits 0-9, one string of rows each ("1": ink)
_GLYPHS = (
    "01110 10001 10011 10101 11001 10001 01110", "00100 01100 00100 00100 00100 00100 01110",
    "01110 10001 00001 00010 00100 01000 11111", "11111 00010 00100 00010 00001 10001 01110",
    "00010 00110 01010 10010 11111 00010 00010", "11111 10000 11110 00001 00001 10001 01110",
    "00110 01000 10000 11110 10001 10001 01110", "11111 00001 00010 00100 01000 01000 01000",
    "01110 10001 10001 01110 10001 10001 01110", "01110 10001 10001 01111 00001 00010 01100",
)


def _drawn_digits(count: int = 1797, seed: int = 0):
    """Digits as sklearn's `load_digits` gives them ((count, 8, 8) in 0-16, labels 0-9),
    drawn from a 5×7 bitmap font at a random place, stroke strength and noise: learnable,
    not trivial, and needing only NumPy."""
    import numpy as np

    rng = np.random.default_rng(seed)
    glyphs = np.array([[[c == "1" for c in row] for row in glyph.split()]
                       for glyph in _GLYPHS], dtype="float64")
    labels = rng.integers(0, 10, count)
    images = np.zeros((count, 8, 8))
    for i, (down, right) in enumerate(zip(rng.integers(0, 2, count), rng.integers(0, 4, count))):
        images[i, down:down + 7, right:right + 5] = glyphs[labels[i]]
    images = images * rng.uniform(0.5, 1.0, (count, 1, 1)) + rng.normal(0, 0.2, images.shape)
    return np.clip(images, 0, 1) * 16, labels


def _word_sequences(num_words: int, train: int = 2000, test: int = 500, seed: int = 0):
    """Reviews as lists of word indices; a review is positive when it holds more of the
    'positive' words (even indices) than of the 'negative' ones (odd indices)."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def make(count: int):
        reviews, labels = [], []
        for _ in range(count):
            length = int(rng.integers(30, 300))
            words = rng.integers(4, num_words, size=length)  # 0-3 are reserved, as in Keras
            label = int(rng.integers(0, 2))
            cue = rng.integers(2, 40, size=length // 4) * 2 + (1 - label)
            words[rng.choice(length, size=len(cue), replace=False)] = cue
            reviews.append(words.tolist())
            labels.append(label)
        sequences = np.empty(count, dtype=object)
        sequences[:] = reviews
        return sequences, np.array(labels, dtype="int64")

    return make(train), make(test)
