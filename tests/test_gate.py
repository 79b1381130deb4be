"""The gate a lazy single-writer write waits at (pure logic: one decision, made once, read by the worker)."""

from __future__ import annotations

import threading

import pytest

from lightning_asyncckpt.write import gate


def test_the_first_decision_stands_and_the_loser_learns_it(tmp_path):
    g = gate.Gate(tmp_path / "1.gate")
    assert g.decision() is None
    assert g.decide(False)  # the training thread gives up first
    assert not g.decide(True)  # the copy thread's late "go" loses
    assert g.decide(False) and g.decision() == gate.SKIP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.gate"]  # no decision's scratch file is left
    g.remove()
    assert g.decision() is None


def test_two_threads_deciding_at_once_agree_on_one_decision(tmp_path):
    for i in range(50):
        g = gate.Gate(tmp_path / f"{i}.gate")
        start, won = threading.Barrier(2), {}

        def decide(go, g=g, start=start, won=won):
            start.wait()
            won[go] = g.decide(go)

        threads = [threading.Thread(target=decide, args=(go,)) for go in (True, False)]  # one Gate object, as in use
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(won.values()) == [False, True], won  # exactly one wins
        assert g.decision() == (gate.GO if won[True] else gate.SKIP)


def test_the_worker_goes_on_go_and_stops_on_skip(tmp_path):
    go, skip = gate.Gate(tmp_path / "go"), gate.Gate(tmp_path / "skip")
    go.decide(True)
    skip.decide(False)
    gate.wait(go.path, timeout_s=5)
    with pytest.raises(gate.Skipped, match="dropped before its write began"):
        gate.wait(skip.path, timeout_s=5)


def test_the_worker_never_waits_past_timeout_s(tmp_path):
    with pytest.raises(TimeoutError, match="timeout_s=0.05"):
        gate.wait(str(tmp_path / "never"), timeout_s=0.05)
