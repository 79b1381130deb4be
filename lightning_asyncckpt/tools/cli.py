"""The ``lightning-asyncckpt`` command: inspect, verify, convert and clean checkpoints, and list, check or
remove a node's local-tier files (``local``).

A checkpoint is one ``torch.save`` file (the single-writer format, as stock Lightning's ``TorchCheckpointIO``
writes) or a torch.distributed.checkpoint (DCP) directory (sharded and distributed saves); ``inspect``,
``verify`` and ``convert`` read both.

Exit status: 0 success; 1 the checkpoint failed verification, or a conversion or removal failed; 2 bad
input (a missing path, a path that is not a checkpoint, an unreadable ``.metadata``, a usage error).
A user error is one line on stderr, never a traceback.

torch is imported by the commands that need it, and Lightning only by ``convert FILE DIR`` (which saves
with :class:`~lightning_asyncckpt.AsyncCheckpointIO`), so that ``--help`` and ``clean`` start fast.
Unpickling is restricted unless ``--allow-pickle`` is given: ``.metadata`` may only name DCP's metadata
types, and the non-tensor state (all of a ``torch.save`` file) is read with ``torch.load(weights_only=True)``.

This module parses arguments and prints; what it reports comes from :mod:`~lightning_asyncckpt.tools.describe`,
:mod:`~lightning_asyncckpt.tools.verify` and :mod:`~lightning_asyncckpt.format.metadata`. The commands that
remove files (``clean``, ``local``) are in :mod:`~lightning_asyncckpt.tools.cleanup`, what they share with
the others in :mod:`~lightning_asyncckpt.tools.usage`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from lightning_asyncckpt.format.metadata import MetadataError, read_metadata
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.tools.cleanup import cmd_clean, cmd_local
from lightning_asyncckpt.tools.describe import (
    describe,
    describe_file,
    format_description,
    incomplete_reason,
    incomplete_reason_file,
)
from lightning_asyncckpt.tools.items import ItemError, first_line, torch_load, weights_only_reason
from lightning_asyncckpt.tools.usage import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    existing,
    tree_size,
)
from lightning_asyncckpt.tools.verify import verify_checkpoint, verify_file
from lightning_asyncckpt.units import human_bytes

_ALLOW_PICKLE_HINT = "pass --allow-pickle if you trust this checkpoint"


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """The library's errors about an unreadable checkpoint, as user errors."""
    try:
        yield
    except OSError as e:
        raise CliError(f"cannot read {e.filename}: {e.strerror or e}") from None
    except (MetadataError, ItemError) as e:
        raise CliError(str(e)) from None


# -------------------------------------------------------------------------------------------------
# Reading a checkpoint: a torch.save file or a checkpoint directory


def _checkpoint(path_arg: str) -> Path:
    """``path_arg`` as an existing regular file (a ``torch.save`` file, read by the caller), or a directory
    that looks like a checkpoint (committed or not)."""
    path = existing(path_arg)
    if path.is_file():
        return path
    return _checkpoint_dir(path_arg)


def _checkpoint_dir(path_arg: str) -> Path:
    """``path_arg`` as an existing directory that looks like a checkpoint (committed or not)."""
    path = existing(path_arg)
    if not path.is_dir():
        raise CliError(f"{path}: not a checkpoint (neither a regular file nor a directory)")
    if not (path / commit.METADATA_FILE).exists() and not commit.is_leftover(path.name) and not _shard_files(path):
        raise CliError(f"{path}: not a checkpoint directory (no {commit.METADATA_FILE} and no shard files)")
    return path


def _shard_files(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.name.endswith(".distcp"))
    except OSError:
        return []


# -------------------------------------------------------------------------------------------------
# inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    """``inspect PATH [--json]``: format, status, step and epoch, sizes, largest tensors, non-tensor keys."""
    path = _checkpoint(args.path)
    with _reading():
        if path.is_dir():
            info = describe(path, args.allow_pickle, _ALLOW_PICKLE_HINT)
        else:
            info = describe_file(path, args.allow_pickle, _ALLOW_PICKLE_HINT)
    if args.json:
        print(json.dumps(info))
    else:
        print("\n".join(format_description(info)))
    return EXIT_OK


