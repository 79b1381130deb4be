"""nvidia-resiliency-ext 0.4.1 to 0.7.x: the calls whose signatures changed between versions.

0.4.1 is what this machine installs (the rest of the suite runs on it). 0.5 to 0.7 ship only
manylinux_2_39 wheels; their Python code runs here, so ``scripts/nvrx_versions.sh`` downloads them,
unpacks them, and runs ``test_a_newer_release_saves_loads_and_reports_enospc`` once per release with
that release first on ``PYTHONPATH`` (it is skipped without them).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from lightning_asyncckpt.write.dcp_writer import write_call_kwargs
from processes import job_command, launch, rank_reports


# The parameter lists of write_preloaded_data, release by release (signatures only).
def _v041(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync, **kwargs): ...
def _v05(transform_list, open_file, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync, **kwargs): ...
def _v06(transform_list, open_file, local_thread_idx, write_bucket, results_queue, count_queue, use_fsync, **kwargs): ...
def _future(transform_list, write_bucket, new_required, results_queue=None, **kwargs): ...


@pytest.mark.parametrize("fn", [_v041, _v05, _v06], ids=["0.4.1", "0.5", "0.6-0.7"])
def test_write_call_puts_every_value_under_its_name(fn):
    kwargs = write_call_kwargs(inspect.signature(fn).parameters, "T", 3, "B", "R", "C")
    bound = inspect.signature(fn).bind(**kwargs).arguments
    assert bound["transform_list"] == "T" and bound["write_bucket"] == "B"
    assert bound.get("local_proc_idx", bound.get("local_thread_idx")) == 3
    assert (bound["results_queue"], bound["count_queue"], bound["use_fsync"]) == ("R", "C", True)
    if "open_file" in bound:
        assert bound["open_file"] is open


def test_an_unknown_required_parameter_is_refused():
    with pytest.raises(RuntimeError, match="unsupported engine version.*new_required"):
        write_call_kwargs(inspect.signature(_future).parameters, "T", 0, "B", "R", "C")


_TREES = [t for t in os.environ.get("LIGHTNING_ASYNCCKPT_NVRX_TREES", "").split(os.pathsep) if t]


@pytest.mark.parametrize("tree", _TREES or [None], ids=[Path(t).name for t in _TREES] or ["none"])
def test_a_newer_release_saves_loads_and_reports_enospc(tree, tmp_path, small_tmpfs):
    if tree is None:
        pytest.skip("no unpacked nvidia-resiliency-ext releases given (scripts/nvrx_versions.sh)")
    env = dict(PYTHONPATH=os.pathsep.join([tree, str(Path(__file__).parents[1])]), PYTHONWARNINGS="ignore")
    with launch([*job_command("nvrx_version_job"), tmp_path, small_tmpfs], tmp_path / "log", 240, env=env) as run:
        code = run.wait()
    assert code == 0, run.log_text()[-4000:]
    (report,) = rank_reports(tmp_path, 1, lambda: run.log_text()[-4000:])
    assert report["module"].startswith(tree), report  # the release under test, not the installed one
    for worker in ("fork", "persistent"):
        assert report[worker]["exact"], (worker, report)
        assert report[worker]["enospc_errno"] == 28, (worker, report)
        assert report[worker]["engine_version"] == report["version"] != "0.4.1", (worker, report)
