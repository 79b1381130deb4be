"""The ``map_location`` a ``torch.save`` file is read with, so that files holding tensor subclasses load.

Lightning reads checkpoints with a callable ``map_location``, ``lambda storage, loc: storage`` (keep every
storage on the CPU, where torch deserializes it). torch refuses any callable for a wrapper subclass
(``RuntimeError: Callable map_location not supported with _rebuild_wrapper_subclass``), so stock Lightning
2.6.6 cannot resume a checkpoint holding torchao's low-bit optimizer states. A callable that returns the
CPU storage it is handed, whatever the location, means ``"cpu"``: that is what the file is read with
instead. Any other callable is passed on as it is (a file without wrapper subclasses loads as before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION

# the location tags a probe asks about: the CPU, and the CUDA devices a GPU checkpoint names
_PROBE_LOCATIONS = ("cpu", "cuda", "cuda:0", "cuda:1")


def for_file(map_location: MAP_LOCATION) -> MAP_LOCATION:
    """(any rank, before ``torch.load`` of a file) ``"cpu"`` for ``None`` (Lightning's default, the identity
    callable) and for a callable that keeps every storage where it is; ``map_location`` otherwise."""
    if map_location is None:
        return "cpu"
    if not callable(map_location) or isinstance(map_location, torch.device):
        return map_location
    probe = torch.UntypedStorage(1)
    try:
        if all(map_location(probe, loc) is probe for loc in _PROBE_LOCATIONS):
            return "cpu"
    except Exception:  # noqa: BLE001 - a callable that cannot answer a probe is used as it is
        pass
    return map_location
