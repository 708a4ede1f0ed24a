"""The pure parts of several hosts: `--simulate HxD`, and one message for every host's error."""

import pytest

from tpu_magic.core.errors import HostsError
from tpu_magic.hosts.cluster import parse_layout
from tpu_magic.hosts.outcome import HostOutcome, failure_message


def test_hosts_by_devices():
    assert parse_layout("2x4") == (2, 4) and parse_layout(" 4 × 8 ") == (4, 8)
    for bad in ("2x", "x4", "0x4", "2x0", "two", "2x4x1"):
        with pytest.raises(HostsError, match=f"--simulate '{bad}': write N .* or HxD"):
            parse_layout(bad)


def test_each_distinct_error_once_with_its_hosts_and_line():
    line = (3, "missing = undefined + 1")
    name_error = ("NameError", "name 'undefined' is not defined")
    outcomes = [HostOutcome(1, "b", error=name_error, line=line),
                HostOutcome(0, "a", error=name_error, line=line),
                HostOutcome(2, "c", error=("ValueError", "bad shape"), line=(5, "fit(x)")),
                HostOutcome(3, "d")]
    message = failure_message(outcomes)
    assert message.count("NameError") == 1 and message.count("ValueError") == 1
    assert message.startswith("the cell failed on host 0 (a), host 1 (b): line 3 of the cell, "
                              "`missing = undefined + 1`: NameError: name 'undefined' is not "
                              "defined; and on host 2 (c): line 5")
    same = [HostOutcome(i, "h", error=("UsageError", "batch_size 30 ...")) for i in range(2)]
    assert failure_message(same) == ("the cell failed on host 0 (h), host 1 (h) (every host): "
                                     "batch_size 30 ...")
    assert failure_message([HostOutcome(0, "a"), HostOutcome(1, "b")]) is None
