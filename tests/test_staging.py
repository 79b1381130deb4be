from collections import OrderedDict, namedtuple

import torch

from helpers import assert_tree_equal
from lightning_asyncckpt.snapshot import staging

Pair = namedtuple("Pair", "a b")


def _checkpoint():
    return {
        "state_dict": OrderedDict([("l.weight", torch.randn(3, 4)), ("l.bias", torch.zeros(3, dtype=torch.bfloat16))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 4)}}, "param_groups": [{"params": [0, 1], "lr": 0.1}]}],
        "loops": {"fit": ("x", 2, Pair(torch.arange(3), "y"))},
        "hyper_parameters": {"width": 4},
        "meta": torch.empty(2, device="meta"),
        "epoch": 1,
    }


def test_split_join_round_trip_keeps_structure_and_key_types():
    ckpt = _checkpoint()
    skeleton, tensors = staging.split(ckpt)
    assert "state_dict.l.weight" in tensors
    assert "optimizer_states.0.state.0.exp_avg" in tensors
    assert all(t.device.type != "meta" for t in tensors.values())
    # the skeleton holds no data, only placeholders of the right shape and dtype
    assert skeleton["state_dict"]["l.bias"].device.type == "meta"
    assert skeleton["state_dict"]["l.bias"].dtype == torch.bfloat16
    assert type(skeleton["state_dict"]) is OrderedDict
    back = staging.join(skeleton, tensors)
    assert list(back["optimizer_states"][0]["state"].keys()) == [0]
    assert isinstance(back["loops"]["fit"][2], Pair)
    ckpt.pop("meta")
    back.pop("meta")
    assert_tree_equal(back, ckpt)


def test_fqn_collisions_are_made_unique():
    ckpt = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    skeleton, tensors = staging.split(ckpt)
    assert len(tensors) == 2
    back = staging.join(skeleton, tensors)
    assert torch.equal(back["a.b"], torch.ones(1)) and torch.equal(back["a"]["b"], torch.zeros(1))


def test_snapshot_is_a_copy_and_buffers_are_reused():
    stager = staging.Stager(shared=True, copy_cpu=True)
    w = torch.randn(8, 8)
    snap = stager.snapshot({"w": w, "view": w[2:4]})
    staged = snap.tensors["w"]
    assert staged.is_shared() and staged.data_ptr() != w.data_ptr()
    assert snap.nbytes == (64 + 16) * 4
    w.add_(1.0)  # the training step goes on
    assert not torch.equal(staged, w)
    stager.release(snap.buffer_set)
    snap2 = stager.snapshot({"w": w, "view": w[2:4]})
    assert snap2.tensors["w"].data_ptr() == staged.data_ptr()  # reused, not reallocated
    assert torch.equal(snap2.tensors["w"], w)
    # while the first set is busy, a second save gets its own buffers
    snap3 = stager.snapshot({"w": w, "view": w[2:4]})
    assert snap3.tensors["w"].data_ptr() != snap2.tensors["w"].data_ptr()


def test_fork_mode_copies_only_views():
    stager = staging.Stager(shared=False, copy_cpu=False)
    w = torch.randn(8, 8)
    snap = stager.snapshot({"w": w, "view": w[2:4]})
    assert snap.tensors["w"].data_ptr() == w.data_ptr()  # fork's copy-on-write is the snapshot
    assert snap.tensors["view"].untyped_storage().nbytes() == 2 * 8 * 4  # a view is copied to its own storage
