"""The commands of ``lightning-asyncckpt`` that remove files: ``clean`` (leftovers of interrupted saves in a
checkpoint directory) and ``local`` (a node's local-tier files, listed, checked, or removed). Both list what
they would remove unless given ``--yes``, and neither touches anything else."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.tools.usage import EXIT_FAILED, EXIT_OK, CliError, existing, tree_size
from lightning_asyncckpt.units import human_bytes

# -------------------------------------------------------------------------------------------------
# clean


def cmd_clean(args: argparse.Namespace) -> int:
    """``clean DIR [--yes] [--any-host]``: lists what the library's own sweep (:func:`commit.plan_sweep`) would
    do in ``DIR``: the checkpoints that a replace interrupted between its two renames moved aside go back to
    their paths, the leftovers of gone processes are removed, those of live ones (and, without
    ``--any-host``, of other hosts) are kept; with ``--yes`` it does it. A link is removed as a link."""
    dirpath = existing(args.dir)
    if not dirpath.is_dir():
        raise CliError(f"{dirpath}: not a directory")
    try:
        plan = commit.plan_sweep(dirpath, any_host=args.any_host)
    except OSError as e:
        raise CliError(f"cannot list {dirpath}: {e.strerror or e}") from None
    if not (plan.restore or plan.remove or plan.keep):
        print(f"no leftovers of interrupted saves in {dirpath}")
        return EXIT_OK
    now = time.time()
    sizes = {p: tree_size(p) for p in plan.remove}

    def what(p: Path) -> str:
        return f"{p} ({human_bytes(sizes[p])}, modified {_age(max(0.0, now - p.lstat().st_mtime))} ago)"

    for p, why in plan.keep:
        print(f"kept {p}: {why}")
    if not args.yes:
        for aside, target in plan.restore:
            print(f"would put back {target} (from {aside.name}, where an interrupted replace moved it)")
        for p in plan.remove:
            print(f"would remove {what(p)}")
        print(f"{len(plan.restore)} to put back, {len(plan.remove)} leftover(s) to remove,"
              f" {human_bytes(sum(sizes.values()))}; run again with --yes to do it")
        return EXIT_OK
    listed = {p: what(p) for p in plan.remove}
    restored, removed = commit.sweep(dirpath, plan)
    for target in restored:
        print(f"put back {target}")
    for p in removed:
        print(f"removed {listed[p]}")
    failed = [str(t) for _, t in plan.restore if t not in restored] + [str(p) for p in plan.remove if p not in removed]
    total = human_bytes(sum(sizes[p] for p in removed))
    print(f"put back {len(restored)}, removed {len(removed)} leftover(s), {total}; kept {len(plan.keep)}")
    if any(why.startswith("written on another host") for _, why in plan.keep):
        print("the leftovers of other hosts' processes stay: once no job anywhere saves into this directory,"
              " run again with --any-host to remove them")
    if failed:
        raise CliError(f"{len(failed)} could not be put back or removed (see the warnings above): {', '.join(failed)}",
                       EXIT_FAILED)
    return EXIT_OK


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f} {unit}"
    return f"{seconds:.0f} s"


# -------------------------------------------------------------------------------------------------
# local


def cmd_local(args: argparse.Namespace) -> int:
    """``local DIR [--session S] [--verify] [--remove [--yes]] [--json]``: a node's local-tier files."""
    from lightning_asyncckpt.tools import local_command as local_tier

    if args.yes and not args.remove:
        raise CliError("--yes confirms --remove; add --remove to remove the session's files")
    if args.json and args.remove:
        raise CliError("--json only lists; leave it out to --remove")
    path = existing(args.dir)
    try:
        found = local_tier.sessions(path, args.session)
    except local_tier.NoLocalTier as e:
        raise CliError(str(e)) from None
    except OSError as e:  # a directory this user cannot list
        raise CliError(f"cannot read {e.filename}: {e.strerror or e}") from None
    bad = sum(local_tier.verify(s) for s in found) if args.verify else 0
    if args.json:
        print(json.dumps([local_tier.as_dict(s) for s in found], indent=1))
    else:
        print("\n".join(local_tier.format_session(s) for s in found) or f"{path}: no sessions")
    if bad:
        raise CliError(f"{bad} share(s) failed their CRC32 check (listed above as BAD)", EXIT_FAILED)
    if args.verify and not args.json:
        print(f"verified {sum(len(s.shares) for s in found)} share(s): OK")
    if not args.remove:
        return EXIT_OK
    for s in found:
        if not args.yes:
            print(f"would remove {s.path} ({human_bytes(s.nbytes)}); run again with --yes to remove it")
        elif users := local_tier.users(s.path):
            raise CliError(f"{s.path} is in use by {', '.join(users)}: stop that job first (nothing removed)",
                           EXIT_FAILED)
        else:
            try:
                done = local_tier.remove(s)
            except OSError as e:
                raise CliError(f"cannot remove {e.filename or s.path}: {e.strerror or e}", EXIT_FAILED) from None
            for path, why in done.kept:
                print(f"kept {path} ({why})")
            where = f"{s.path}" if not done.kept else f"the local tier's files of {s.path}"
            print(f"removed {where} ({done.files} file(s), {human_bytes(done.nbytes)})")
    return EXIT_OK
