# The representative subset that `make test-compat` and `make test-nvrx-versions` run on each stack:
# the Trainer round trip (top-k + last, exact resume) on 1 rank and on 2 (DDP, AsyncDDPStrategy), the
# sharded FSDP2 round trip with resharding, Fabric, one injected failure on 2 ranks, the DCP format read by
# plain torch, the CLI, the writers' CPU priority (newer nvrx renices its own worker), and the version check. Sourced; set ENGINE_K (a pytest -k expression over the
# engine-worker ids, e.g. "(nvrx-persistent or mcore-fork)") first.
SUBSET=(
    "tests/test_trainer.py -k (test_model_checkpoint_top_k_last_and_snapshots or test_resume_continues_exactly) and $ENGINE_K"
    "tests/test_io.py -k (test_round_trip_is_exact or test_dcp_format_is_readable_with_plain_torch_dcp) and $ENGINE_K"
    "tests/test_ddp.py -k (test_ddp_top_k_snapshots_and_exact_resume or test_async_ddp_strategy_writes_on_every_rank or test_async_ddp_strategy_one_failing_rank_raises_on_every_rank) and $ENGINE_K"
    "tests/test_model_parallel.py -k test_fsdp2_shards_on_every_rank_and_stock_compatible_resume and $ENGINE_K"
    "tests/test_model_parallel.py -k test_fsdp2_resharding_two_to_one_to_two and nvrx-fork"
    "tests/test_fabric.py -k (test_fabric_save_finalize_load_is_exact or test_fabric_sharded_save_finalize_load_is_exact) and $ENGINE_K"
    "tests/test_cli.py"
    "tests/test_worker_priority.py -k persistent"
    "tests/test_versions.py"
)
