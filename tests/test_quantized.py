"""TransformerEngine's quantized tensor subclasses (FP8 / MXFP8) are written dequantized, as plain tensors.

TransformerEngine does not install without CUDA, so these tests use a faithful emulation of its
quantized tensors: ``_make_wrapper_subclass`` wrappers with no storage of their own, holding uint8 data
and scales, with ``dequantize`` defined in the class body (TE's formula: the FP8 bits viewed as
``float8_e4m3fn``, widened to fp32, times the inverse scale, cast to the nominal dtype) and a
``__torch_dispatch__`` that keeps the subclass through ``detach``. On a CPU-only torch build such a
wrapper can claim the CUDA device without allocating there, so both devices are tested. The real
``te.Linear`` test is in test_gpu.py.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch.utils._pytree import tree_map

from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.snapshot import staging

aten = torch.ops.aten


class EmulatedFloat8Tensor(torch.Tensor):
    """Like TE's ``Float8Tensor``: FP8 (E4M3) bits in a uint8 tensor, one inverse scale, a nominal dtype.
    Defined, as TE's are, in a ``transformer_engine`` module: that is how they are recognized."""

    __module__ = "transformer_engine.pytorch.tensor.float8_tensor"

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, device: str | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=torch.device(device) if device else data.device, requires_grad=False
        )

    def __init__(self, data, scale_inv, dtype, device=None):
        self._data = data
        self._scale_inv = scale_inv

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self.dtype if dtype is None else dtype
        return (self._data.view(torch.float8_e4m3fn).to(torch.float32) * self._scale_inv).to(dtype)

    def _like(self, data):
        return type(self)(data, self._scale_inv, self.dtype, self.device.type)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._like(args[0]._data)
        # anything else runs on the dequantized values, as TE does for ops it does not implement
        unwrap = lambda x: x.dequantize() if isinstance(x, EmulatedFloat8Tensor) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    __torch_function__ = torch._C._disabled_torch_function_impl


class EmulatedFloat8Param(EmulatedFloat8Tensor):
    """Inherits ``dequantize`` from a parent below ``torch.Tensor`` (TE's parameter classes do)."""


class EmulatedMXFP8Tensor(EmulatedFloat8Tensor):
    """Like TE's ``MXFP8Tensor``: E4M3 bits with one power-of-two (E8M0) scale per 32 values; reports bf16."""

    @staticmethod
    def __new__(cls, data, scale_inv, dtype=torch.bfloat16, device=None):
        return EmulatedFloat8Tensor.__new__(cls, data, scale_inv, dtype, device)

    def __init__(self, data, scale_inv, dtype=torch.bfloat16, device=None):
        super().__init__(data, scale_inv, dtype, device)

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self.dtype if dtype is None else dtype
        values = self._data.view(torch.float8_e4m3fn).to(torch.float32).reshape(-1, 32)
        scales = torch.pow(2.0, self._scale_inv.to(torch.float32) - 127.0).reshape(-1, 1)
        return (values * scales).reshape(self.shape).to(dtype)


def _fp8_bits(shape, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g) * 8
    return values.to(torch.float8_e4m3fn).view(torch.uint8)


