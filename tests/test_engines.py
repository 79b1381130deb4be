import pytest

from lightning_asyncckpt import AsyncCheckpointIO, engines
from lightning_asyncckpt.errors import EngineNotAvailableError


def test_explicit_and_auto_resolution():
    assert AsyncCheckpointIO("nvrx").engine == "nvrx"
    assert AsyncCheckpointIO("mcore").engine == "mcore"
    assert AsyncCheckpointIO().engine == "nvrx"
    assert AsyncCheckpointIO(worker="fork").worker == "fork"


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="'nvrx', 'mcore', 'auto'"):
        AsyncCheckpointIO("torch")
    with pytest.raises(ValueError, match="'persistent', 'fork'"):
        AsyncCheckpointIO(worker="thread")


def test_missing_engine_names_the_install_command(monkeypatch):
    monkeypatch.setattr(engines, "_importable", lambda name: name is engines.EngineName.MCORE)
    with pytest.raises(EngineNotAvailableError, match="pip install nvidia-resiliency-ext"):
        engines.resolve("nvrx")
    with pytest.warns(UserWarning, match="falls back to Megatron-Core"):
        assert engines.resolve("auto") is engines.EngineName.MCORE
    monkeypatch.setattr(engines, "_importable", lambda name: False)
    with pytest.raises(EngineNotAvailableError, match=r"lightning-asyncckpt\[mcore\]"):
        engines.resolve("mcore")


@pytest.mark.parametrize("name", list(engines.EngineName)[:2])
@pytest.mark.parametrize("worker", list(engines.WorkerMode))
def test_created_engines_implement_the_protocol(name, worker):
    engine = engines.create(name, worker, rank=0)
    try:
        assert isinstance(engine, engines.EngineProtocol)
        assert engine.persistent is (worker is engines.WorkerMode.PERSISTENT) and engine.version
    finally:
        engine.close()


@pytest.mark.parametrize("kwargs", [{"thread_count": 0}, {"max_pending": 0}, {"timeout_s": 0}])
def test_bad_arguments_are_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        AsyncCheckpointIO(**kwargs)