# -------------------------------------------------------------------------------------------------
# verify


def cmd_verify(args: argparse.Namespace) -> int:
    """``verify PATH``: exit 0 with a one-line summary, or 1 naming each bad file, item or record."""
    path = _checkpoint(args.path)
    is_file = not path.is_dir()
    reason = incomplete_reason_file(path) if is_file else incomplete_reason(path)
    if reason is not None:
        raise CliError(f"{path}: incomplete checkpoint: {reason}", EXIT_FAILED)
    if is_file:
        with _reading():
            report = verify_file(path)
    else:
        report = verify_checkpoint(path, _ALLOW_PICKLE_HINT)
    if report.problems:
        for problem in report.problems:
            print(f"FAIL {problem}", file=sys.stderr)
        raise CliError(f"{path}: verification failed: {len(report.problems)} problem(s)", EXIT_FAILED)
    print(f"OK {path}: {report.summary(single_file=is_file)}")
    for note in report.notes:
        print(f"note: {note}")
    return EXIT_OK


# -------------------------------------------------------------------------------------------------
# convert


def _check_output(out: Path, force: bool, want_dir: bool) -> None:
    if not os.path.lexists(out):
        return
    if not force:
        raise CliError(f"{out} exists; pass --force to replace it")
    if want_dir and not commit.is_committed(out):
        raise CliError(f"{out} exists and is not a checkpoint directory; --force replaces only a checkpoint directory")
    if not want_dir and (out.is_dir() or out.is_symlink()):
        raise CliError(f"{out} exists and is not a regular file; --force replaces only a file")


def cmd_convert(args: argparse.Namespace) -> int:
    """``convert SRC DST``: a checkpoint directory into one ``torch.save`` file, or the reverse."""
    src, dst = _checkpoint(args.src), Path(args.dst)
    if src.is_dir():
        src = _checkpoint_dir(args.src)
        reason = incomplete_reason(src)
        if reason is not None:
            raise CliError(f"{src}: incomplete checkpoint: {reason}")
        _check_output(dst, args.force, want_dir=False)
        checkpoint = _load_dir(src, args.allow_pickle)
        _save_file(checkpoint, dst)
        print(f"converted {src} -> {dst} ({human_bytes(dst.stat().st_size)}, torch.save)")
    else:
        reason = incomplete_reason_file(src)
        if reason is not None:
            raise CliError(f"{src}: incomplete checkpoint: {reason}")
        _check_output(dst, args.force, want_dir=True)
        with _reading():
            checkpoint = torch_load(src, args.allow_pickle, str(src), _ALLOW_PICKLE_HINT)
        if not isinstance(checkpoint, dict):
            raise CliError(f"{src}: not a checkpoint (a {type(checkpoint).__name__}, not a dict)")
        _save_dir(checkpoint, dst)
        print(f"converted {src} -> {dst} ({human_bytes(tree_size(dst))}, checkpoint directory)")
    return EXIT_OK


