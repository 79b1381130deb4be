"""The checkpoint-dict zoo: every kind of dict stock ``TorchCheckpointIO`` can save, saved by stock and
through the plugin (both engines, real workers), loaded back with ``torch.load`` (both ``weights_only``
settings where stock's file allows) and compared by type, dtype, shape, stride, storage offset, storage
sharing, ``requires_grad`` and values."""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import warnings
from typing import Any

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_asyncckpt import AsyncCheckpointIO


@dataclasses.dataclass
class Holder:
    weight: torch.Tensor
    note: str = "kept"


Pair = collections.namedtuple("Pair", ["a", "b"])


def _cases() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=g)
    base = torch.arange(40, dtype=torch.float32)
    tied = torch.randn(5, 3, generator=g)
    shared = torch.randn(16, generator=g)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
              torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
    dtypes += [d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32"))
               if d is not None]
    held = torch.randn(4, generator=g)
    cases: dict[str, Any] = {
        "view_and_base": {"w": base, "v": base[2:5]},
        "transposed": {"t": w.t()},
        "strided": {"s": base[::3]},
        "offset_alone": {"o": base[30:]},
        "expanded": {"e": torch.ones(3, 1).expand(3, 1000)},
        "parameter": {"p": torch.nn.Parameter(torch.randn(3, 2, generator=g)),
                      "frozen": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False)},
        "requires_grad": {"g": torch.randn(3, generator=g, requires_grad=True)},
        "sparse_coo": {"c": torch.randn(4, 5, generator=g).relu().to_sparse()},
        "sparse_csr": {"r": torch.randn(4, 5, generator=g).relu().to_sparse_csr()},
        "quantized": {"q": torch.quantize_per_tensor(torch.randn(4, 3, generator=g), 0.1, 3, torch.qint8)},
        "nested": {"n": torch.nested.nested_tensor([torch.randn(2, 3, generator=g), torch.randn(4, 3, generator=g)])},
        "dataclass_sharing_a_top_level_tensor": {"h": Holder(held), "top": held},
        "tied_same_object": {"a": tied, "b": tied},
        "tied_two_detaches": {"a": shared.detach(), "b": shared.detach()},
        "every_dtype": {str(d): (torch.arange(6) % 2).to(d) for d in dtypes},
        "nan_and_negative_zero": {"x": torch.tensor([math.nan, -0.0, 0.0, math.inf, -math.inf])},
        "zero_dim_and_empty": {"z": torch.tensor(3.5), "e": torch.empty(0, 4), "i": torch.tensor(7)},
        "containers": {"l": [torch.ones(2), {"k": (torch.zeros(1), 3)}], "nt": Pair(torch.ones(1), "b"), 5: "int key",
                       "od": collections.OrderedDict(x=torch.ones(2))},
        "numpy_values": {"arr": torch.from_numpy(__import__("numpy").arange(6.0))},
        "ordered_dict_with_a_view": collections.OrderedDict(w=tied.view(-1), v=tied.view(-1)[1:4]),
    }
    return cases


def _storage_groups(obj: Any) -> list[list[int]]:
    """Which tensor leaves (by traversal position) share one storage: the sharing pattern."""
    seen: dict[int, list[int]] = {}
    leaves = _leaves(obj)
    for i, t in enumerate(leaves):
        if t.layout is torch.strided and not t.is_nested and not t.is_quantized and t.numel():
            seen.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    return sorted(v for v in seen.values() if len(v) > 1)


def _leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _leaves(v)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _leaves(getattr(obj, f.name))]
    return []


def _same_tensor(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    assert a.layout == b.layout and a.dtype == b.dtype, f"{where}: {a.layout}/{a.dtype} != {b.layout}/{b.dtype}"
    assert a.requires_grad == b.requires_grad, f"{where}: requires_grad {a.requires_grad} != {b.requires_grad}"
    if a.is_nested:
        assert all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True)), f"{where}: values"
        return
    assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.is_quantized:
        assert (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point()), f"{where}: quantization"
        assert torch.equal(a.int_repr(), b.int_repr()), f"{where}: values"
        return
    if a.layout is not torch.strided:
        assert torch.equal(a.to_dense(), b.to_dense()), f"{where}: values"
        return
    assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset(), (
        f"{where}: stride/offset {a.stride()}/{a.storage_offset()} != {b.stride()}/{b.storage_offset()}")
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes(), f"{where}: storage size"
    assert bytes(a.detach().contiguous().view(-1).view(torch.uint8).numpy()) == \
        bytes(b.detach().contiguous().view(-1).view(torch.uint8).numpy()), f"{where}: values"


