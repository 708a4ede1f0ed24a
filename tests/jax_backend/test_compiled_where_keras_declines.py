"""Steps Keras runs op by op on JAX only for TensorFlow's sake are compiled
(`backends/jax/declined.py`): a model holding Keras's coordinate-transforming image
augmentation layers (RandomRotation, RandomZoom, RandomTranslation, ...) trains on plain
Keras's numbers, said in a note; a layer that truly cannot compile, and `run_eagerly=True`,
leave the model as Keras made it."""

from support.cells import train
from support.same import both, same_history

IMAGES = """
rs = np.random.RandomState(2)
images = rs.rand(200, 24, 24, 3).astype("float32")
labels = rs.randint(0, 10, 200)
"""
AUGMENTED = """
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((24, 24, 3)),
                          keras.layers.RandomFlip("horizontal"), keras.layers.RandomRotation(0.1),
                          keras.layers.RandomZoom(0.2), keras.layers.RandomTranslation(0.1, 0.1),
                          keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.GlobalAveragePooling2D(), keras.layers.Dropout(0.2),
                          keras.layers.Dense(10)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"]{eagerly})
history = model.fit(images, labels, batch_size=32, epochs=2, validation_split=0.2,
                    shuffle=False, verbose=0)
"""


def test_augmentation_layers_keras_runs_op_by_op_are_compiled_with_its_numbers(ip):
    plain, ours, report = both(ip, IMAGES, AUGMENTED.format(eagerly=""))
    assert any("holds RandomRotation, RandomTranslation, RandomZoom, which Keras runs op by "
               "op" in note for note in report.notes), report.notes
    assert ip.user_ns["model"].jit_compile is True and not plain["model"].jit_compile
    same_history(plain, ours)


def test_run_eagerly_and_a_layer_of_the_users_own_keep_the_model_as_keras_made_it(ip):
    ip.run_cell(IMAGES)
    report = train(ip, AUGMENTED.format(eagerly=", run_eagerly=True"))
    assert not any("op by op" in note for note in report.notes), report.notes
    mine = AUGMENTED.format(eagerly="").replace(
        "keras.layers.RandomRotation(0.1)", "Turn(0.1)")
    ip.run_cell("class Turn(keras.layers.RandomRotation):\n    pass\n")
    report = train(ip, mine)
    assert not any("op by op" in note for note in report.notes), report.notes
    assert ip.user_ns["model"].jit_compile is False
