"""Reading a checkpoint back: a directory this library (or DCP, or stock Lightning) wrote, or a
``torch.save`` file."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.format import integrity
from lightning_asyncckpt.format.zip_records import MemoryFile
from lightning_asyncckpt.integration import lightning_api
from lightning_asyncckpt.integration.lightning_api import TorchCheckpointIO
from lightning_asyncckpt.integration.map_location import for_file as map_location_for_file
from lightning_asyncckpt.storage import commit, destination, read_once

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.serialization import MAP_LOCATION


def load(path: Path | str, map_location: MAP_LOCATION = None, weights_only: bool | None = None,
         verify: bool = True, together: bool = False) -> dict[str, Any]:
    """(any rank; with ``together``, all ranks of the default group) The checkpoint at ``path`` (a remote one: a
    file, read as stock reads it, through fsspec); a clear error for a missing or incomplete one. A local one
    is checked first (:mod:`~lightning_asyncckpt.format.integrity`: a regular file, inside the checkpoint; with
    ``verify`` every record's CRC32): a damaged one raises ``CorruptCheckpointError`` naming the file and the
    record. ``together`` (every rank loads the same path at once: Lightning's resume, Fabric's ``load``): a local
    ``torch.save`` file, or every file of a local checkpoint directory (``AsyncDDPStrategy``'s), is read once
    across the ranks (:mod:`~lightning_asyncckpt.storage.read_once`)."""
    where = destination.of(path)
    far, path = where.is_remote, where.location
    if far and where.is_directory():  # a remote DCP directory: read from a local copy
        with where.localize() as local:
            return load(local, map_location=map_location, weights_only=weights_only, verify=verify)
    # together, every rank joins the agreement before anything may raise on it alone (a file missing or not
    # regular on one node): the others then fall back too, instead of waiting for it
    shared = None
    if together and not far and not path.is_dir():
        shared = read_once.read_together(path)
    if far or not path.is_dir() and path.exists():
        # stock's file: read as stock reads it (onto the CPU unless told otherwise), once checked
        # Lightning's callable map_location as "cpu", so that tensor subclasses (torchao's) load too
        kwargs = {"map_location": map_location_for_file(map_location)}
        if far and together:
            shared = read_once.read_url_together(path)
        if shared is not None:
            return _load_bytes(path, shared.data, weights_only, verify, **kwargs)
        if not far:
            integrity.check_file(path, crc=False)  # a regular file, before it is opened for the load
        try:
            if far or not verify:
                return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kwargs)
            return integrity.while_loading(lambda: integrity.check_file(path),
                                           lambda: TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kwargs))
        except pickle.UnpicklingError as e:  # torch's message does not say which file
            raise pickle.UnpicklingError(f"{path}: {e}") from None
        except Exception as e:
            if far or integrity.is_torch_zip(path):
                raise
            # a legacy (not zip) file, unchecked: random bytes fail in any way; say which file
            raise integrity.CorruptCheckpointError(f"{path}: not a checkpoint ({integrity.first_line(e)})") from e
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint at {str(path)!r} not found.")
    files = read_once.read_directory_together(path) if together else None  # before a raise, as above
    if not commit.is_committed(path):
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {commit.METADATA_FILE}).")
    if files is not None:  # every file read once across the ranks; the usual reader runs on the bytes exchanged
        with read_once.local_copy(path, files) as copy:
            del files
            try:
                return dcp_format.load(copy, map_location=map_location, weights_only=weights_only, verify=verify)
            except (integrity.CorruptCheckpointError, pickle.UnpicklingError) as e:  # name the checkpoint, not the copy
                raise type(e)(str(e).replace(str(copy), str(path))) from None
    return dcp_format.load(path, map_location=map_location, weights_only=weights_only, verify=verify)


def _load_bytes(path: Path, data: memoryview, weights_only: bool | None, verify: bool,
                map_location: MAP_LOCATION) -> dict[str, Any]:
    """(any rank) The ``torch.save`` file ``path`` loaded from its bytes in memory, as stock loads the file
    (Lightning's ``_load`` of a file object: ``torch.load`` with the same ``map_location`` and
    ``weights_only``), with every record's CRC32 checked on those bytes beside it (``verify``)."""
    read = lightning_api.fabric_module("utilities.cloud_io")._load

    def load_it() -> dict[str, Any]:
        return read(MemoryFile(data), map_location=map_location, weights_only=weights_only)

    try:
        if not verify:
            return load_it()
        return integrity.while_loading(lambda: integrity.check_bytes(path, data), load_it)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"{path}: {e}") from None
    except integrity.CorruptCheckpointError:
        raise
    except Exception as e:
        if bytes(data[:4]) == integrity.ZIP_MAGIC:
            raise
        raise integrity.CorruptCheckpointError(f"{path}: not a checkpoint ({integrity.first_line(e)})") from e


def is_sharded(path: object) -> bool:
    """Whether ``path`` is a local, committed sharded checkpoint directory (Lightning's layout: ``meta.pt``)."""
    local = destination.plain_path(path)
    return local is not None and local.is_dir() and commit.is_committed(local) and (local / dcp_format.META_FILE).is_file()


def load_sharded(path: Path, state: dict[str, object], strict: bool, weights_only: bool | None, verify: bool,
                 metadata: Metadata | None = None) -> dict[str, Any]:
    """(all ranks, together: DCP's ``load`` is collective) Lightning's and Fabric's load of a sharded checkpoint
    directory (``ModelParallelStrategy``'s, its sharded branch, unchanged in effect), with every rank's items
    read through :class:`~lightning_asyncckpt.format.dcp_reader.CheckedReader`: each rank checks the CRC32 of
    exactly the items it loads, as it reads them (once). A bad item raises ``CorruptCheckpointError`` naming
    the file and the item on every rank (DCP gathers each rank's failure).

    Args:
        path: the committed checkpoint directory, local, the same on every rank.
        state: the Fabric-style state: one distributed model, its optimizers, other values to fill in.
        strict: as the stock load's ``strict``.
        weights_only: as ``torch.load``'s, for ``.metadata`` (DCP's types only unless ``False``) and ``meta.pt``.
        verify: ``AsyncCheckpointIO.verify_on_load``: the CRC32 of the items, skeleton and ``meta.pt``.
        metadata: ``.metadata``, if the caller read it already.

    Returns:
        what the stock load returns: the values of ``meta.pt`` that ``state`` did not ask for.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.optim import Optimizer

    from lightning_asyncckpt.format.metadata import read_metadata

    model_parallel = lightning_api.fabric_module("strategies.model_parallel")
    if metadata is None:
        metadata = read_metadata(path, allow_pickle=weights_only is False, hint=dcp_format.PICKLE_HINT)
    integrity.check_directory(path, metadata, crc=verify, item_crc=False)  # paths, sizes, meta.pt: before reads
    modules = {k: m for k, m in state.items() if model_parallel._has_dtensor_modules(m)}
    if len(modules) != 1:  # the stock load says what is wrong
        return model_parallel._load_checkpoint(path=path, state=state, strict=strict, weights_only=weights_only)
    optimizers = {k: o for k, o in state.items() if isinstance(o, Optimizer)}
    (module_key, module), = modules.items()
    module_state = {module_key: get_model_state_dict(module)}
    dcp_format.read_into(path, metadata, module_state, verify)
    module.load_state_dict(module_state[module_key], strict=strict)
    for key, optimizer in optimizers.items():  # the optimizer states are loaded separately, as stock does
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp_format.read_into(path, metadata, optimizer_state, verify)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    meta = torch.load(path / dcp_format.META_FILE, weights_only=weights_only)
    requested = state.keys() - modules.keys() - optimizers.keys()
    model_parallel._validate_keys_for_strict_loading(requested, meta.keys(), strict=strict)
    for key in requested:
        if key in meta:
            state[key] = meta.pop(key)
    return meta
