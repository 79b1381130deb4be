"""The commands of ``lightning-asyncckpt`` that remove files: ``clean`` (leftovers of interrupted saves in a
checkpoint directory) and ``local`` (a node's local-tier files, listed, checked, or removed). Both list what
they would remove unless given ``--yes``, and neither touches anything else."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

from lightning_asyncckpt.format import commit
from lightning_asyncckpt.tools.usage import EXIT_FAILED, EXIT_OK, CliError, existing, tree_size
from lightning_asyncckpt.units import human_bytes

# -------------------------------------------------------------------------------------------------
# clean


def cmd_clean(args: argparse.Namespace) -> int:
    """``clean DIR [--yes]``: lists the leftovers of interrupted saves in ``DIR``; removes them with ``--yes``."""
    dirpath = existing(args.dir)
    if not dirpath.is_dir():
        raise CliError(f"{dirpath}: not a directory")
    try:
        leftovers = sorted(p for p in dirpath.iterdir() if commit.is_leftover(p.name))
    except OSError as e:
        raise CliError(f"cannot list {dirpath}: {e.strerror or e}") from None
    if not leftovers:
        print(f"no leftovers of interrupted saves in {dirpath}")
        return EXIT_OK
    now = time.time()
    sizes = {p: tree_size(p) for p in leftovers}
    failed = 0
    for p in leftovers:
        age = max(0.0, now - p.lstat().st_mtime)
        what = f"{p} ({human_bytes(sizes[p])}, modified {_age(age)} ago)"
        if not args.yes:
            print(f"would remove {what}")
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            print(f"removed {what}")
        except OSError as e:
            failed += 1
            print(f"cannot remove {p}: {e.strerror or e}", file=sys.stderr)
    total = human_bytes(sum(sizes.values()))
    if not args.yes:
        print(f"{len(leftovers)} leftover(s), {total}; run again with --yes to remove them"
              " (only while no job is saving checkpoints into this directory)")
        return EXIT_OK
    if failed:
        raise CliError(f"{failed} of {len(leftovers)} leftover(s) could not be removed", EXIT_FAILED)
    print(f"removed {len(leftovers)} leftover(s), {total}")
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
    from lightning_asyncckpt.tools import local_tier

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
                local_tier.remove(s)
            except OSError as e:
                raise CliError(f"cannot remove {s.path}: {e.strerror or e}", EXIT_FAILED) from None
            print(f"removed {s.path} ({human_bytes(s.nbytes)})")
    return EXIT_OK