def assert_same_as_stock(ours: Any, stock: Any, where: str) -> None:
    assert type(ours) is type(stock), f"{where}: {type(ours).__name__} != {type(stock).__name__}"
    if isinstance(stock, torch.Tensor):
        _same_tensor(ours, stock, where)
    elif isinstance(stock, dict):
        assert list(ours) == list(stock), f"{where}: keys {list(ours)} != {list(stock)}"
        for k in stock:
            assert_same_as_stock(ours[k], stock[k], f"{where}.{k}")
    elif isinstance(stock, (list, tuple)):
        assert len(ours) == len(stock), f"{where}: length"
        for i, (x, y) in enumerate(zip(ours, stock)):
            assert_same_as_stock(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(stock):
        for f in dataclasses.fields(stock):
            assert_same_as_stock(getattr(ours, f.name), getattr(stock, f.name), f"{where}.{f.name}")
    else:
        assert ours == stock, f"{where}: {ours!r} != {stock!r}"
    if where.count(".") == 0:  # the whole dict: the same tensors share storages, and the same objects are one
        assert _storage_groups(ours) == _storage_groups(stock), f"{where}: storage sharing differs"
        ids_ours = [id(t) for t in _leaves(ours)]
        ids_stock = [id(t) for t in _leaves(stock)]
        assert [ids_ours.index(i) for i in ids_ours] == [ids_stock.index(i) for i in ids_stock], \
            f"{where}: object identity differs"


def _load(path: Any, weights_only: bool) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, weights_only=weights_only)


@pytest.mark.parametrize("engine", ["nvrx", "mcore"])
def test_every_dict_stock_saves_loads_as_stocks_file(tmp_path, engine):
    cases = _cases()
    stock = TorchCheckpointIO()
    for name, ckpt in cases.items():
        stock.save_checkpoint(ckpt, tmp_path / "stock" / f"{name}.ckpt")
    worker = "persistent" if engine == "nvrx" else "fork"
    with AsyncCheckpointIO(engine, worker=worker) as plugin:
        for name, ckpt in cases.items():
            plugin.save_checkpoint(ckpt, tmp_path / "ours" / f"{name}.ckpt")
        plugin.finalize(blocking=True)
    failures = []
    for name in cases:
        for weights_only in (False, True):
            try:
                expected = _load(tmp_path / "stock" / f"{name}.ckpt", weights_only)
            except Exception:  # noqa: BLE001 - stock's own file does not load this way: nothing to compare
                assert weights_only, name
                continue
            try:
                assert_same_as_stock(_load(tmp_path / "ours" / f"{name}.ckpt", weights_only), expected, name)
            except (AssertionError, Exception) as e:  # noqa: BLE001 - every case reported, not just the first
                failures.append(f"{name} (weights_only={weights_only}): {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def test_stock_bytes_for_the_plain_cases(tmp_path):
    """For a CPU checkpoint the file is stock's, byte for byte: the cases whose tensors are plain."""
    cases = _cases()
    plain = ["view_and_base", "transposed", "strided", "offset_alone", "expanded", "parameter", "requires_grad",
             "tied_same_object", "tied_two_detaches", "every_dtype", "nan_and_negative_zero", "zero_dim_and_empty",
             "containers", "dataclass_sharing_a_top_level_tensor", "ordered_dict_with_a_view"]
    with AsyncCheckpointIO("nvrx") as plugin:
        for name in plain:
            plugin.save_checkpoint(cases[name], tmp_path / f"{name}.ckpt")
        plugin.finalize(blocking=True)
    differ = []
    for name in plain:
        buf = io.BytesIO()
        torch.save(cases[name], buf)
        if (tmp_path / f"{name}.ckpt").read_bytes() != buf.getvalue():
            differ.append(name)
    assert not differ, f"not stock's bytes: {differ}"
