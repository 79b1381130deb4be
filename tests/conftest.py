import glob
import os
import shutil
import tempfile

import pytest

# tests/ is importable (``helpers``, ``processes``, ``reports``, ``jobs``): pytest's default import mode
# ("prepend") puts this file's directory first on sys.path before it imports it
from helpers import combo_params, hold_write, mounted_tmpfs
from lightning_asyncckpt.pipeline import scratch
from processes import live_children, wait_no_children

# The longest tests of `make test`, longest first (from `--durations`, 2026-12-06, 20 s to 90 s each on 2
# cores), then the other simulated-node (`scale`) ones, then the rest: under pytest-xdist a long test that
# starts last keeps one worker busy while the others have nothing left to take. A scheduling hint only: any
# order passes.
LONG = (
    "test_tiers_nodes.py::test_ddp_node_lost_resumes_from_replicas_then_persistent",
    "test_tiers_trainer_cases.py::test_ddp_spawn_resumes_from_the_newer_local_step",
    "test_tiers_nodes.py::test_sigterm_on_one_rank_saves_the_agreed_step_locally",
    "test_tiers_nodes.py::test_fsdp2_with_full_persistent_checkpoints_keeps_each_ranks_shards_locally",
    "test_tiers_nodes.py::test_fabric_node_lost_resumes_from_the_replica_then_persistent",
    "test_worker_priority.py::test_a_repeated_save_maps_nothing_new_in_the_worker",
    "test_nodes.py::test_async_ddp_strategy_on_two_nodes_saves_every_share_and_resumes_exactly",
    "test_remote.py::test_sharded_saves_to_s3_read_with_plain_dcp_and_resume",
    "test_pipeline.py::test_a_collective_commit_interrupted_on_the_way_out_leaves_nothing_partial",
    "test_model_parallel.py::test_fsdp2_shards_on_every_rank_and_stock_compatible_resume",
    "test_scripts.py::test_two_tiers_example_runs",
    "test_worker_priority.py::test_writers_run_at_the_nice_value_given",
    "test_tiers_trainer_cases.py::test_accumulation_",
    "test_reliability.py::test_trainer_killed_mid_write_resumes_from_newest_committed",
    "test_distributions.py::",
    "test_tiers_nodes.py::",
    "test_remote.py::test_trainer_top_k_last_resume_and_load_from_s3",
    "test_tiers_trainer.py::test_last_resumes_from_a_newer_persistent_step_on_s3",
    "test_ddp.py::test_ddp_top_k_snapshots_and_exact_resume",
    "test_fabric.py::test_fabric_sharded_save_lands_when_the_script_just_ends",
    "test_scripts.py::test_demo_runs",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        found = [i for i, name in enumerate(LONG) if name in item.nodeid]
        if found:
            return found[0]
        return len(LONG) + (item.get_closest_marker("scale") is None)

    items.sort(key=rank)  # stable: the order within each group is kept


@pytest.fixture(params=combo_params(single=True))
def engine_worker(request):
    return request.param


@pytest.fixture
def hold(tmp_path_factory):
    """A ``testing.HoldWrite`` for this test: set it as the write hook, then ``hold.release()`` (released at the
    end of the test in any case, so that a failing test does not leave a write held)."""
    held = hold_write(tmp_path_factory.mktemp("hold"))
    yield held
    held.release()


@pytest.fixture(autouse=True)
def no_child_processes_left():
    """Every test must leave no process behind: worker, fork, Manager or resource tracker."""
    before = {p.pid for p in live_children()}
    yield
    left = [p for p in wait_no_children() if p.pid not in before]
    for p in left:
        try:
            p.kill()
        except Exception:
            pass
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


def _own_scratch_dirs() -> set[str]:
    """This pytest process's run scratch directories (``Run.start``: ``asyncckpt-<pidns>-<pid>-<random>`` in
    ``/dev/shm``, or the temporary directory where there is none): one glob, no stat of other entries."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return set(glob.glob(os.path.join(base, f"{scratch.PREFIX}{scratch.pidns()}-{os.getpid()}-*")))


@pytest.fixture(autouse=True)
def no_scratch_dir_left():
    """Every test that opens an ``AsyncCheckpointIO`` (or a pipeline ``Run``) in this process must close it
    (``io.teardown()``, ``Run.close``): else its scratch directory in ``/dev/shm`` (memory) and its worker
    stay until pytest exits.

    Only directories made during the test count: a module- or session-scoped fixture (``cli_checkpoints``'
    ``ckpts``, ``test_cli_local``'s ``fitted``) is set up before this function-scoped fixture, so whatever
    it keeps open across tests is in ``before``. A function-scoped fixture that tears its IO down is
    set up after this one (autouse first) and so torn down before the check. Processes a test starts have
    other pids, so their own directories (``run_ranks``, subprocess jobs) are not counted here."""
    before = _own_scratch_dirs()
    yield
    left = sorted(_own_scratch_dirs() - before)
    for d in left:  # the test fails anyway: do not leave its memory in /dev/shm for the rest of the session
        shutil.rmtree(d, ignore_errors=True)
    assert not left, (
        f"scratch directories left behind: {left}; an AsyncCheckpointIO (or pipeline Run) opened by this "
        "test was never closed: call io.teardown() (Run.close) in a finally or a fixture"
    )


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 4 MiB tmpfs, for real ENOSPC. Skips where mounting is refused."""
    with mounted_tmpfs(tmp_path / "tmpfs", "4m") as mnt:
        yield mnt


@pytest.fixture
def s3(tmp_path_factory, monkeypatch):
    """A real S3-protocol server (moto) on loopback for this test, with a bucket ``ckpt``; the environment
    points fsspec (and every process started from here) at it. Stopped after the test."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import fsspec
    from s3server import S3Server

    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        fsspec.get_filesystem_class("s3").clear_instance_cache()  # an earlier test's endpoint must not be reused
        fs = fsspec.filesystem("s3")
        fs.mkdir("ckpt")
        server.fs = fs
        yield server
        fs.clear_instance_cache()


@pytest.fixture
def tmpfs_1m(tmp_path):
    """A real 1 MiB tmpfs (skipped where mounting is refused): the local tier's tests size their shares to it."""
    with mounted_tmpfs(tmp_path / "small", "1m") as mnt:
        yield mnt
