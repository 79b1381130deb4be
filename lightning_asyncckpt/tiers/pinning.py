"""Mapped share files registered with CUDA, so that a GPU state's copy into them runs at pinned speed.

A local save copies the state straight into ``MAP_SHARED`` mappings of node-local files. From CUDA memory
into such a mapping the copy is pageable: on an H200, 11 GB/s into a mapped ``/dev/shm`` file against
54 GB/s into pinned memory (``benchmarks/probe_d2h_mapped.py``), so the local tier stalled 4.4x longer than
the persistent tier's pinned staging (0.19 s against 0.044 s for 2 GiB). ``cudaHostRegister`` makes the
driver treat the mapping as pinned: 0.040 s, the same as pinned memory. Registering takes 0.15 s per 2 GiB,
once per file: the pool registers its files when it makes them, in the writer thread, off the stall.

A registered range must be unregistered before it is unmapped (the driver would keep its pages pinned),
so the pool calls :func:`unpin` wherever it lets go of a mapping. A registration the driver refuses (a
file system whose mappings it cannot pin) leaves that file pageable, with one log line per process.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, whichever thread registers
_refused: list[str] = []


def cuda_device(tensors: dict[str, torch.Tensor]) -> torch.device | None:
    """The CUDA device of a share's tensors (the first CUDA one), or None for a host state."""
    return next((t.device for t in tensors.values() if t.device.type == "cuda"), None)


def pin(tensor: torch.Tensor, device: torch.device) -> bool:
    """(any thread) Registers the mapped ``uint8`` tensor's memory with CUDA, with ``device`` current (so that
    a writer thread never makes a context on another GPU). True if it is now pinned."""
    if not tensor.numel():
        return False
    with torch.cuda.device(device):
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), _PORTABLE)
    if int(err) == 0:
        return True
    if not _refused:
        _refused.append(str(err))
        log.warning("lightning-asyncckpt: CUDA refused to pin the local tier's mapped files (%s): the copy from"
                    " the GPU into them stays pageable, several times slower (said once per process)", err)
    return False


def unpin(tensor: torch.Tensor) -> None:
    """(any thread) Unregisters what :func:`pin` registered; before the mapping goes."""
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
