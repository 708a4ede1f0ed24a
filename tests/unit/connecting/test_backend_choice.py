"""Which Keras backend `%tpu_connect` chooses, decided without importing either (pure)."""

import os
import sys

import pytest

from tpu_magic.backends import choose_backend
from tpu_magic.connecting import doctor
from tpu_magic.connecting.connect import connect, imported_first
from tpu_magic.core.errors import ConnectError, MissingDependencyError
from tpu_magic.core.session import session
from tpu_magic.core.target import MachineSigns

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


@pytest.mark.parametrize("requested, importable, command", [
    ("tf", {"jax"}, "`pip install tensorflow`"),  # a [jax] install, Colab's TPU image
    ("jax", {"tensorflow"}, '`pip install "tpu_magic[jax]"`'),
])
def test_a_backend_whose_framework_is_missing_is_one_line_naming_the_install_command(
        requested, importable, command):
    with pytest.raises(MissingDependencyError) as refused:
        choose_backend(requested, None, {}, False, JAX, importable=frozenset(importable))
    message = str(refused.value)
    assert message.startswith(f"--backend {requested}: ") and command in message
    assert "\n" not in message


@pytest.mark.parametrize("configured, importable, env, backend, why", [
    ("jax", {"jax", "tensorflow"}, {}, "jax", "keras.json names jax"),
    # Keras writes its default there on its first import: no one chose it
    ("tensorflow", {"jax", "tensorflow"}, {}, "tf", "the default"),
    ("tensorflow", {"jax"}, {}, "jax", "TensorFlow cannot be imported here"),
    ("jax", {"tensorflow"}, {}, "tf", "the default"),  # named, but JAX is not there
    ("jax", {"jax", "tensorflow"}, {"KERAS_BACKEND": "tensorflow"}, "tf", "KERAS_BACKEND"),
])
def test_auto_follows_a_backend_keras_json_names_other_than_kerass_default(
        configured, importable, env, backend, why):
    choice = choose_backend("auto", None, env, False, JAX, importable=frozenset(importable),
                            configured=configured)
    assert choice.backend == backend and why in choice.reason


@pytest.mark.parametrize("backend, env, configured, importable, later", [
    # --backend jax beside TensorFlow: Keras wrote "tensorflow" on its first import
    ("jax", {}, "tensorflow", {"jax", "tensorflow"}, "tensorflow"),
    ("tf", {}, "jax", {"jax", "tensorflow"}, "jax"),
    ("jax", {}, "jax", {"jax", "tensorflow"}, None),  # the same backend
    ("jax", {}, "tensorflow", {"jax"}, None),  # %load_ext puts it right (no TensorFlow)
    ("jax", {"KERAS_BACKEND": "jax"}, "tensorflow", {"jax", "tensorflow"}, None),  # user's
    ("jax", {}, None, {"jax", "tensorflow"}, None),  # Keras could not write it
    ("jax", {}, "torch", {"jax", "tensorflow"}, None),  # torch is not what it looks for
])
def test_a_later_sessions_keras_backend_is_said_where_keras_json_names_another(
        backend, env, configured, importable, later):
    from tpu_magic.backends import later_sessions_note

    note = later_sessions_note(backend, env, configured, frozenset(importable),
                               "~/.keras/keras.json")
    if later is None:
        assert note is None
    else:
        wanted = {"tf": "tensorflow", "jax": "jax"}[backend]
        assert note == (f"~/.keras/keras.json names {later}, so a later session that imports "
                        f"keras before %tpu_connect starts Keras on {later}; to make {wanted} "
                        f'its default, set "backend": "{wanted}" there (or '
                        f"KERAS_BACKEND={wanted})")


@pytest.mark.parametrize("set_to, installed, tpu_vm, backend", [
    ("torch", {}, False, "tensorflow"),
    ("torch", JAX, True, "jax"),
    ("numpy", {}, False, "tensorflow"),
])
def test_a_keras_backend_tpu_magic_cannot_use_is_said_not_replaced_silently(set_to, installed,
                                                                          tpu_vm, backend):
    choice = choose_backend("auto", None, {"KERAS_BACKEND": set_to}, tpu_vm, installed)
    assert choice.reason.startswith(f"KERAS_BACKEND={set_to} is set, but tpu_magic trains with "
                                    f"tensorflow or jax, so it uses {backend} (")


