"""Loading a local-tier step into a Fabric state with FSDP2 or tensor parallelism
(:class:`~lightning_asyncckpt.integration.fabric.AsyncFabricModelParallelStrategy`).

Each rank restores only its own shards (``FabricTiers.resume``); they are made ``DTensor``s again on the
model's own mesh and loaded as Fabric's ``ModelParallelStrategy`` loads a sharded checkpoint: the model and
the optimizers through ``set_*_state_dict``, every other requested key put into ``state`` as saved, and the
keys the state did not ask for returned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lightning_asyncckpt.integration import lightning_api
from lightning_asyncckpt.tiers import shares


def load_shards(restored: dict[str, object], state: dict[str, object], strict: bool,
                device: torch.device) -> dict[str, Any]:
    """(every rank, in ``fabric.load`` of the key ``FabricTiers.resume`` got) Loads this rank's shards of a
    local step (``restored``, as :meth:`FabricTiers.step_end` saved them) into ``state``'s model and
    optimizers and its other keys; returns what ``state`` did not request. ``strict``: as ``fabric.load``'s
    (a requested key the checkpoint lacks, a parameter missing on either side, raise)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_parallel = lightning_api.fabric_module("strategies.model_parallel")
    modules = {k: m for k, m in state.items() if model_parallel._has_dtensor_modules(m)}
    if len(modules) != 1:
        raise ValueError(
            "fabric.load(...) of a local-tier step needs exactly one distributed model in the state (e.g."
            f" `{{'model': model, 'optimizer': optimizer, ...}}`), set up by the strategy; found {len(modules)}."
        )
    (module_key, module), = modules.items()
    optimizers = {k: o for k, o in state.items() if isinstance(o, Optimizer)}
    checkpoint = shares.rebuild(restored, shares.meshes_of(module), device)
    options = StateDictOptions(strict=strict)
    set_model_state_dict(module, checkpoint.pop(module_key), options=options)
    for key, optimizer in optimizers.items():
        set_optimizer_state_dict(module, optimizer, optim_state_dict=checkpoint.pop(key), options=options)
    requested = state.keys() - modules.keys() - optimizers.keys()
    lightning_api.fabric_module("strategies.strategy")._validate_keys_for_strict_loading(
        requested, checkpoint.keys(), strict=strict)
    for key in requested & checkpoint.keys():
        state[key] = checkpoint.pop(key)
    return checkpoint
