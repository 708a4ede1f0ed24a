"""Published Keras code on JAX, 8 simulated devices beside one (this folder: the JAX
suite's `published` part, tests/test_jax.py). The fixtures are tests/jax_backend/conftest.py's.

Each test follows one keras-io example or guide, or a KerasHub fine-tuning pattern, named by
its path in keras-team/keras-io (or keras-team/keras-hub) in a comment above it. The code is
written here in our own words with the example's layers, compile and fit arguments, on small
synthetic data of the example's shapes instead of its download (no network), with sample
counts that 8 does not divide. None of these examples is used by the other published-code
suites (tests/training/published/test_published.py, tests/training/published/test_published_patterns.py).

Every cell runs twice from the same seed (`support.same.both`): plainly, with Keras on JAX on
one device and no tpu_magic, and through `%%tpu_train` over 8 simulated devices
(`keras.distribution.DataParallel`, TensorFlow blocked as on Colab's TPU image, so the data
comes as NumPy arrays, grain datasets, `keras.utils.PyDataset`s or Python generators). What
the two runs must share is what plain Keras makes deterministic: the same history (losses
and metrics, rel 1e-4) where both see the same batches in the same order, the same
`predict` rows and values, `evaluate` equal to the `%tpu_sync` CPU copy's, and `fit` at
learning rate 0 equal to `evaluate` where the model has no Dropout or BatchNorm.

The cells are ordinary notebook cells: unseeded layers (the seed is the notebook's), a
vocabulary large enough that the embedding dominates, layers adapted or models built in an
earlier plain cell, trainable sets changed between fits, the user's own
`keras.distribution`, `*_on_batch` calls with row counts 8 does not divide.
"""
