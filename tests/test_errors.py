import errno
import pickle

from lightning_asyncckpt import CheckpointWriteError
from lightning_asyncckpt.errors import RankFailure


def test_message_and_attributes_name_path_ranks_and_cause():
    err = CheckpointWriteError(
        "/ckpt/epoch=0.ckpt",
        [RankFailure(1, "OSError", "No space left on device", errno.ENOSPC), RankFailure(0, "WorkerDied", "killed by SIGKILL")],
    )
    assert err.path == "/ckpt/epoch=0.ckpt"
    assert err.ranks == (0, 1)
    msg = str(err)
    assert "/ckpt/epoch=0.ckpt" in msg and "rank 1" in msg and "ENOSPC" in msg and "SIGKILL" in msg
    assert isinstance(err, Exception)
    again = pickle.loads(pickle.dumps(err))
    assert again.failures == err.failures and str(again) == msg


def test_rank_failure_finds_the_errno_behind_a_wrapper():
    try:
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as e:
            raise RuntimeError("Worker failure") from e
    except RuntimeError as wrapped:
        f = RankFailure.from_exception(3, wrapped)
    assert f.errno == errno.EIO and f.error_type == "OSError" and f.rank == 3
