"""verify_on_load for sharded DCP checkpoints: each rank checks the CRC32 of the items it reads, as it reads them,
and a damaged item that one rank read is refused on every rank, naming the file and the item (2 gloo ranks)."""

from __future__ import annotations

import pytest

from processes import run_ranks

JOB = "integrity_ranks_job"


@pytest.mark.slow  # two spawned FSDP2 ranks: kept out of make test for its 15-minute budget (make test-all)
def test_a_bit_flipped_in_one_ranks_shard_is_refused_on_every_rank_naming_file_and_item(tmp_path):
    r0, r1 = run_ranks(JOB, tmp_path, "sharded", "nvrx", "fork", timeout=120)
    for r in (r0, r1):
        assert r["clean_exact"] and r["clean_meta"] == {"epoch": 3, "global_step": 7}
    item = r0["damaged_item"]
    for r in (r0, r1):
        raised = r["raised"]
        assert raised is not None, f"rank {r.rank} loaded a damaged checkpoint silently"
        assert raised["type"] == "CorruptCheckpointError", raised
        assert "__1_0.distcp" in raised["message"] and repr(item) in raised["message"], raised
        assert "CRC32" in raised["message"], raised
