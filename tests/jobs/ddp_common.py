"""What the 2-rank DDP job's cases (tests/jobs/ddp_job.py) share: the Trainer they build, the child
processes a rank left behind, and the switch that lets every rank raise by itself.
"""

from __future__ import annotations

import lightning as L

from processes import other_children


def ddp_trainer(args, plugins, callbacks, **kw):
    opts = dict(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out, num_sanity_val_steps=0,
    )
    opts.update(kw)
    t = L.Trainer(plugins=plugins, callbacks=callbacks, **opts)
    return t


_PEERS: set = set()


def own_children(trainer):
    """Child processes other than the DDP ranks Lightning launched (rank 0 is their parent)."""
    launcher = getattr(trainer.strategy, "launcher", None)
    _PEERS.update(p.pid for p in getattr(launcher, "procs", []))
    return other_children(lambda pid, line: pid in _PEERS)


def no_kill(trainer):
    # Lightning kills the other ranks when rank 0 fails; we want to see every rank raise by itself.
    launcher = getattr(trainer.strategy, "launcher", None)
    if launcher is not None:
        launcher.kill = lambda *a, **k: None
