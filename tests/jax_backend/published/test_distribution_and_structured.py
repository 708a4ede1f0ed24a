"""Published Keras code on JAX, 8 simulated devices beside one: keras.distribution, tables.

How they are written and compared: this folder's conftest.py.
"""

from support.same import (both, evaluate_equals_cpu_copy, fit_equals_evaluate_at_lr0, run_cell,
                         same_history, same_values, same_weights)


# -- The user's own keras.distribution -------------------------------------------------------

# guides/distribution.py, "DataParallel": the guide sets a DataParallel over all devices
# process-wide with `set_distribution`, then builds, compiles and trains its MNIST MLP.
# 200 samples: plain Keras under the user's own DataParallel needs whole per-device shares.
def test_the_distribution_guides_data_parallel_set_in_the_cell(ip):
    setup = """
x = np.random.random((200, 28, 28, 1)).astype("float32")
y = keras.utils.to_categorical(np.random.randint(0, 10, 200), 10)
"""
    cell = """
data_parallel = keras.distribution.DataParallel()
keras.distribution.set_distribution(data_parallel)
inputs = keras.layers.Input(shape=(28, 28, 1))
h = keras.layers.Flatten()(inputs)
h = keras.layers.Dense(units=200, activation="relu")(h)
h = keras.layers.Dropout(0.4)(h)
outputs = keras.layers.Dense(units=10, activation="softmax")(h)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(loss="mse", optimizer="adam")
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
active = type(keras.distribution.distribution()).__name__
"""
    try:
        plain, ours, _ = both(ip, setup, cell)
        same_history(plain, ours)
        assert ours["active"] == plain["active"] == "DataParallel"
        # set_distribution is process-wide in Keras: the next cell still has it
        run_cell(ip, "still = type(keras.distribution.distribution()).__name__")
        assert ip.user_ns["still"] == "DataParallel"
    finally:
        run_cell(ip, "keras.distribution.set_distribution(None)")


# guides/distribution.py, "ModelParallel and LayoutMap": a 2x4 mesh, d1's kernel and bias
# split over "model", d2's output over "data". 202 samples: the last batch (10) splits
# over the 2 "data" rows, as plain Keras needs.
def test_the_distribution_guides_model_parallel_layout_map_is_kept(ip):
    setup = """
x = np.random.random((202, 784)).astype("float32")
y = np.random.randint(0, 10, 202)
"""
    cell = """
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=["data", "model"], devices=devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*d1/kernel"] = (None, "model")  # Keras 3.15 matches a key to a whole path
layout_map[".*d1/bias"] = ("model",)
layout_map[".*d2/output"] = ("data", None)
model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
keras.distribution.set_distribution(model_parallel)
model = keras.Sequential([
    keras.layers.Input(shape=(784,)),
    keras.layers.Dense(200, activation="relu", name="d1"),
    keras.layers.Dense(10, activation="softmax", name="d2"),
])
model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
kernel_spec = tuple(model.get_layer("d1").kernel.value.sharding.spec)
evaluation = model.evaluate(x, y, batch_size=64, return_dict=True, verbose=0)
rows = model.predict(x[:10], verbose=0)
"""
    try:
        plain, ours, _ = both(ip, setup, cell)
        assert ours["kernel_spec"] == plain["kernel_spec"] == (None, "model")
        same_history(plain, ours)
        same_values(plain, ours, "evaluation")
        same_values(plain, ours, "rows")
    finally:
        run_cell(ip, "keras.distribution.set_distribution(None)")


# -- Structured data -------------------------------------------------------------------------

# examples/structured_data/structured_data_classification_with_feature_space.py: FeatureSpace
# needs tf.data, so its preprocessing (one-hot categories, normalized numbers) is done in
# NumPy; the model, compile and fit are the example's, fed grain datasets of batch 32 with a
# short last batch (203 = 6 x 32 + 11), validation as a dataset too.
FEATURES = """
import grain
rs = np.random.RandomState(1)
def encoded(n):
    categorical = np.concatenate([np.eye(k)[rs.randint(0, k, n)] for k in (2, 4, 5, 3, 2, 4, 3)], 1)
    numerical = rs.normal(size=(n, 6))
    numerical = (numerical - numerical.mean(0)) / numerical.std(0)
    return np.concatenate([categorical, numerical], 1).astype("float32")
train_features, val_features = encoded(203), encoded(51)
train_target = rs.randint(0, 2, (203, 1)).astype("float32")
val_target = rs.randint(0, 2, (51, 1)).astype("float32")
def rows(features, target):
    return grain.MapDataset.source(np.arange(len(features))).map(
        lambda i: (features[i], target[i]))
train_ds = rows(train_features, train_target).batch(32)
val_ds = rows(val_features, val_target).batch(32)
"""


