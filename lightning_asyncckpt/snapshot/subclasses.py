"""Tensor subclasses: which are written as they are, which are taken apart for staging, which are dequantized.

Stock ``torch.save`` writes a tensor subclass as itself (its type, dtype and bytes), and so does stock DCP
(each item one ``torch.save`` of the subclass). So do we, in three ways:

- **Traceable wrapper subclasses** (those with ``__tensor_flatten__``, e.g. torchao's low-bit optimizer
  states ``OptimState8bit`` / ``OptimState4bit`` / ``OptimStateFp8``): a wrapper owns no storage; its inner
  tensors (``codes``, ``scale``, ...) hold the bytes. :func:`lightning_asyncckpt.snapshot.tree.walk`
  descends into them as into a container: the inner tensors are staged like any tensor (copied into host
  buffers, lazily when the optimizer owns them), and the wrapper is rebuilt around the copies with
  ``__tensor_unflatten__``; the skeleton holds the wrapper rebuilt around ``meta`` placeholders. The file
  written is stock's: the subclass pickled with its inner tensors.
- **TransformerEngine's quantized tensors** (FP8, MXFP8, blockwise, NVFP4): dequantized, in the dtype they
  report, as Megatron does for its DCP shards (readers need no TransformerEngine). Recognized by their
  type's module, ``transformer_engine.*``, not by having a ``dequantize`` method: torchao's states have one too.
- **Any other subclass**: left in the skeleton whole, serialized by ``torch.save`` itself at save time, as
  sparse and nested tensors are.

``DTensor`` is none of these: sharded saves stage its local shard (:mod:`lightning_asyncckpt.snapshot.staging`).
Imports torch only.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_warned: set[str] = set()

_TE_MODULE = "transformer_engine"


def is_transformer_engine(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of TransformerEngine's quantized tensors (its class, or a parent below
    ``torch.Tensor``, is defined in a ``transformer_engine`` module): the tensors that are dequantized."""
    for cls in type(t).__mro__:
        if cls is torch.Tensor:
            return False
        module = getattr(cls, "__module__", "") or ""
        if module == _TE_MODULE or module.startswith(_TE_MODULE + "."):
            return True
    return False


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def is_wrapper(t: object) -> bool:
    """Whether ``t`` is a traceable wrapper subclass that is staged through its inner tensors (not a
    ``DTensor``, not TransformerEngine's)."""
    return (
        isinstance(t, torch.Tensor)
        and type(t) is not torch.Tensor
        and hasattr(t, "__tensor_flatten__")
        and hasattr(type(t), "__tensor_unflatten__")
        and not _is_dtensor(t)
        and not is_transformer_engine(t)
    )


def is_plain(t: torch.Tensor) -> bool:
    """A tensor whose data a staging buffer of its shape and dtype holds exactly: a plain tensor, a
    ``Parameter``, a ``DTensor`` (its local shard) or one of TransformerEngine's (its dequantized values)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or _is_dtensor(t) or is_transformer_engine(t)


def inner_names(t: torch.Tensor) -> list[str]:
    """The attribute names of wrapper ``t``'s inner tensors, in ``__tensor_flatten__``'s order."""
    names, _ = t.__tensor_flatten__()
    return list(names)


def rebuild(t: torch.Tensor, inner: dict[str, object]) -> torch.Tensor:
    """Wrapper ``t`` around ``inner`` (its inner tensors, replaced): ``t`` itself when none changed, or when
    a replacement is not a tensor (a caller's placeholder), so that the original is kept whole."""
    names, ctx = t.__tensor_flatten__()
    if all(inner[n] is getattr(t, n) for n in names):
        return t
    if not all(isinstance(inner[n], torch.Tensor) for n in names):
        return t
    try:
        return type(t).__tensor_unflatten__({n: inner[n] for n in names}, ctx, t.size(), t.stride())
    except Exception:  # noqa: BLE001 - a subclass that cannot be rebuilt on these inner tensors stays whole
        return t


def warn_dequantized(name: str, t: torch.Tensor) -> None:
    """Says once per tensor name (per process) that ``t`` is written dequantized, and what it costs."""
    if name in _warned:
        return
    _warned.add(name)
    nbytes = t.numel() * t.element_size()
    held = sum(v.numel() * v.element_size() for v in vars(t).values() if isinstance(v, torch.Tensor))
    log.warning("lightning-asyncckpt: %r (%s) is written dequantized, as %s: %d bytes where its quantized data"
                " and scales hold %d, as Megatron writes TransformerEngine's tensors, so that the checkpoint"
                " loads without TransformerEngine (said once per tensor)",
                name, type(t).__name__, t.dtype, nbytes, held)
