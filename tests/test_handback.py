"""handback: a file write hands each staged tensor back once it no longer reads it, and a follower that
overwrites every tensor the moment it is handed back never changes the file that is written.

Real files and real writer threads; the follower runs in a thread of the test, as the lazy copy does."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_asyncckpt.snapshot import handback, staging
from lightning_asyncckpt.snapshot.handback import Follow, FollowFailed, Written
from lightning_asyncckpt.write import direct_io, torch_file


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_consumed_prefix_is_never_read_again(tmp_path, direct):
    """Scribbling over the memory behind each consumed prefix, from the writer thread that reports it,
    leaves the file as it was written."""
    src = torch.randint(0, 255, (300_001,), dtype=torch.uint8)
    expected = bytes(src.numpy())
    reported = []

    def scribble(upto):
        reported.append(upto)
        src[:upto] = 7  # the caller reuses its memory at once

    path = tmp_path / "f.bin"
    with direct_io.DirectFile(str(path), [(src.data_ptr(), src.numel())], threads=3, chunk=8192, direct=direct,
                              on_consumed=scribble) as f:
        raw = memoryview(src.numpy()).cast("B")
        for at in range(0, src.numel(), 100_000):
            f.write(raw[at: at + 100_000])
    assert path.read_bytes() == expected
    assert reported == sorted(reported) and reported[-1] == len(expected)


def _state():
    """Tensors of many sizes: below the reference size (copied into the file), within one chunk, across
    several 8 MiB chunks, and a non-contiguous view (copied before recording)."""
    torch.manual_seed(0)
    base = torch.randn(600, 700)
    return {
        "small": torch.randn(10),
        "mid": torch.randn(200_000),
        "big": torch.randn(5_000_000),  # 20 MB: spans chunks
        "after": torch.randn(3_000_000),
        "view": base.t(),
        "int": torch.arange(100_000),
    }


def _follow_and_scribble(written: Written, tensors: dict, ended: threading.Event, order: list, errors: list):
    """A follower: overwrites each tensor as soon as it is handed back (or once the write ended)."""
    follow = Follow(ended, written.path.with_suffix(".result"), written, tensors, timeout_s=60)
    left = list(tensors)
    try:
        while left:
            for name in follow.free(left, threading.Event()):
                tensors[name].fill_(-1)
                order.append((name, ended.is_set()))
                left.remove(name)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_a_follower_overwriting_each_tensor_handed_back_never_changes_the_file(tmp_path):
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    written = Written.of(tmp_path / "1.released", state)
    ended, order, errors = threading.Event(), [], []
    follower = threading.Thread(target=_follow_and_scribble, args=(written, state, ended, order, errors))
    follower.start()
    skeleton, tensors = staging.split({"state": state, "step": 3})
    torch_file.write_file(skeleton, tensors, tmp_path / "ckpt", released=str(written.path))
    ended.set()  # the report: every tensor is free
    follower.join(60)
    assert not follower.is_alive() and not errors, errors
    loaded = torch.load(tmp_path / "ckpt", weights_only=True)
    for name, value in expected.items():
        assert torch.equal(loaded["state"][name], value), name
    assert sorted(n for n, _ in order) == sorted(state)
    # every tensor was handed back by the write itself, before its end, and each once
    assert [n for n, at_end in order if at_end] == []
    assert sorted(handback._INDEX.iter_unpack(written.path.read_bytes())) == [(i,) for i in range(len(state))]


def test_a_write_that_hands_nothing_back_is_followed_to_its_report(tmp_path):
    buffers = {"a": torch.zeros(4), "b": torch.zeros(4)}
    report = tmp_path / "1.result"
    follow = Follow(threading.Event(), report, None, buffers, timeout_s=60)
    found = []
    waiter = threading.Thread(target=lambda: found.extend(follow.free(["a", "b"], threading.Event())))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # nothing is free before the report
    report.write_bytes(b"done")
    waiter.join(30)
    assert found == ["a", "b"]


def test_a_buffer_made_anew_is_free_at_once_and_one_handed_back_after(tmp_path):
    old = {"a": torch.zeros(4), "b": torch.zeros(4)}
    written = Written.of(tmp_path / "1.released", old)
    now = {"a": torch.zeros(8), "b": old["b"]}  # "a" changed shape: a new buffer the write never read
    follow = Follow(threading.Event(), tmp_path / "1.result", written, now, timeout_s=60)
    assert follow.free(["a", "b"], threading.Event()) == ["a"]
    written.path.write_bytes(handback._INDEX.pack(1) + b"\0\0")  # index 1 ("b"), and half a record
    assert follow.free(["b"], threading.Event()) == ["b"]


def test_a_cancelled_or_endless_wait_fails_without_hanging(tmp_path):
    buffers = {"a": torch.zeros(4)}
    written = Written.of(tmp_path / "1.released", buffers)
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(FollowFailed, match="dropped"):
        Follow(threading.Event(), tmp_path / "1.result", written, buffers, timeout_s=60).free(["a"], cancelled)
    with pytest.raises(FollowFailed, match="timeout_s=0.05s"):
        Follow(threading.Event(), tmp_path / "1.result", written, buffers, timeout_s=0.05).free(["a"], threading.Event())


def test_a_hand_back_that_cannot_be_written_never_fails_the_write(tmp_path):
    """The hand-back is an optimization: where its file cannot be written, the checkpoint is written all the
    same (a follower then waits for the write's report)."""
    state = {"big": torch.randn(3_000_000)}
    skeleton, tensors = staging.split(state)
    torch_file.write_file(skeleton, tensors, tmp_path / "ckpt", released=str(tmp_path / "gone" / "1.released"))
    assert torch.equal(torch.load(tmp_path / "ckpt", weights_only=True)["big"], state["big"])