def _load_dir(path: Path, allow_pickle: bool) -> dict[str, object]:
    from lightning_asyncckpt.format import dcp as dcp_format

    with _reading():  # the message and hint of this command, rather than dcp_format.load's
        read_metadata(path, allow_pickle, _ALLOW_PICKLE_HINT)
    try:
        return dcp_format.load(path, weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        raise CliError(f"cannot read {path} with weights_only=True ({weights_only_reason(e)}); "
                       f"{_ALLOW_PICKLE_HINT}") from None
    except BaseException as e:  # noqa: BLE001 - a damaged checkpoint: any error of DCP's reader
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CliError(f"cannot read {path} ({first_line(e)}); run `{PROG} verify {path}`") from None


def _save_file(checkpoint: dict[str, object], out: Path) -> None:
    """``torch.save`` into a temporary sibling, then one rename: ``out`` is never half-written."""
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(checkpoint, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as e:
        raise CliError(f"cannot write {out}: {e.strerror or e}", EXIT_FAILED) from None
    finally:
        tmp.unlink(missing_ok=True)


def _save_dir(checkpoint: dict[str, object], out: Path) -> None:
    """Saves with ``AsyncCheckpointIO`` into a private staging directory, then commits it at ``out``.

    A save removes the leftovers of interrupted saves in its target's directory, which, in a directory
    that a training job is saving into, may be that job's save in progress; the staging directory is
    empty. It carries the leftover prefix, so that ``clean`` finds it if the conversion is killed.
    """
    from lightning_asyncckpt.errors import CheckpointWriteError
    from lightning_asyncckpt.integration.io import AsyncCheckpointIO

    staging_dir = commit.tmp_for(out, f"{commit.new_token()}-convert")  # this process's, for clean
    tmp = staging_dir / out.name
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging_dir.mkdir()
        ckpt_io = AsyncCheckpointIO(worker="fork", format="dcp")  # a directory, whatever the default format
        try:
            ckpt_io.save_checkpoint(checkpoint, tmp)
            ckpt_io.finalize(blocking=True)
        finally:
            ckpt_io.teardown()
        commit.publish(tmp, out)  # an existing checkpoint at ``out`` (--force) is exchanged atomically
    except (CheckpointWriteError, OSError) as e:
        raise CliError(f"cannot write {out}: {str(e).splitlines()[0]}", EXIT_FAILED) from None
    finally:
        commit.remove_path(staging_dir)


# -------------------------------------------------------------------------------------------------
# Entry point


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lightning-asyncckpt`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect, verify, convert and clean lightning-asyncckpt checkpoints: torch.save files"
                               " (as stock Lightning writes) and torch.distributed.checkpoint directories."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    allow = dict(action="store_true", help="unpickle arbitrary objects (runs code from the checkpoint: only for"
                                           " checkpoints you trust)")

    p = sub.add_parser("inspect", help="show what a checkpoint (file or directory) holds")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--allow-pickle", **allow)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="read a checkpoint whole and check it: a file's zip records against their"
                                         " CRC32, a directory's shard files against its metadata")
    p.add_argument("path", metavar="PATH")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("convert", help="checkpoint directory -> one torch.save file, or the reverse",
                       description="A directory SRC becomes one torch.save file DST (loadable by stock Lightning);"
                                   " a torch.save file SRC becomes a checkpoint directory DST.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--force", action="store_true", help="replace an existing DST of the same kind")
    p.add_argument("--allow-pickle", **allow)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("clean", help="list (and with --yes remove) leftovers of interrupted saves in DIR; a"
                                     " checkpoint that an interrupted replace moved aside is put back first")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--yes", action="store_true", help="put back and remove (without it, only list)")
    p.add_argument("--any-host", action="store_true", help="also remove the leftovers of processes on other hosts,"
                                                            " which this host cannot tell are gone (only while no"
                                                            " job anywhere saves into DIR)")
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("local", help="list what a node's local-tier directory (LocalTier(dir=DIR)) holds; check or"
                                     " remove it")
    p.add_argument("dir", metavar="DIR", help="LocalTier's dir, its asyncckpt-local directory, or one session's")
    p.add_argument("--session", help="only this session (LocalTier(session=...))")
    p.add_argument("--verify", action="store_true", help="read every share and check it against its CRC32s")
    p.add_argument("--remove", action="store_true", help="remove the session(s) (with --yes; refused while a"
                                                          " process on this node uses their files)")
    p.add_argument("--yes", action="store_true", help="with --remove: remove (without it, only list)")
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.set_defaults(func=cmd_local)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``) and returns the exit status."""
    # torch's import warns about pynvml on some installs: noise on a tool's stderr
    warnings.filterwarnings("ignore", message=".*pynvml package is deprecated", category=FutureWarning)
    # DCP's reader, used without a process group on purpose
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors and --help; argparse has printed its message
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return args.func(args)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
