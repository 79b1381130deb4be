"""After a resume from the local tier nothing aliases the tier's files: the model's parameters and the
optimizer's state are tensors of their own (each its own storage, none in a mapping of the tier's files),
the next persistent checkpoint is the size stock writes, and the restored step's files are no longer
mapped once the restore is over (no ``(deleted)`` mapping left behind after the next local save).

Before, the restored tensors were views of one mapped flat buffer per share: AdamW's moments stayed views
of it, every later ``torch.save`` wrote that whole buffer for each of them, and the process kept the
restored step's (deleted) files mapped for the rest of the run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import TinyModel, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, FabricTiers, LocalTier
from processes import two_nodes

pytestmark = pytest.mark.timeout(180)

WIDTH = 128  # 2 layers: 129 KiB of weights, twice that of AdamW moments


class AdamWModel(TinyModel):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def tier_mappings(root: Path) -> list[tuple[int, int, str]]:
    """This process's mappings of files under ``root``: ``(start, end, line)``."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if str(root) in line:
            span = line.split()[0].split("-")
            found.append((int(span[0], 16), int(span[1], 16), line))
    return found


def not_owning(tensors: dict[str, torch.Tensor], mapped: list[tuple[int, int, str]]) -> list[str]:
    """The names of ``tensors`` that do not own their storage (a view of a larger one) or that lie in one of
    the ``mapped`` regions, each with why."""
    bad = []
    for name, t in tensors.items():
        storage = t.untyped_storage()
        if storage.nbytes() != t.numel() * t.element_size():
            bad.append(f"{name}: a view of {storage.nbytes()} bytes for its own {t.numel() * t.element_size()}")
        ptr = storage.data_ptr()
        if any(start <= ptr < end for start, end, _ in mapped):
            bad.append(f"{name}: in a mapping of the tier's files")
    return bad


def live_state(trainer_: L.Trainer) -> dict[str, torch.Tensor]:
    """The model's parameters and the optimizer's state tensors, by name."""
    return owned_by(trainer_.lightning_module, trainer_.optimizers[0])


