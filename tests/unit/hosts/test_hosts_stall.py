"""The watch for a host that holds the others up (issue 32): pure, on what engines published."""

from tpu_magic.hosts.progress import COMPILING, StallWatch


def engine(calls=0, inside=None, open_bars=(), closed=(), time=1.0):
    """What an engine published: Keras calls begun, the one it is in, its bars (desc, n)."""
    bars = {i: {"desc": d, "n": n, "closed": False} for i, (d, n) in enumerate(open_bars)}
    bars.update({100 + i: {"desc": d, "n": n, "closed": True} for i, (d, n) in enumerate(closed)})
    return {"bars": bars, "calls": calls, "inside": inside, "time": time}


def test_the_compiling_name_is_the_one_the_cell_gives_its_bar():
    import ast
    from pathlib import Path

    import tpu_magic

    source = Path(tpu_magic.__file__).parent / "training" / "fit" / "progress.py"  # imports Keras
    names = {node.targets[0].id: node.value.value for node in ast.parse(source.read_text()).body
             if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    assert COMPILING == names["COMPILING"]


def test_a_host_that_never_reached_the_call_the_others_wait_in_is_named_after_the_timeout():
    watch = StallWatch(2, timeout=10, now=0)
    waiting = [engine(1, "fit"), None]  # host 1 never came to the cell's fit
    assert watch.stuck(waiting, now=1) == []  # something new: the clock starts again
    assert watch.stuck(waiting, now=10.5) == []
    assert watch.stuck(waiting, now=11.5) == [1]
    watch = StallWatch(2, timeout=10, now=0)
    inside_a_step = [engine(1, "fit", [("epochs", 0), ("epoch 1/2", 3)]), engine(0)]
    watch.stuck(inside_a_step, now=0)
    assert watch.stuck(inside_a_step, now=11) == [1]


def test_progress_anywhere_restarts_the_clock():
    watch = StallWatch(2, timeout=10, now=0)
    for t in range(0, 60, 5):  # both move every 5 s
        bars = [("epochs", 0), ("epoch 1/9", t)]
        state = [engine(1, "fit", bars, time=t), engine(1, "fit", bars, time=t)]
        assert watch.stuck(state, now=t + 0.1) == []


def test_the_hosts_furthest_behind_are_named_when_every_host_stopped_inside():
    watch = StallWatch(3, timeout=5, now=0)
    state = [engine(1, "fit", [("epochs", 1), ("epoch 2/3", 7)]),
             engine(1, "fit", [("epochs", 1), ("epoch 2/3", 6)]),
             engine(1, "fit", [("epochs", 1), ("epoch 2/3", 7)])]
    watch.stuck(state, now=0)
    assert watch.stuck(state, now=6) == [1]
    level = [engine(2, "evaluate")] * 3
    watch = StallWatch(3, timeout=5, now=0)
    watch.stuck(level, now=0)
    assert watch.stuck(level, now=6) == [0, 1, 2]  # every host: a hang in a collective
    # one host done with its first call, one inside its second: the one still in the first
    mixed = [engine(1, None), engine(2, "evaluate"), engine(1, "fit", [("epochs", 0)])]
    watch = StallWatch(3, timeout=5, now=0)
    watch.stuck(mixed, now=0)
    assert watch.stuck(mixed, now=6) == [2]


def test_the_cells_own_code_and_a_first_step_compiling_everywhere_are_never_a_stall():
    watch = StallWatch(2, timeout=5, now=0)
    # before any Keras call (a download, a model being built) or between calls
    outside = [engine(1, None, closed=[("epochs", 2)]), None]
    watch.stuck(outside, now=0)
    assert watch.stuck(outside, now=600) == []
    compiling = [engine(1, "fit", [("epochs", 0), (COMPILING, 0)], time=2)] * 2
    watch.stuck(compiling, now=0)
    assert watch.stuck(compiling, now=600) == []  # a big model's first step: minutes
    # one host compiling, the other not even there: it is the one the first waits for
    one = [engine(1, "fit", [("epochs", 0), (COMPILING, 0)], time=3), None]
    watch.stuck(one, now=0)
    assert watch.stuck(one, now=6) == [1]
