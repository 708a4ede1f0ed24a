"""Notebook cells the tests run, shared by the test modules."""

SETUP = """
import numpy as np, keras, tensorflow as tf
from sklearn.datasets import load_digits
digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
"""

DENSE = """
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


def train(ip, cell, line="--no-progress"):
    return ip.run_cell_magic("tpu_train", line, cell)