def _quantized_state(device: str) -> dict:
    fp8 = EmulatedFloat8Tensor(_fp8_bits((16, 8), 0), torch.tensor(0.125), torch.float32, device)
    fp8_bf16 = EmulatedFloat8Param(_fp8_bits((8, 8), 1), torch.tensor(2.0), torch.bfloat16, device)
    mx = EmulatedMXFP8Tensor(_fp8_bits((4, 64), 2), torch.randint(120, 134, (8,), dtype=torch.uint8), device=device)
    return {
        "global_step": 7,
        "state_dict": {
            "fc1.weight": fp8,
            "fc2.weight": fp8_bf16,
            "fc3.weight": mx,
            "norm.weight": torch.randn(8).to(torch.bfloat16),
            "head.weight": torch.randn(4, 8).to(torch.float16),
        },
    }


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: EmulatedFloat8Tensor(_fp8_bits((2,), 0), torch.tensor(1.0), torch.float32), True),
        (lambda: EmulatedFloat8Param(_fp8_bits((2,), 0), torch.tensor(1.0), torch.bfloat16, "cuda"), True),
        (lambda: EmulatedMXFP8Tensor(_fp8_bits((32,), 0), torch.full((1,), 127, dtype=torch.uint8)), True),
        (lambda: torch.ones(2, dtype=torch.bfloat16), False),
        (lambda: torch.ones(2, dtype=torch.float16), False),
        (lambda: torch.nn.Parameter(torch.ones(2)), False),
        (lambda: torch.ones(2).as_subclass(type("Plain", (torch.Tensor,), {})), False),
        # a dequantize of its own outside TransformerEngine (torchao's optimizer states have one): kept whole
        (lambda: torch.ones(2).as_subclass(type("OwnDequantize", (torch.Tensor,), {"dequantize": lambda self: self})), False),
    ],
    ids=["float8", "inherited-cuda", "mxfp8", "bf16", "fp16", "parameter", "plain-subclass", "not-transformer-engine"],
)
def test_detection_looks_for_a_transformer_engine_class_below_torch_tensor(make, expected):
    t = make()
    assert hasattr(t, "dequantize")  # every tensor has it: that is why it is not the test
    assert staging.is_quantized(t) is expected


def test_plain_tensors_are_never_touched():
    bf16 = torch.randn(4).to(torch.bfloat16)
    assert staging.dequantized(bf16) is bf16


def test_dequantized_is_plain_in_the_nominal_dtype():
    mx = EmulatedMXFP8Tensor(_fp8_bits((2, 32), 3), torch.tensor([125, 130], dtype=torch.uint8))
    out = staging.dequantized(mx)
    assert type(out) is torch.Tensor and out.dtype is torch.bfloat16 and out.shape == mx.shape
    assert torch.equal(out, mx.dequantize())


def test_no_hasattr_dequantize_in_the_package():
    root = pathlib.Path(staging.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text().replace(" ", "")
        assert 'hasattr(' not in text or '"dequantize")' not in text and "'dequantize')" not in text, path


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_quantized_tensors_are_written_dequantized(engine_worker, device, tmp_path, hold):
    engine, worker = engine_worker
    state = _quantized_state(device)
    sd = state["state_dict"]
    expected = {k: (v.dequantize() if staging.is_quantized(v) else v.clone()) for k, v in sd.items()}
    io = AsyncCheckpointIO(engine, worker=worker, timeout_s=60)
    try:
        io.write_hook = hold  # the write waits until the data has changed
        io.save_checkpoint(state, tmp_path / "q")
        # the save is a snapshot: changing the quantized data now does not reach the checkpoint
        for v in sd.values():
            (v._data if staging.is_quantized(v) else v).zero_()
        hold.release()
        io.finalize(blocking=True)
        loaded = io.load_checkpoint(tmp_path / "q", weights_only=True)
    finally:
        io.teardown()
    for k, want in expected.items():
        got = loaded["state_dict"][k]
        assert type(got) is torch.Tensor, k
        assert got.dtype == want.dtype and got.device.type == "cpu", k
        assert torch.equal(got, want), k
    assert loaded["state_dict"]["norm.weight"].dtype is torch.bfloat16
    assert loaded["state_dict"]["fc3.weight"].dtype is torch.bfloat16  # MXFP8 reports bf16


@pytest.mark.parametrize("copy_cpu", [True, False], ids=["copy", "fork-keeps-cpu-tensors"])
def test_sharded_snapshot_dequantizes_too(copy_cpu):
    state = _quantized_state("cpu")
    snap = staging.Stager(shared=False, copy_cpu=copy_cpu).snapshot_tree(state)
    for k, v in state["state_dict"].items():
        got = snap.skeleton["state_dict"][k]
        assert type(got) is torch.Tensor
        assert torch.equal(got, v.dequantize() if staging.is_quantized(v) else v)
