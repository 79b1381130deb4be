"""Bad arguments of ``AsyncCheckpointIO`` and ``AsyncFinalizerCallback`` are refused where they are given, with
a message that names the argument, what was given and the fix; nothing starts or is written first."""

from __future__ import annotations

import pytest

from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback
from lightning_asyncckpt.testing import Fault, FaultList


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"thread_count": 2.5}, r"AsyncCheckpointIO\(thread_count=2\.5\)` must be an integer, at least 1; got float"),
    ({"thread_count": True}, r"AsyncCheckpointIO\(thread_count=True\)` must be an integer, at least 1; got bool"),
    ({"thread_count": "4"}, r"thread_count='4'\)` must be an integer.*got str.*pass the number 4, not a string"),
    ({"thread_count": 0}, r"thread_count=0\)` must be an integer, at least 1"),
    ({"max_pending": 1.5}, r"max_pending=1\.5\)` must be an integer, at least 1; got float"),
    ({"max_pending": False}, r"max_pending=False\)` must be an integer"),
    ({"timeout_s": "10"}, r"timeout_s='10'\)` must be a number of seconds.*got str.*pass the number 10, not a string"),
    ({"timeout_s": float("nan")}, r"timeout_s=nan\)` must be a number of seconds > 0 and at most 31536000"),
    ({"timeout_s": float("inf")}, r"timeout_s=inf\)` must be a number of seconds > 0 and at most 31536000"),
    ({"timeout_s": True}, r"timeout_s=True\)` must be a number of seconds.*got bool"),
    ({"timeout_s": 0}, r"timeout_s=0\)`"),
    ({"drain_timeout_s": float("inf")}, r"drain_timeout_s=inf\)` must be a number of seconds >= 0 and at most"),
    ({"drain_timeout_s": None}, r"drain_timeout_s=None\)` must be a number of seconds.*got NoneType"),
    ({"poll_interval_s": float("nan")}, r"poll_interval_s=nan\)` must be a number of seconds > 0"),
    ({"poll_interval_s": "0.1"}, r"poll_interval_s='0.1'\)`.*pass the number 0.1, not a string"),
    ({"worker_nice": 5.0}, r"worker_nice=5\.0\)` must be an integer"),
    ({"format": 1}, r"format=1\)` is not valid"),
    ({"faults": "x"}, r"AsyncCheckpointIO\(faults='x'\)` takes a fault policy.*FaultList\(\[Fault\(.*LIGHTNING_ASYNCCKPT_FAULTS"),
    ({"faults": [Fault("eio")]}, r"faults=\[.*\]\)` takes a fault policy.*FaultList\("),
])
def test_bad_arguments_are_refused_naming_the_argument_and_the_fix(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        AsyncCheckpointIO(**kwargs)


def test_an_assigned_setting_is_checked_as_the_argument_is():
    io = AsyncCheckpointIO(thread_count=3, timeout_s=10, max_pending=1)
    assert (io.settings.thread_count, io.settings.timeout_s, io.settings.max_pending) == (3, 10.0, 1)
    with pytest.raises(TypeError, match=r"thread_count=2\.5\)` must be an integer"):
        io.session.configure(thread_count=2.5)
    with pytest.raises(ValueError, match=r"timeout_s=inf\)"):
        io.session.configure(timeout_s=float("inf"))
    assert io.settings.thread_count == 3 and io.settings.timeout_s == 10.0
    assert io.session.configure(timeout_s=60).timeout_s == io.settings.timeout_s == 60.0


def test_numbers_of_other_types_are_taken_as_their_values():
    np = pytest.importorskip("numpy")
    io = AsyncCheckpointIO(thread_count=np.int64(2), timeout_s=np.float32(5.5), max_pending=np.int32(3))
    assert (io.settings.thread_count, io.settings.timeout_s, io.settings.max_pending) == (2, 5.5, 3)
    assert type(io.settings.thread_count) is int and type(io.settings.timeout_s) is float


def test_a_fault_policy_is_taken_and_a_fault_list_holds_faults():
    AsyncCheckpointIO(faults=FaultList([Fault("eio")]))
    with pytest.raises(TypeError, match=r"FaultList\(faults=\.\.\.\) takes a sequence of Fault\(\.\.\.\); got str 'write'"):
        FaultList("write")


def test_the_callback_takes_a_bool():
    with pytest.raises(TypeError, match=r"AsyncFinalizerCallback\(log_metrics='no'\)` must be True or False"):
        AsyncFinalizerCallback(log_metrics="no")
