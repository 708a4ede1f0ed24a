"""The data cells the suites run: sklearn's digits (1797 samples, 10 classes), as rows and as
images. Cells, not arrays: they run in the test shell's namespace, as a notebook's would."""

# `x`: 64 pixels a row in [0, 1]; `y`: the digit
DIGITS = """
from sklearn.datasets import load_digits
digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
"""

# `images`: the digits as 16x16 one-channel images (each pixel doubled), for the CNNs
IMAGES = ('images = np.repeat(np.repeat(digits.images[..., None] / 16.0, 2, 1), 2, 2)'
          '.astype("float32")\n')

# the TensorFlow suite's data cell (tests/conftest.py's `digits` fixture)
SETUP = "\nimport numpy as np, keras, tensorflow as tf" + DIGITS

# 256 random rows of 32 features and a float target (unseeded: both ways draw after the
# same seed), the published patterns' regression data
REGRESSION_DATA = """
x = np.random.random((256, 32)).astype("float32")
y = np.random.random((256, 1)).astype("float32")
"""
