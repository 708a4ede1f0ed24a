"""Keras on TensorFlow: `tf.distribute` strategies, tf.data inputs, mirrored variables.
`backend.py` holds the `Backend` object; each other module does one of its jobs. Importing
this package imports no framework."""
