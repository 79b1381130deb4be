"""One owner of cross-rank collectives (:mod:`lightning_asyncckpt.collectives`).

Static: no module outside the owner imports ``torch.distributed`` to run collectives (its types, DCP's and
DTensor's own APIs excepted). Two real gloo ranks: the maxima and minima of one all-reduce, in the
pipeline's agreement and in the tier's step rounds (waited for at once, and overlapped)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_asyncckpt
from processes import two_ranks

ROOT = Path(lightning_asyncckpt.__file__).parent
OWNER = ROOT / "collectives"
# DCP's and DTensor's own APIs (which run their own collectives, as dcp.save does) and torch.distributed's
# types may be named anywhere; anything else of torch.distributed only in the owner
ALLOWED = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.device_mesh")
TYPES = {"ProcessGroup", "Work"}
# private names that run no collective: DCP's storage-info type, and the tensor slicing its reader uses
NOT_COLLECTIVES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                   ("torch.distributed._shard._utils", "narrow_tensor_by_index")}


def _uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [f"{path.relative_to(ROOT.parent)}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("torch.distributed") and not a.name.startswith(ALLOWED)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            module = node.module or ""
            names = {a.name for a in node.names if (module, a.name) not in NOT_COLLECTIVES}
            if not names:
                continue
            private = {n for n in names if n.startswith("_")}  # e.g. DCP's _DistWrapper: its collectives
            if private or not (module.startswith(ALLOWED) or (module == "torch.distributed" and names <= TYPES)):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: from {module} import {sorted(names)}")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and "distributed" in {a.name for a in node.names}:
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: from torch import distributed")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch"
              and node.value.attr == "distributed" and node.attr not in ("checkpoint", "tensor", *TYPES)):
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: torch.distributed.{node.attr}")
    return found


def test_only_the_owner_of_collectives_imports_torch_distributed_to_run_them():
    outside = [p for p in sorted(ROOT.rglob("*.py")) if OWNER not in p.parents]
    found = [use for p in outside for use in _uses(p)]
    assert not found, "collectives outside lightning_asyncckpt/collectives:\n" + "\n".join(found)


def _agree(rank, _root):
    import torch.distributed as dist

    from lightning_asyncckpt.collectives import Agreement, StepAgreement, bounded_group

    pipeline = Agreement().max_min(most=[rank, 0], least=[10 + rank, -rank])
    step = StepAgreement(bounded_group(30.0))
    at_once = step.round([rank], [5 - rank])
    overlapped = StepAgreement(bounded_group(30.0), overlapped=True)
    first = overlapped.round([rank], [rank])  # posted: read at the next round
    second = overlapped.round([7 * rank], [3 + rank])  # the first round's, and this one's posted
    settled = overlapped.settle()
    final = overlapped.now([1], [rank + 100])
    dist.barrier()
    return ((pipeline.most, pipeline.least), (at_once.most, at_once.least), first,
            (second.most, second.least), (settled.most, settled.least), (final.most, final.least))


def test_every_rank_agrees_on_the_same_maxima_and_minima(tmp_path):
    got = two_ranks(_agree, tmp_path)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        pipeline, at_once, first, second, settled, final = got[rank]
        assert pipeline == ([1, 0], [10, -1])
        assert at_once == ([1], [4])
        assert first is None
        assert second == ([1], [0])
        assert settled == ([7], [3])
        assert final == ([1], [100])