def test_a_target_a_backend_refuses_is_refused_before_any_framework_is_imported(monkeypatch):
    # The unit suite's conftest fails the run if keras, TensorFlow or JAX was imported.
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    with pytest.raises(ConnectError, match="JAX reaches TPUs on TPU VMs .*not a TPU node at "
                                           r"grpc://127\.0\.0\.1:8470: use `--backend tf`"):
        connect("grpc://127.0.0.1:8470", backend="jax", env={}, signs=MachineSigns(),
                probe_tf=lambda address, timeout: pytest.fail("nothing may be probed"))
    assert "KERAS_BACKEND" not in os.environ and "keras" not in sys.modules
    assert session() is None


@pytest.mark.parametrize("env, restart", [
    ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "Run > Restart & clear cell outputs"),
    ({"COLAB_RELEASE_TAG": "x"}, "Runtime > Restart session"),
    ({}, "restart the runtime"),
])
def test_keras_imported_with_tensorflow_first_on_a_jax_tpu_vm_names_the_cause(env, restart):
    message = imported_first("tf", env)
    assert message.startswith("keras was imported with the TensorFlow backend before "
                              "%tpu_connect, and on this TPU VM only JAX can use the TPU")
    assert f"Restart ({restart}), then run `%load_ext tpu_magic` and `%tpu_connect` first" \
        in message


def test_the_doctor_does_not_blame_the_user_for_a_backend_tpu_magic_chose():
    by_us = doctor.Runtime(keras_backend="jax", keras_by_us=True)
    by_user = doctor.Runtime(keras_backend="jax")
    assert "an earlier %tpu_connect in this process started Keras on jax" in \
        str(doctor.diagnose(by_us, backend="tf")[0])
    assert "keras was imported with the jax backend before %tpu_connect" in \
        str(doctor.diagnose(by_user, backend="tf")[0])


@pytest.mark.parametrize("imported, tpu_vm, installed, took", [
    ("tensorflow", True, JAX, True),      # Kaggle: keras imported first, with tensorflow-cpu
    ("jax", True, JAX, False),            # keras on JAX already: JAX has the TPU
    ("tensorflow", True, TF_TPU, False),  # TensorFlow's own TPU build is there
    ("tensorflow", False, JAX, False),    # no TPU VM
    (None, True, JAX, False),             # nothing imported yet: auto takes JAX
])
def test_when_an_imported_tensorflow_keras_took_a_jax_tpu(imported, tpu_vm, installed, took):
    from tpu_magic.backends import tensorflow_took_a_jax_tpu

    choice = choose_backend("auto", imported, {}, tpu_vm, installed)
    assert tensorflow_took_a_jax_tpu(choice, tpu_vm, installed) is took


@pytest.mark.parametrize("imported, env, configured, importable, jax_default", [
    (False, {}, None, {"jax"}, True),  # Colab's TPU image, a clean [jax] install
    (False, {}, None, {"jax", "tensorflow"}, False),  # Keras's own default works
    (True, {}, None, {"jax"}, False),  # keras is imported already: its backend stands
    (False, {"KERAS_BACKEND": "torch"}, None, {"jax"}, False),  # the user's choice stands
    (False, {}, "torch", {"jax"}, False),  # keras.json's too
    (False, {}, None, set(), False),  # no JAX either: nothing to choose
    # keras.json names tensorflow because Keras wrote its default there on its first import
    # (a [jax] install's second session): TensorFlow still cannot be imported
    (False, {}, "tensorflow", {"jax"}, True),
    (False, {}, "tensorflow", {"jax", "tensorflow"}, False),
    (False, {}, "jax", {"jax"}, False),  # Keras takes JAX from keras.json by itself
])
def test_load_ext_makes_jax_keras_default_only_where_tensorflow_cannot_be_imported(
        imported, env, configured, importable, jax_default):
    from tpu_magic.backends import keras_default_is_jax

    assert keras_default_is_jax(imported, env, configured, importable) is jax_default