def owned_by(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``module``'s parameters and ``optimizer``'s state tensors, by name."""
    named = dict(module.named_parameters())
    found = {f"parameter {n}": p for n, p in named.items()}
    names = {id(p): n for n, p in named.items()}
    for p, per_param in optimizer.state.items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                found[f"{key} of {names[id(p)]}"] = value
    return found


class AtStart(L.Callback):
    """What the resumed run holds when training starts (the restore done): tensors that do not own their
    storage, and this process's mappings of the tier's files (the restored step's, and any spare the pool
    has made for the next save)."""

    def __init__(self, root: Path) -> None:
        self.root, self.bad, self.mapped = root, None, None

    def on_train_start(self, trainer_, pl_module):
        self.mapped = tier_mappings(self.root)
        self.bad = not_owning(live_state(trainer_), self.mapped)


def _fit(root: Path, max_steps: int, local: bool, ckpt_path=None, callbacks=()) -> L.Trainer:
    """Persistent saves every 4 steps; with ``local``, local saves every 2 (``root/local``)."""
    plugins = []
    if local:
        (root / "local").mkdir(parents=True, exist_ok=True)
        plugins.append(AsyncCheckpointIO("nvrx", local=LocalTier(root / "local", every_n_train_steps=2)))
    ck = ModelCheckpoint(dirpath=root / "c", every_n_train_steps=4, save_top_k=-1)
    t = trainer(root, plugins, [*callbacks, ck], max_steps=max_steps)
    L.seed_everything(0)
    t.fit(AdamWModel(width=WIDTH), loader(width=WIDTH, n=512, batch_size=4), ckpt_path=ckpt_path)
    return t


def test_after_a_local_resume_the_state_owns_its_memory_and_the_next_checkpoint_is_stocks_size(tmp_path):
    """Resumed from local step 10, then saved persistently at step 12 and locally at 12: the step-12 file is
    within 5% of stock's (a run without the tier), every parameter and AdamW moment owns its storage, and
    once the run is over (its tensors still alive) no file of the tier is mapped, deleted or not."""
    stock = _fit(tmp_path / "stock", 12, local=False)
    stock_size = (tmp_path / "stock" / "c" / "epoch=0-step=12.ckpt").stat().st_size
    del stock

    ours = tmp_path / "ours"
    _fit(ours, 10, local=True)  # local at 2, 4, ..., 10; persistent at 4 and 8
    start = AtStart(ours / "local")
    t = _fit(ours, 13, local=True, ckpt_path="last", callbacks=[start])  # persistent at 12, local at 12
    assert str(t.ckpt_path).endswith("restore-step-10"), t.ckpt_path
    assert start.bad == [], "right after the restore: " + "; ".join(start.bad)
    restored_files = [line for _, _, line in start.mapped if "step-0000000010." in line]  # not the next save's spares
    assert restored_files == [], "the restored step is still mapped:\n" + "\n".join(restored_files)

    size = (ours / "c" / "epoch=0-step=12.ckpt").stat().st_size
    assert abs(size / stock_size - 1) <= 0.05, f"step 12 after the local resume: {size} bytes, stock's {stock_size}"
    held = tier_mappings(ours / "local")
    assert not_owning(live_state(t), held) == []
    deleted = [line for _, _, line in held if "(deleted)" in line]
    assert deleted == [], "after the next local save, deleted tier files are still mapped:\n" + "\n".join(deleted)


def _fabric_loop(root: Path, steps: int, resume: bool) -> tuple | None:
    """A Fabric loop with AdamW and ``FabricTiers`` saving locally every 2 steps; with ``resume``, resumes
    instead and returns what the model and optimizer hold then: ``(step, tensors not owning their memory,
    private mappings of the tier's files)``."""
    (root / "local").mkdir(parents=True, exist_ok=True)
    io = AsyncCheckpointIO("nvrx", local=LocalTier(root / "local", every_n_train_steps=2, replication_factor=1,
                                                   timeout_s=60, emergency_signals=()))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    fabric.launch()
    L.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    io.track_optimizers([optimizer])
    state = {"model": model, "optimizer": optimizer, "step": 0}
    tiers = FabricTiers(fabric)
    with io:
        try:
            if resume:
                assert tiers.resume(state)
                mapped = tier_mappings(root / "local")
                return state["step"], not_owning(owned_by(model, optimizer), mapped), [m[2] for m in mapped]
            g = torch.Generator().manual_seed(0)
            while state["step"] < steps:
                optimizer.zero_grad()
                fabric.backward(model(torch.randn(8, WIDTH, generator=g)).pow(2).mean())
                optimizer.step()
                state["step"] += 1
                tiers.step_end(state["step"], state)
        finally:
            tiers.close()
    return None


def test_a_fabric_resume_from_the_local_tier_hands_over_a_state_of_its_own(tmp_path):
    """``FabricTiers.resume``: the model's parameters and AdamW's moments own their storage, and the restored
    step's files are no longer mapped."""
    _fabric_loop(tmp_path, 4, resume=False)
    step, bad, mapped = _fabric_loop(tmp_path, 0, resume=True)
    assert step == 4
    assert bad == [], "; ".join(bad)
    assert mapped == [], "\n".join(mapped)


def _tensors(tree_: object, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint by its path (a sharded share's ``LocalShard``: its local tensor)."""
    if isinstance(tree_, torch.Tensor):
        return {path: tree_}
    if isinstance(tree_, dict):
        return {k: v for key, value in tree_.items() for k, v in _tensors(value, f"{path}/{key}").items()}
    if isinstance(tree_, (list, tuple)):
        return {k: v for i, value in enumerate(tree_) for k, v in _tensors(value, f"{path}/{i}").items()}
    if hasattr(tree_, "local"):
        return _tensors(tree_.local, f"{path}.local")
    return {}


def _restore_and_look(tier: LocalTier, rank: int, root: str) -> tuple:
    """A new run's restore on this rank: ``(restored tensors, those that do not own their memory, the private
    mappings of the tier's files left once it returned, the same after the first boundary, its log)``. The
    pool's own shared mappings of the files it wrote (``rw-s``) are its spares for the next saves."""
    from helpers import log_lines
    from lightning_asyncckpt.tiers.setup import open_tier

    with log_lines() as lines:
        run = open_tier(tier, node_rank=rank, local_world_size=1)
        try:
            restored = run.take(run.latest(None))
            private = [m for m in tier_mappings(Path(root)) if " rw-s " not in m[2]]
            bad = not_owning(_tensors(restored), tier_mappings(Path(root))) if restored is not None else None
            got = {k: v.clone() for k, v in _tensors(restored).items()} if restored is not None else None
            run.finish()  # the first boundary: a sharded restore's replicas left for later are sent, waited for here
            after = [m[2] for m in tier_mappings(Path(root)) if " rw-s " not in m[2] or "(deleted)" in m[2]]
        finally:
            run.close()
    return got, bad, [m[2] for m in private], after, lines


def _replicated_rank(rank: int, root: str, factor: int) -> tuple:
    """A replicated (DDP) state with AdamW-like moments saved at step 2 on two nodes, restored whole (``factor``
    1: each node lacks the other's share, sent into memory), then with node 1 back empty (``factor`` 2: its
    shares sent back into its files; 1: nothing to restore from)."""
    import shutil

    import torch.distributed as dist

    from lightning_asyncckpt.tiers.setup import open_tier

    gen = torch.Generator().manual_seed(0)
    moments = {i: {"step": torch.tensor(2.0), "exp_avg": torch.rand(3000, generator=gen),
                   "exp_avg_sq": torch.rand(3000, generator=gen)} for i in range(4)}
    state = {"state_dict": {f"w{i}": torch.rand(3000, generator=gen) for i in range(4)},
             "optimizer_states": [{"state": moments, "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}]}],
             "global_step": 2}
    tier = LocalTier(f"{root}/node{rank}", replication_factor=factor, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    run.save(2, state)
    assert run.finish() == 2
    run.close()
    live = {k: v.clone() for k, v in _tensors(state).items()}
    dist.barrier()
    whole = _restore_and_look(tier, rank, root)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(f"{root}/node1/asyncckpt-local")
    dist.barrier()
    return live, whole, _restore_and_look(tier, rank, root) if factor > 1 else None


def _replicated_factor_2(rank, root):
    return _replicated_rank(rank, root, 2)


def _replicated_factor_1(rank, root):
    return _replicated_rank(rank, root, 1)


def _check(live: dict, restore: tuple, rank: int, what: str, sends_later: bool = False) -> None:
    """``sends_later``: the rank keeps a mapping of a share it sends from the first boundary on (a sharded
    restore's replicas left for later), until then."""
    got, bad, private, after, lines = restore
    assert got is not None, f"rank {rank}, {what}: fell back: {lines}"
    assert got.keys() == live.keys() and all(torch.equal(got[k], live[k]) for k in live), f"rank {rank}, {what}"
    assert bad == [], f"rank {rank}, {what}: " + "; ".join(bad)
    if not sends_later:
        assert private == [], f"rank {rank}, {what}: the restored step is still mapped:\n" + "\n".join(private)
    assert after == [], f"rank {rank}, {what}: after the first boundary:\n" + "\n".join(after)


def _moved(restore: tuple) -> str:
    """The rank's log line that says what moved in the restore."""
    return next((line for line in restore[4] if "resuming from the local tier" in line), "")


@pytest.mark.parametrize("case", [_replicated_factor_2, _replicated_factor_1], ids=["refilled", "fetched"])
def test_a_replicated_restore_on_two_ranks_hands_over_tensors_of_their_own_and_unmaps_the_step(tmp_path, case):
    """Restored on two nodes, each reading the shares its node holds; without replicas (``fetched``) the share
    a node lacks is sent into memory. Then (``refilled``) with node 1 back empty: its shares are sent into its
    files. Each time every tensor owns its storage, and no private mapping of the tier's files is left once
    the restore returns."""
    got = two_nodes(case, tmp_path)
    for rank in (0, 1):
        live, whole, node1_lost = got[rank]
        _check(live, whole, rank, "both nodes whole")
        if node1_lost is not None:
            _check(live, node1_lost, rank, "node 1 back empty")
    lost = got[0][2]
    assert "(2 share(s) sent between ranks" in (_moved(lost) if lost is not None else _moved(got[0][1])), got[0]


def _sharded_rank(rank: int, root: str) -> tuple:
    """A ``DTensor`` over both ranks saved at step 2 with its replicas; restored whole, then with node 1 back
    empty (its own share sent first, the replica it holds for rank 0 after, from the first boundary)."""
    import shutil

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_asyncckpt.tiers.setup import open_tier

    w = distribute_tensor(torch.arange(100_000, dtype=torch.float32), init_device_mesh("cpu", (2,)), [Shard(0)])
    m = distribute_tensor(torch.arange(100_000, dtype=torch.float32) * 2, init_device_mesh("cpu", (2,)), [Shard(0)])
    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    state = {"w": w, "optimizer": {"state": {"w": {"exp_avg": m, "step": torch.tensor(2.0)}}}, "global_step": 2}
    run.save(2, state)
    assert run.finish() == 2
    run.close()
    live = {"/w.local": w.to_local().clone(), "/optimizer/state/w/exp_avg.local": m.to_local().clone(),
            "/optimizer/state/w/step": torch.tensor(2.0)}
    dist.barrier()
    whole = _restore_and_look(tier, rank, root)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(f"{root}/node1/asyncckpt-local")
    dist.barrier()
    return live, whole, _restore_and_look(tier, rank, root)


def test_a_sharded_restore_on_two_ranks_hands_over_local_shards_of_their_own(tmp_path):
    """The same for a sharded (FSDP2-like) state: each ``DTensor``'s local shard owns its storage, and the
    replica sent after the resume (node 1 back empty) is sent from a mapping that is gone after the first
    boundary."""
    pytest.importorskip("nvidia_resiliency_ext")
    got = two_nodes(_sharded_rank, tmp_path)
    for rank in (0, 1):
        live, whole, node1_lost = got[rank]
        _check(live, whole, rank, "both nodes whole")
        _check(live, node1_lost, rank, "node 1 back empty", sends_later=rank == 0)
    assert "1 replica(s) sent after" in _moved(got[0][2]), got[0][2][4]
