"""The local tier's parts without Lightning: its settings, the clique layout, the recovery plan, the CRC,
the shares, and the setup checks (real files; the shared-directory check with two real gloo processes that
claim to be on two nodes). The node-local store has its own file, ``test_tiers_store.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_asyncckpt import LocalTier
from lightning_asyncckpt.tiers import checks, cliques, packing, recovery, shares
from lightning_asyncckpt.tiers.cliques import TierConfigError
from lightning_asyncckpt.tiers.store import Held

TOPO = (4, 2, 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dir": ""}, r"LocalTier\(dir=\.\.\.\) must be a path"),
    ({"dir": "/x", "every_n_train_steps": 0}, r"every_n_train_steps=\.\.\.\) must be an int >= 1; got 0"),
    ({"dir": "/x", "replication_factor": 1.5}, r"replication_factor"),
    ({"dir": "/x", "replication_jump": -1}, r"replication_jump"),
    ({"dir": "/x", "session": "a/b"}, r"session"),
    ({"dir": "/x", "timeout_s": 0}, r"timeout_s"),
    ({"dir": "/x", "emergency_signals": ("SIGNOPE",)}, r"'SIGNOPE' is not a signal name"),
    ({"dir": "/x", "timeout_s": float("inf")}, r"timeout_s=\.\.\.\) must be .* at most 31536000.*got inf"),
    ({"dir": "/x", "timeout_s": float("nan")}, r"timeout_s"),
    ({"dir": "/x", "emergency_signals": ("SIGTERM", "SIGKILL")}, r"SIGKILL cannot be caught"),
])
def test_bad_settings_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        LocalTier(**kwargs)


def test_the_tier_writes_only_under_its_own_root():
    assert LocalTier("/dev/shm/ck", session="run1").root.as_posix() == "/dev/shm/ck/asyncckpt-local/run1"


def test_the_default_factor_is_two_on_several_nodes_and_one_on_one():
    tier = LocalTier("/x")
    assert tier.factor_for(2) == 2 and tier.factor_for(16) == 2 and tier.factor_for(1) == 1
    assert LocalTier("/x", replication_factor=2).factor_for(1) == 2  # asked for: refused later, on one node
    assert LocalTier("/x", replication_factor=1).factor_for(16) == 1


def test_one_process_without_a_factor_keeps_no_replicas_and_says_so(tmp_path, caplog):
    from lightning_asyncckpt.tiers.setup import open_tier

    with caplog.at_level("INFO"):
        run = open_tier(LocalTier(tmp_path, emergency_signals=()), node_rank=0, local_world_size=1)
    run.close()
    assert run.factor == 1 and run.clique == [0]
    assert "the local tier keeps no replicas: this job runs on one node" in caplog.text


def test_emergency_signals_may_be_given_as_signals():
    import signal

    assert LocalTier("/x", emergency_signals=(signal.SIGTERM, "SIGUSR1")).emergency_signals == ("SIGTERM", "SIGUSR1")
    assert LocalTier("/x", emergency_signals=signal.SIGUSR2).emergency_signals == ("SIGUSR2",)


def test_signals_that_cannot_be_handled_off_the_main_thread_are_named_in_a_warning(tmp_path, caplog):
    import threading

    from lightning_asyncckpt.tiers.setup import open_tier

    run = open_tier(LocalTier(tmp_path, emergency_signals=("SIGUSR2",)), node_rank=0, local_world_size=1)
    armed = []
    try:
        with caplog.at_level("WARNING"):
            t = threading.Thread(target=lambda: armed.append(run.arm()))
            t.start()
            t.join(30)
    finally:
        run.close()
    assert armed == [False]
    assert "LocalTier(emergency_signals=('SIGUSR2',)) are not handled on global rank 0" in caplog.text


def test_a_home_relative_directory_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert LocalTier("~/ckpt").dir == tmp_path / "ckpt"


def test_cliques_are_nvrx_layout_and_a_world_that_does_not_divide_is_refused():
    assert cliques.layout(4, 2, 2) == [[0, 2], [1, 3]]
    assert cliques.layout(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(TierConfigError, match=r"world size 6 does not divide by replication_jump x replication_factor = 2 x 2 = 4"):
        cliques.layout(6, 2, 2)
    with pytest.raises(TierConfigError, match=r"replication_factor=2 in a job of one node .* Fix: replication_factor=1"):
        cliques.layout(2, 2, 2)  # one node of two ranks: the default factor has no other node
    with pytest.raises(TierConfigError, match=r"world size 8 does not divide by .* 8 x 2 = 16") as e:
        cliques.layout(8, 8, 2, nodes=2)  # two nodes of 4 with replication_jump=8: not "one node"
    assert "one node" not in str(e.value)


def test_the_ranks_agree_on_the_bad_copies_and_retry_only_where_nothing_else_failed():
    from lightning_asyncckpt.tiers.restore import Findings

    def ranks(*findings):
        return lambda obj: [(f.problems, f.corrupt, f.unsafe) for f in findings]  # every rank's, as a gather gives

    held = Held(10, 2, 10, 1, TOPO)
    holder, receiver, other = Findings(), Findings(), Findings()
    assert not holder.checked(held, b"", torch.zeros(10, dtype=torch.uint8), 0, "held by")
    assert not receiver.checked(held, b"", torch.zeros(10, dtype=torch.uint8), 0, "sent by")
    problems, corrupt = holder.agree(ranks(holder, receiver, other))
    # one copy (rank 0's of rank 2's share), checked by its holder and by the rank it was sent to
    assert len(problems) == 2 and corrupt == {(0, 2)}
    other.append("rank 3 could not read rank 1's share it holds: [Errno 2]")
    problems, corrupt = holder.agree(ranks(holder, receiver, other))
    assert len(problems) == 3 and corrupt == frozenset()  # something else failed too: no retry


def test_cliques_within_one_node_are_refused_on_several_nodes():
    layout = cliques.layout(4, 1, 2)  # [[0, 1], [2, 3]]: ranks of one node hold each other's shares
    with pytest.raises(TierConfigError, match=r"replication_jump=1\) puts ranks 0 and 1, .* same node 0.*replication_jump=2"):
        checks.cliques_span_nodes(layout, [0, 0, 1, 1], jump=1)
    checks.cliques_span_nodes(cliques.layout(4, 2, 2), [0, 0, 1, 1], jump=2)  # across nodes: fine


def _held(step, owner):
    return Held(step, owner, 10, 1, TOPO)


def test_plan_takes_the_newest_step_complete_in_every_clique_preferring_own_copies():
    c = cliques.layout(4, 2, 2)
    # node 1 (ranks 2, 3) came back empty: node 0 holds its own shares and node 1's replicas of step 10
    holdings = [[_held(10, 0), _held(10, 2), _held(8, 0)], [_held(10, 1), _held(10, 3)], [], []]
    plan = recovery.plan(holdings, c)
    assert plan.step == 10
    assert {o: s for o, (s, _) in plan.sources.items()} == {0: 0, 1: 1, 2: 0, 3: 1}
    node_of = [0, 0, 1, 1]
    # node 1 holds again what it holds after a save: rank 2 its own share and rank 0's replica, rank 3 likewise;
    # each of the four shares crosses to node 1 once
    refill = recovery.refill(plan, holdings, c, 2, node_of)
    assert [(o, s, r) for o, s, r, _ in refill] == [(0, 0, 2), (2, 0, 2), (1, 1, 3), (3, 1, 3)]
    after = recovery.after(holdings, refill)
    # FSDP2: each rank needs its own share, which its own directory now holds
    sharded = recovery.fetch(plan, after, node_of, {r: [r] for r in range(4)})
    assert sharded.moves == [] and [(o, h) for o, h, _ in sharded.reads[2]] == [(2, 2)]
    # DDP: every rank needs every share, and its node holds all four: nothing more is sent
    replicated = recovery.fetch(plan, after, node_of, {r: list(range(4)) for r in range(4)})
    assert replicated.moves == []
    assert sorted((o, h) for o, h, _ in replicated.reads[3]) == [(0, 2), (1, 3), (2, 2), (3, 3)]


def test_fetch_sends_between_nodes_only_what_a_node_does_not_hold():
    # 8 ranks on 4 nodes: node 0 (ranks 0, 1) holds cliques {0, 2} and {1, 3}, not the shares of ranks 4 to 7
    c = cliques.layout(8, 2, 2)
    node_of = [r // 2 for r in range(8)]
    holdings = [[_held(10, o) for o in recovery.holds(r, c, 2)] for r in range(8)]
    plan = recovery.plan(holdings, c)
    assert recovery.refill(plan, holdings, c, 2, node_of) == []
    got = recovery.fetch(plan, holdings, node_of, {0: list(range(8))})
    assert sorted(o for o, _, _ in got.reads[0]) == [0, 1, 2, 3]
    assert [(o, r) for o, _, r, _ in got.moves] == [(4, 0), (5, 0), (6, 0), (7, 0)]
    assert all(node_of[s] in (2, 3) for _, s, _, _ in got.moves)


def test_a_lost_clique_has_no_plan_and_says_whose_shares_are_missing():
    c = cliques.layout(4, 2, 2)
    holdings = [[_held(10, 0)], [_held(10, 1), _held(10, 3)], [], []]  # rank 2's share is nowhere
    assert recovery.plan(holdings, c) is None
    assert "step 10 lacks the shares of rank(s) [2]" in recovery.why_not(holdings, c)
    assert "every local directory is empty" in recovery.why_not([[], [], [], []], c)


def test_replicated_share_packed_and_unpacked_on_one_rank():
    ck = {"state_dict": {"w": torch.randn(3, 4), "b": torch.arange(4)}, "optimizer_states": [{"state": {0: {
        "step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4).t()}}}], "global_step": 7, "flag": torch.tensor([True])}
    lay, tensors = packing.layout(shares.make(ck, 0, 1, shares.REPLICATED))
    flat = torch.empty(lay.nbytes, dtype=torch.uint8)
    packing.copy_into(lay, tensors, flat)
    head = lay.header()
    ck["state_dict"]["w"].add_(1)  # the packed share holds copies
    own = packing.unpack(head, flat)
    back = shares.assemble(own, [own])
    assert back["global_step"] == 7
    assert not torch.equal(back["state_dict"]["w"], ck["state_dict"]["w"])
    torch.testing.assert_close(back["state_dict"]["w"], ck["state_dict"]["w"] - 1)
    assert torch.equal(back["optimizer_states"][0]["state"][0]["exp_avg"], ck["optimizer_states"][0]["state"][0]["exp_avg"])
    assert back["flag"].dtype == torch.bool and back["state_dict"]["b"].dtype == torch.int64


def test_a_share_gives_back_what_torch_load_would_parameters_sparse_quantized_nested_and_views():
    """The kinds of tensor a stock checkpoint can hold come back from a local share as ``torch.load`` gives them
    back: an ``nn.Parameter`` (with its ``requires_grad``) as one; sparse, quantized and nested tensors whole
    (they travel in the header); a strided view with its values. A share written before parameters were
    recorded (5 fields an entry) still unpacks."""
    base = torch.randn(10, 10)
    ck = {"p": torch.nn.Parameter(torch.randn(3)), "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
          "sparse": torch.randn(4, 4).to_sparse(), "q": torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8),
          "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "view": base[::2, 1:5]}
    lay, tensors = packing.layout({"mode": shares.REPLICATED, **ck})
    flat = torch.empty(lay.nbytes, dtype=torch.uint8)
    packing.copy_into(lay, tensors, flat)
    back = packing.unpack(lay.header(), flat)
    assert type(back["p"]) is torch.nn.Parameter and back["p"].requires_grad and torch.equal(back["p"], ck["p"])
    assert type(back["frozen"]) is torch.nn.Parameter and not back["frozen"].requires_grad
    assert torch.equal(back["sparse"].to_dense(), ck["sparse"].to_dense()) and back["sparse"].is_sparse
    assert torch.equal(back["q"].int_repr(), ck["q"].int_repr()) and back["q"].q_scale() == ck["q"].q_scale()
    assert [t.tolist() for t in back["nested"].unbind()] == [t.tolist() for t in ck["nested"].unbind()]
    assert torch.equal(back["view"], ck["view"])
    old = packing.Layout(lay.skeleton, [e[:5] for e in lay.entries], lay.nbytes, lay.mode)  # the older format
    assert type(packing.unpack(old.header(), flat)["p"]) is torch.Tensor


def test_crc32_is_zlibs():
    import zlib

    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8)
    assert packing.crc32(data) == zlib.crc32(bytes(data.numpy()))
    assert packing.crc32(b"tail", packing.crc32(b"head")) == zlib.crc32(b"headtail")


def test_a_missing_directory_is_refused_with_the_fix(tmp_path):
    problem = checks.directory(tmp_path / "nope", rank=3, node=1)
    assert "does not exist on node 1 (global rank 3)" in problem and "mkdir -p" in problem


def test_a_directory_too_small_is_refused_with_the_sizes_before_anything_is_written(tmpfs_1m):
    # 2 x 2 copies of a 300 kB (293 KiB) share (the newest step and the next, own and replica) do not fit in 1 MiB
    with pytest.raises(TierConfigError, match=r"has 1\.0 MiB free, but its 1 rank\(s\) need 1\.2 MiB.*2 x 2 x share"
                       r".*rank 0: 293\.0 KiB.*Fix: a larger directory.*--shm-size.*emptyDir.*Nothing was written"):
        checks.space(tmpfs_1m, 0, [0], share_bytes=300_000, held_bytes=0, factor=2, gather=lambda x: [x])
    assert list(tmpfs_1m.iterdir()) == []
    checks.space(tmpfs_1m, 0, [0], share_bytes=200_000, held_bytes=0, factor=2, gather=lambda x: [x])


def test_the_plugin_imports_without_nvidia_resiliency_ext_and_local_tier_says_what_to_install():
    """With megatron-core alone (nvidia-resiliency-ext hidden), the plugin and callback import and the mcore
    engine is used; only LocalTier needs nvidia-resiliency-ext, and says so."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'nvidia_resiliency_ext': raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import importlib.util; importlib.util.find_spec = (lambda f: lambda n, *a: None if n.startswith('nvidia_resiliency_ext') else f(n, *a))(importlib.util.find_spec)\n"
        "from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, LocalTier\n"
        "print(AsyncCheckpointIO('mcore').engine)\n"
        "try:\n"
        "    LocalTier('/dev/shm')\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mcore" in p.stdout and "refused: LocalTier uses nvidia-resiliency-ext" in p.stdout, p.stdout


def test_once_cuda_refuses_to_pin_a_file_the_pool_never_asks_again(tmp_path, monkeypatch):
    """Pure logic (CUDA faked): a file system whose mappings CUDA cannot pin (seen: ext4 on an H200 machine)
    costs one refused registration, not one per save; the files stay pageable and are used as ever."""
    from lightning_asyncckpt.tiers import pinning
    from lightning_asyncckpt.tiers.mapped import FilePool

    asked = []
    monkeypatch.setattr(pinning, "pin", lambda tensor, device: asked.append(device) or False)
    pool = FilePool(tmp_path, keep_free=4)
    for _save in range(3):  # as TierRun does before each save, then its writer thread after it
        pool.pin_for(torch.device("cuda", 0))
        pool.prepare([4096], uses=2)
    assert len(asked) == 1
    f = pool.take(tmp_path / "a.pt.tmp", 4096)
    assert not f.pinned and f.nbytes == 4096
    pool.close()
