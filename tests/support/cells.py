"""Notebook cells the tests run, shared by the test modules."""

DENSE = """
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
"""

# a model worth laying out over a mesh (--shard model): its embedding and kernels are split
SHARDED = """
keras.utils.set_random_seed(5)
tokens = np.random.RandomState(0).randint(0, 1024, (203, 16))
targets = np.random.RandomState(1).randint(0, 1024, (203, 16))
inputs = keras.Input((16,), dtype="int32")
hidden = keras.layers.Embedding(1024, 512)(inputs)
hidden = keras.layers.MultiHeadAttention(num_heads=8, key_dim=64)(hidden, hidden)
hidden = keras.layers.Dense(1024, activation="relu")(hidden)
sharded = keras.Model(inputs, keras.layers.Dense(1024)(hidden))
sharded.compile(keras.optimizers.SGD(0.05),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = sharded.fit(tokens, targets, batch_size=32, epochs=2, shuffle=False, verbose=0)
"""


def train(ip, cell, line="--no-progress"):
    return ip.run_cell_magic("tpu_train", line, cell)
