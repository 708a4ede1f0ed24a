"""Which Keras backend `%tpu_connect` chooses, decided without importing either (pure)."""

import pytest

from tpu_magic.backends import choose_backend
from tpu_magic.core.errors import ConnectError

JAX = {"jax": "0.10.2"}
TF_TPU = {"tensorflow-tpu": "2.21.0", "jax": "0.10.2"}


@pytest.mark.parametrize("requested, imported, env, tpu_vm, installed, backend, why", [
    ("auto", "jax", {}, False, {}, "jax", "already imported with the jax backend"),
    ("auto", "tensorflow", {"KERAS_BACKEND": "jax"}, False, JAX, "tf", "already imported"),
    ("auto", None, {"KERAS_BACKEND": "jax"}, False, JAX, "jax", "KERAS_BACKEND=jax"),
    ("auto", None, {}, True, JAX, "jax", "TensorFlow has no TPU runtime"),
    ("auto", None, {}, True, TF_TPU, "tf", "the default"),
    ("auto", None, {}, False, JAX, "tf", "the default"),
    ("jax", None, {"KERAS_BACKEND": "tensorflow"}, False, JAX, "jax", "--backend jax"),
    ("TensorFlow", "tensorflow", {}, False, {}, "tf", "--backend tf"),
])
def test_the_backend_choice(requested, imported, env, tpu_vm, installed, backend, why):
    choice = choose_backend(requested, imported, env, tpu_vm, installed)
    assert choice.backend == backend and why in choice.reason


@pytest.mark.parametrize("importable, env, tpu_vm, backend, why", [
    # Colab's TPU image: JAX and Keras, no TensorFlow; --simulate or not, no backend named.
    ({"jax"}, {}, False, "jax", "TensorFlow cannot be imported here and JAX can"),
    ({"jax"}, {}, True, "jax", "TensorFlow cannot be imported here and JAX can"),
    ({"jax"}, {"KERAS_BACKEND": "tensorflow"}, False, "tf", "KERAS_BACKEND=tensorflow"),
    ({"jax", "tensorflow"}, {}, False, "tf", "the default"),
    (set(), {}, False, "tf", "the default"),  # neither: connect then says how to install
])
def test_auto_takes_jax_where_tensorflow_cannot_be_imported(importable, env, tpu_vm, backend,
                                                           why):
    choice = choose_backend("auto", None, env, tpu_vm, JAX, importable=frozenset(importable))
    assert choice.backend == backend and why in choice.reason


@pytest.mark.parametrize("requested, imported, message", [
    ("jax", "tensorflow", "already imported with the tensorflow backend, and a running process "
                          "cannot switch it to jax. Restart the runtime, then run `%tpu_connect "
                          "--backend jax` before importing keras"),
    ("auto", "torch", "imported with the torch backend; tpu_magic trains with tensorflow or jax"),
    ("pytorch", None, "--backend 'pytorch': use tf, jax or auto"),
])
def test_impossible_backends_say_what_to_do(requested, imported, message):
    with pytest.raises(ConnectError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        choose_backend(requested, imported, {}, False, JAX)