def test_feature_space_classification_on_grain_datasets(ip):
    plain, ours, _ = both(ip, FEATURES, """
inputs = keras.Input(shape=(train_features.shape[1],))
h = keras.layers.Dense(32, activation="relu")(inputs)
h = keras.layers.Dropout(0.5)(h)
predictions = keras.layers.Dense(1, activation="sigmoid")(h)
model = keras.Model(inputs, predictions)
model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
history = model.fit(train_ds, epochs=3, validation_data=val_ds, verbose=0)
evaluation = model.evaluate(val_ds, return_dict=True, verbose=0)
probabilities = model.predict(val_ds, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    assert ours["probabilities"].shape == (51, 1)
    same_values(plain, ours, "probabilities")


# examples/structured_data/collaborative_filtering_movielens.py: a subclassed RecommenderNet,
# user and movie embeddings (the embeddings are nearly all of its weights) with L2, a dot
# product by `keras.ops.tensordot`, BinaryCrossentropy; fit with validation data.
# (The example shuffles; here shuffle=False so both runs see the same batches.)
def test_collaborative_filtering_with_big_embeddings(ip):
    plain, ours, _ = both(ip, """
num_users, num_movies, EMBEDDING_SIZE = 610, 9724, 50
rs = np.random.RandomState(2)
pairs = np.stack([rs.randint(0, num_users, 1003), rs.randint(0, num_movies, 1003)], 1)
ratings = rs.uniform(0, 1, 1003).astype("float32")
x_train, x_val, y_train, y_val = pairs[:901], pairs[901:], ratings[:901], ratings[901:]

class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = keras.layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.user_bias = keras.layers.Embedding(num_users, 1)
        self.movie_embedding = keras.layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.movie_bias = keras.layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = keras.ops.tensordot(user_vector, movie_vector, 2)
        x = dot_user_movie + user_bias + movie_bias
        return keras.ops.nn.sigmoid(x)
""", """
model = RecommenderNet(num_users, num_movies, EMBEDDING_SIZE)
model.compile(loss=keras.losses.BinaryCrossentropy(),
              optimizer=keras.optimizers.Adam(learning_rate=0.001))
history = model.fit(x=x_train, y=y_train, batch_size=64, epochs=3, shuffle=False, verbose=0,
                    validation_data=(x_val, y_val))
scores = model.predict(x_val[:13], verbose=0)
evaluation = model.evaluate(x_val, y_val, return_dict=True, verbose=0)
""")
    # The dot product sums over the whole batch too: padded rows would change every row's
    # score, so on JAX nothing is padded. (RecommenderNet has no get_config, so %tpu_sync
    # refuses it with the fix, as Keras's own saving does.)
    same_history(plain, ours)
    same_values(plain, ours, "scores")
    same_values(plain, ours, "evaluation")
    same_weights(plain, ours)


# -- Custom layers with keras.ops ------------------------------------------------------------

# examples/keras_recipes/antirectifier.py: a layer of its own written with keras.ops
# (centering, L2 normalization, both signs' ReLUs concatenated, its own kernel), in an MLP
# compiled with RMSprop and SparseCategoricalAccuracy; fit with validation_split=0.15.
ANTIRECTIFIER = """
class Antirectifier(keras.layers.Layer):
    def __init__(self, initializer="he_normal", **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        output_dim = input_shape[-1]
        self.kernel = self.add_weight(shape=(output_dim * 2, output_dim),
                                      initializer=self.initializer, name="kernel",
                                      trainable=True)

    def call(self, inputs):
        inputs -= keras.ops.mean(inputs, axis=-1, keepdims=True)
        pos = keras.ops.relu(inputs)
        neg = keras.ops.relu(-inputs)
        concatenated = keras.ops.concatenate([pos, neg], axis=-1)
        return keras.ops.matmul(concatenated, self.kernel)

    def get_config(self):
        config = super().get_config()
        config.update({"initializer": keras.initializers.serialize(self.initializer)})
        return config

x_train = np.random.random((611, 784)).astype("float32")
y_train = np.random.randint(0, 10, 611)
"""


def test_antirectifier_layer_written_with_keras_ops(ip):
    plain, ours, _ = both(ip, ANTIRECTIFIER, """
model = keras.Sequential([
    keras.Input(shape=(784,)),
    keras.layers.Dense(256),
    Antirectifier(),
    keras.layers.Dense(256),
    Antirectifier(),
    keras.layers.Dense(10),
])
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=keras.optimizers.RMSprop(),
              metrics=[keras.metrics.SparseCategoricalAccuracy()])
history = model.fit(x_train, y_train, batch_size=128, epochs=2, validation_split=0.15,
                    shuffle=False, verbose=0)
""")
    same_history(plain, ours)
    same_weights(plain, ours)
    evaluate_equals_cpu_copy(ip, "model", "x_train[:77]", "y_train[:77]")
    fit_equals_evaluate_at_lr0(ip, "model", "x_train[:203]", "y_train[:203]", 64)
