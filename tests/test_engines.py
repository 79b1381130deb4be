import pytest

from lightning_asyncckpt import AsyncCheckpointIO, engines
from lightning_asyncckpt.errors import EngineNotAvailableError


def test_explicit_and_auto_resolution():
    assert AsyncCheckpointIO("nvrx").engine == "nvrx"
    assert AsyncCheckpointIO("mcore").engine == "mcore"
    assert AsyncCheckpointIO().engine == "nvrx"
    assert AsyncCheckpointIO(worker="fork").settings.worker == "fork"


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


def _start(engine, preload=None):
    if preload is not None:
        engine._persistent_caller().preload(preload)  # what the worker imports before it is ready
    engine.start(timeout_s=120, directories=False)


@pytest.fixture
def persistent():
    """An engine whose queues (and multiprocessing's resource tracker) exist: only its worker starts later."""
    engine = engines.create(engines.EngineName.NVRX, engines.WorkerMode.PERSISTENT, rank=0)
    engine._persistent_caller()
    yield engine
    engine.close(abort=True)


def test_a_worker_whose_interpreter_is_gone_says_so(persistent, monkeypatch, tmp_path):
    """The job's virtualenv was removed or rebuilt under it: the spawned worker's exec fails (code 255)."""
    import multiprocessing

    gone = tmp_path / "venv" / "bin" / "python"
    monkeypatch.setattr(multiprocessing.spawn, "_python_exe", multiprocessing.spawn.get_executable())  # put back after
    multiprocessing.set_executable(str(gone))
    with pytest.raises(RuntimeError, match=rf"exited while starting \(code 255\): cannot run the Python interpreter"
                                           rf" {gone} .*No such file or directory"):
        _start(persistent)


def test_a_worker_that_cannot_import_what_it_needs_names_the_error(persistent, monkeypatch, tmp_path):
    (tmp_path / "gpu_extension.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the worker gets the trainer's sys.path
    with pytest.raises(RuntimeError, match=r"exited while starting \(code 1\): ImportError: libcuda.so.1: cannot open"):
        _start(persistent, preload=("gpu_extension",))


def test_a_worker_that_python_cannot_start_shows_what_python_said(persistent, monkeypatch, tmp_path):
    """An environment that breaks the interpreter before any of our code runs (here ``PYTHONHOME``)."""
    monkeypatch.setenv("PYTHONHOME", str(tmp_path / "nohome"))
    with pytest.raises(RuntimeError, match=r"exited while starting \(code 1\): .*Python .*says: .*encodings"):
        _start(persistent)


def test_a_save_whose_worker_could_not_start_fails_naming_why(monkeypatch, tmp_path):
    """No warmup: the first save starts the worker, and its error says why the worker did not start."""
    import torch

    from lightning_asyncckpt import CheckpointWriteError

    (tmp_path / "gpu_extension.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    io = AsyncCheckpointIO(timeout_s=120)
    real = engines.create

    def create(*args, **kwargs):
        engine = real(*args, **kwargs)
        engine._persistent_caller().preload(("gpu_extension",))
        return engine

    monkeypatch.setattr(engines, "create", create)
    try:
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
        with pytest.raises(CheckpointWriteError, match=r"while starting: ImportError: libcuda.so.1: cannot open"):
            io.finalize(blocking=True)
    finally:
        io.teardown()


def test_mcore_without_its_async_queue_is_refused_by_name_and_auto_takes_nvrx(monkeypatch):
    """A megatron-core release without the async queue (Megatron-LM removed it upstream), faked: the detection
    looks for the queue's modules, not for a version."""
    import importlib.metadata
    import warnings

    real_found, real_version = engines._found, importlib.metadata.version
    monkeypatch.setattr(engines, "_found", lambda m: m not in engines.MCORE_QUEUE and real_found(m))
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda dist: "0.20.0" if dist == "megatron-core" else real_version(dist))
    with pytest.raises(EngineNotAvailableError) as refused:
        AsyncCheckpointIO("mcore")
    message = str(refused.value)
    for part in ("megatron-core 0.20.0", "async checkpoint queue", f"known to carry it is {engines.MCORE_NEWEST_WITH_QUEUE}",
                 "strategy='nvrx'", f"megatron-core<={engines.MCORE_NEWEST_WITH_QUEUE}"):
        assert part in message, message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" takes nvrx without a word
        assert engines.resolve("auto") is engines.EngineName.NVRX
    monkeypatch.setattr(engines, "_found", lambda m: m not in (*engines.MCORE_QUEUE, "nvidia_resiliency_ext")
                        and real_found(m))
    with pytest.raises(EngineNotAvailableError, match="megatron-core 0.20.0 does not ship"):
        engines.resolve("auto")
