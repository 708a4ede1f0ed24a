"""The per-notebook workspace: one guard for every action a running job would disturb."""

import gc

import pytest

from tpu_magic.core.errors import BusyError
from tpu_magic.notebook.workspace import Workspace, workspace_of


class FakeJob:
    def __init__(self, done: bool):
        self._done = done

    def done(self) -> bool:
        return self._done


@pytest.mark.parametrize("action", ["%tpu_sync", "Sync", "Save", "%tpu_connect", "%%tpu_train",
                                    "Train"])
def test_every_action_waits_for_a_running_job_with_one_message(action):
    workspace = Workspace(job=FakeJob(done=False))
    with pytest.raises(BusyError, match=f"^{action} waits: a training job started from the panel "
                                        r"is running\. Press Stop, or wait for it "
                                        r"\(tpu_magic.workspace\(\).job.result\(\)\)\.$"):
        workspace.require_idle(action)
    Workspace(job=FakeJob(done=True)).require_idle(action)  # a finished job is no obstacle
    Workspace().require_idle(action)


def test_a_new_connection_starts_afresh_and_the_same_one_keeps_everything():
    workspace = Workspace()
    first, second = object(), object()
    workspace.connected(first)
    workspace.panel = "panel"
    model = Model()
    workspace.trained(model, "m", "fit")
    workspace.connected(first)
    assert (workspace.panel, workspace.last_model_name, workspace.last_fit) == ("panel", "m", "fit")
    workspace.connected(second)
    assert (workspace.panel, workspace.last_model, workspace.last_fit) == (None, None, None)
    assert workspace.connection is second


class Model:
    """A stand-in model (any object a weak reference can name)."""


def test_the_model_trained_last_is_held_only_while_the_notebook_holds_it():
    # plain Keras lets a model go when the notebook does (a cell run again assigns `model`):
    # the workspace must not keep its device memory alive beside the new model's
    workspace, model = Workspace(), Model()
    workspace.trained(model, "model", "its fit")
    assert workspace.last_model is model and workspace.last_fit == "its fit"
    del model
    gc.collect()
    assert (workspace.last_model, workspace.last_fit) == (None, None)


def test_each_shell_has_its_own_workspace():
    class Shell:
        pass

    one, two = Shell(), Shell()
    assert workspace_of(one) is workspace_of(one) and workspace_of(one) is not workspace_of(two)


def test_a_report_keeps_what_its_first_step_comparison_remembers():
    # `parity.compare.Parity.remembered`: the setup, marked where only every replica
    # computing the whole batch agreed; None (nothing kept) where nothing agreed
    class Report:
        def __init__(self, remembered):
            self.parity = type("Compared", (), {"remembered": remembered})()

    workspace = Workspace()
    for remembered in ("a", "whole batch b", None):
        workspace.reported(Report(remembered))
    workspace.reported(type("NoParity", (), {"parity": None})())
    assert workspace.agreed == {"a", "whole batch b"}
