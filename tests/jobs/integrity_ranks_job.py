"""A sharded checkpoint (FSDP2 on 2 gloo ranks, stock Lightning's layout: one ``.distcp`` per rank, ``.metadata``,
``meta.pt``) loaded through ``loading.load_sharded``, for tests/test_integrity_sharded.py: once whole, then with one
bit flipped in an item that only rank 1 reads. Each rank writes ``<out>/rank<r>.json``: whether the clean load gave
back the saved state, and what the damaged load raised.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_asyncckpt.format.metadata import read_metadata
from lightning_asyncckpt.integration import loading
from processes import run_gloo_cases

WORLD = 2
WIDTH = 1024  # the first layer's weight, 2 MiB a rank: checked as it is copied (dcp_reader's fused check)


def model_and_optimizer():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


def flip_a_bit_of(path: Path, relative: str) -> str:
    """Flips one bit in the tensor bytes of the first item stored in ``relative``; returns the item's name."""
    md = read_metadata(path)
    index, info = next((i, s) for i, s in md.storage_data.items()
                       if s.relative_path == relative and md.state_dict_metadata[i.fqn].__class__.__name__ == "TensorStorageMetadata")
    with open(path / relative, "r+b") as f:
        f.seek(info.offset)
        item = f.read(info.length)
        import io

        with zipfile.ZipFile(io.BytesIO(item)) as zf:
            record = next(m for m in zf.infolist() if m.filename.split("/", 1)[-1].startswith("data/"))
        header = record.header_offset + 30 + len(record.orig_filename) + len(record.extra)
        at = info.offset + header + record.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    return index.fqn


def case_sharded(args, report):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    rank = dist.get_rank()
    path = Path(args.out) / "ckpt"
    model, optimizer = model_and_optimizer()
    saved = {k: v.full_tensor().clone() for k, v in get_model_state_dict(model).items()}
    dcp.save({"state_dict": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=path)
    if rank == 0:
        torch.save({"epoch": 3, "global_step": 7}, path / "meta.pt")
    dist.barrier()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"state_dict": model, "optimizer_0": optimizer}
    meta = loading.load_sharded(path, state, strict=True, weights_only=True, verify=True)
    report["clean_meta"] = meta
    report["clean_exact"] = all(torch.equal(v.full_tensor(), saved[k]) for k, v in get_model_state_dict(model).items())
    dist.barrier()
    if rank == 0:
        report["damaged_item"] = flip_a_bit_of(path, "__1_0.distcp")
    dist.barrier()
    try:
        loading.load_sharded(path, state, strict=True, weights_only=True, verify=True)
        report["raised"] = None
    except Exception as e:  # noqa: BLE001 - reported for the test to judge
        report["raised"] = {"type": type(e).__name__, "message": str(e)}
    dist.barrier()


if __name__ == "__main__":
    run_gloo_cases("jobs.integrity_ranks_job", WORLD)
