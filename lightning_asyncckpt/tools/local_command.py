"""The ``local`` command's work: what one node's local-tier directory holds (:class:`~lightning_asyncckpt.LocalTier`),
whether its shares still match their manifests, which processes use it, and its removal.

Each node has its own local directory, so this speaks of one node: whether a step can be resumed depends
on every node's directory, which the tier's recovery gathers across ranks, and one node cannot see alone.
What it can say is which ranks' shares this node holds, and which it does not.

The layout is :mod:`lightning_asyncckpt.tiers.store`'s: ``<dir>/asyncckpt-local/<session>/holder-<rank>/``
holds ``step-<step>.owner-<owner>.{pt,head,json}`` for each share, spare files (``.free-*``) that later
saves reuse, and the ``*.tmp`` files of a save or a transfer that did not finish. Nothing outside
``<dir>/asyncckpt-local/`` is ever read as the tier's, or removed.

Imports torch (the shares are checked with the tier's own code): the command line imports this module only
for ``local``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lightning_asyncckpt.tiers import job_lock, mapped, run_identity, store
from lightning_asyncckpt.tiers.huge_pages import tmpfs_huge
from lightning_asyncckpt.tiers.store import Held
from lightning_asyncckpt.units import human_bytes

TIER_DIR = "asyncckpt-local"  # LocalTier.root is <dir>/asyncckpt-local/<session>
_HOLDER = re.compile(r"holder-(\d+)")


class NoLocalTier(ValueError):
    """The path holds no local tier (or not the session asked for); the message says what to pass."""


@dataclass
class Share:
    """One share as a holder directory keeps it."""

    holder: int
    manifest: Held  # step, owner, sizes, CRC32s, the topology it was saved under
    nbytes: int  # its three files
    problem: str | None = None  # set by verify()

    def verify(self, session_path: Path) -> bool:
        """Reads this share's files under ``session_path`` and checks them against its manifest's CRC32s;
        sets :attr:`problem`. Returns whether the share is sound."""
        directory = store.holder_dir(session_path, self.holder)
        try:
            head, flat = store.map_share(directory, self.manifest)
            self.problem = store.crc_mismatch(self.manifest, head, flat, directory.name)
        except OSError as e:
            self.problem = f"rank {self.manifest.owner}'s share in {directory.name} could not be read: {e}"
        return self.problem is None


@dataclass
class Session:
    """One session's files on this node."""

    name: str
    path: Path
    shares: list[Share] = field(default_factory=list)
    spares: list[Path] = field(default_factory=list)  # reused by the next saves
    other: list[Path] = field(default_factory=list)  # not part of a complete share: an unfinished save
    nbytes: int = 0  # every file under the session

    def steps(self) -> list[int]:
        return sorted({s.manifest.step for s in self.shares}, reverse=True)


def sessions(path: Path, only: str | None = None) -> list[Session]:
    """The sessions under ``path``: ``LocalTier(dir=...)``, its ``asyncckpt-local`` directory, or one session's
    directory. Raises :class:`NoLocalTier` where there is none (or no session ``only``), naming what to pass,
    and where the tier's directory or the session asked for is a symbolic link: the tier never makes one, so
    what it points to is not the tier's (never read or removed through it). Sessions that are links are
    not listed."""
    path = Path(path)
    if os.path.lexists(path / TIER_DIR):
        base = path / TIER_DIR
    elif path.name == TIER_DIR:
        base = path
    elif path.parent.name == TIER_DIR:
        base, only = path.parent, only or path.name
        if only != path.name:
            raise NoLocalTier(f"{path} is session {path.name!r}, not --session {only!r}")
        _not_a_link(path)
    else:
        raise NoLocalTier(f"{path}: no local tier here (LocalTier(dir=DIR) writes under DIR/{TIER_DIR}/<session>/;"
                          " pass that DIR)")
    _not_a_link(base)
    names = sorted(p.name for p in base.iterdir() if _real_dir(p))
    if only is not None and only not in names:
        if os.path.islink(base / only):
            _not_a_link(base / only)
        raise NoLocalTier(f"{base}: no session {only!r}; sessions here: {', '.join(names) or 'none'}")
    return [describe(base / n) for n in names if only in (None, n)]


def _not_a_link(path: Path) -> None:
    if os.path.islink(path):
        raise NoLocalTier(f"{path} is a symbolic link (to {os.readlink(path)}): the local tier never makes one, so"
                          " what it points to is not the tier's; nothing is read or removed through it. Pass the"
                          " real directory, or remove the link if it is not yours to keep")
    if not os.path.isdir(path):
        raise NoLocalTier(f"{path}: not a directory; pass LocalTier's dir")


def _real_dir(p: Path) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(p.lstat().st_mode)
    return False


def _regular(p: Path) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISREG(p.lstat().st_mode)
    return False


def describe(root: Path) -> Session:
    """What one session directory (``LocalTier.root``) holds on this node."""
    out = Session(root.name, root)
    holders = {int(m.group(1)): p for p in root.iterdir() if (m := _HOLDER.fullmatch(p.name)) and _real_dir(p)}
    for rank, holder_path in sorted(holders.items()):  # a link is never read as the tier's, nor followed
        files = {p: _size(p) for p in holder_path.iterdir() if _regular(p)}
        out.nbytes += sum(files.values())
        claimed: set[Path] = set()
        for p in sorted(files):
            held = store.read_manifest(p)
            if held is None or not store.files_whole(holder_path, held):
                continue
            parts = store.share_files(holder_path, held)
            claimed.update(parts)
            out.shares.append(Share(rank, held, sum(files.get(f, 0) for f in parts)))
        out.spares += [p for p in files if p.name.startswith(mapped.FREE_PREFIX)]
        out.other += [p for p in files if p not in claimed and not p.name.startswith(mapped.FREE_PREFIX)
                      and p.name != run_identity.RECORD]  # the run its shares belong to
    return out


def verify(session: Session) -> int:
    """Reads every share of ``session`` and checks its bytes against the CRC32s of its manifest; sets each
    :attr:`Share.problem`. Returns how many failed."""
    return sum(not share.verify(session.path) for share in session.shares)


def users(path: Path) -> list[str]:
    """The processes on this machine (other than this one) that map or hold open a file under ``path``, as
    ``pid N (command)``: a job still running there. Processes this user cannot inspect are not seen."""
    root = os.path.realpath(path)
    prefix = root.rstrip("/") + "/"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if _uses(entry.path, prefix):
            found.append(f"pid {entry.name} ({_command(entry.path)})")
    return found


def _uses(proc: str, prefix: str) -> bool:
    with contextlib.suppress(OSError):
        with open(f"{proc}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n").startswith(prefix):
                    return True
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"{proc}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(fd.path).startswith(prefix):
                    return True
    return False


def _command(proc: str) -> str:
    with contextlib.suppress(OSError):
        with open(f"{proc}/cmdline", "rb") as f:
            words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
        line = " ".join(" ".join(words[:3]).split())  # one line: an argument may hold newlines (python -c)
        return (line[:77] + "...") if len(line) > 80 else (line or "?")
    return "?"


# The names the tier makes (tiers/store.py, tiers/mapped.py, tiers/checks.py): removal takes these and
# nothing else. A file the tier starts making must be added here, or `local --remove` keeps it (and says so).
# holders are directories; probes, the job lock (tiers/job_lock.py) files
SESSION_NAMES = (_HOLDER, re.compile(r"\.probe-rank\d+"), re.compile(re.escape(job_lock.LOCK)))
HOLDER_NAMES = (re.compile(r"step-\d{10}\.owner-\d+\.(pt|head|json)(\.tmp)?"),
                re.compile(re.escape(mapped.FREE_PREFIX) + r"\d+-\d+"),
                re.compile(re.escape(run_identity.RECORD) + r"(\.tmp)?"))  # which run the shares belong to
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Removal:
    """What :func:`remove` did: files (and links) removed, their bytes, and what it kept."""

    files: int = 0
    nbytes: int = 0
    kept: list[tuple[Path, str]] = field(default_factory=list)  # (path, why)

    def add_removed(self, nbytes: int) -> None:
        """One file (or link) removed, of ``nbytes`` (0 for a link)."""
        self.files += 1
        self.nbytes += nbytes


def remove(session: Session) -> Removal:
    """Removes the session's files: in ``holder-<N>`` directories, the names the tier makes
    (:data:`HOLDER_NAMES`), then the holders and the session directory once empty. Everything else is kept
    and listed in the result. Works through directory descriptors opened without following links, from
    the tier's directory down: a link is removed as a link (a ``holder-<N>`` link included), never followed,
    and nothing outside ``<dir>/asyncckpt-local/<session>/`` is touched, even if a directory is swapped for
    a link meanwhile. Raises ``OSError`` (its ``filename`` set) if the session cannot be opened."""
    out = Removal()
    base = session.path.parent
    top = os.open(base.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's DIR: given by them
    try:
        tier = _open_dir(base.name, top, base)
        try:
            root = _open_dir(session.name, tier, session.path)
            try:
                for name in sorted(os.listdir(root)):
                    _remove_entry(root, name, session.path / name, SESSION_NAMES, out, holder=True)
            finally:
                os.close(root)
            _rmdir_if_empty(tier, session.name, session.path, out)
        finally:
            os.close(tier)
    finally:
        os.close(top)
    return out


def _open_dir(name: str, dir_fd: int, path: Path) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:  # ELOOP: a link where the tier's directory was; named by its path, not its entry name
        raise OSError(e.errno, e.strerror, str(path)) from None


def _remove_entry(dir_fd: int, name: str, path: Path, patterns: tuple, out: Removal, holder: bool = False) -> None:
    if not any(p.fullmatch(name) for p in patterns):
        out.kept.append((path, "not a file the local tier makes"))
        return
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if holder and stat.S_ISDIR(st.st_mode) and _HOLDER.fullmatch(name):
        fd = _open_dir(name, dir_fd, path)
        try:
            for entry in sorted(os.listdir(fd)):
                _remove_entry(fd, entry, path / entry, HOLDER_NAMES, out)
        finally:
            os.close(fd)
        _rmdir_if_empty(dir_fd, name, path, out)
    elif stat.S_ISDIR(st.st_mode):
        out.kept.append((path, "a directory where the local tier makes a file"))
    else:  # a file, or a link (removed as a link)
        os.unlink(name, dir_fd=dir_fd)
        out.add_removed(st.st_size if stat.S_ISREG(st.st_mode) else 0)


def _rmdir_if_empty(dir_fd: int, name: str, path: Path, out: Removal) -> None:
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if not any(str(k).startswith(f"{path}/") for k, _ in out.kept):
            out.kept.append((path, "it holds files made meanwhile"))


def _size(p: Path) -> int:
    with contextlib.suppress(OSError):
        return p.stat().st_size
    return 0


def as_dict(session: Session) -> dict:
    d = asdict(session)
    d["path"] = str(session.path)
    d["spares"] = [str(p) for p in session.spares]
    d["other"] = [str(p) for p in session.other]
    d["tmpfs_huge"] = tmpfs_huge(session.path)  # None: not on a tmpfs
    return d


def format_session(session: Session) -> str:
    """Lines for one session: its steps, newest first, with the ranks whose shares each holder keeps."""
    lines = [f"{session.path}: {len(session.shares)} share(s) of {len(session.steps())} step(s),"
             f" {human_bytes(session.nbytes)} in all"]
    for step in session.steps():
        here = [s for s in session.shares if s.manifest.step == step]
        world = here[0].manifest.topology[0]
        holders = sorted({s.holder for s in here})
        by_holder = "; ".join(f"holder-{h}: " + ", ".join(str(s.manifest.owner) for s in here if s.holder == h)
                              for h in holders)
        owners = {s.manifest.owner for s in here}
        missing = sorted(set(range(world)) - owners)
        where = ("every rank's share is on this node" if not missing else
                 f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}: on other nodes only")
        lines.append(f"  step {step}: shares of {len(owners)} of {world} ranks ({by_holder});"
                     f" {where}; {human_bytes(sum(s.nbytes for s in here))}")
        lines += [f"    BAD: {s.problem}" for s in here if s.problem]
    if session.spares:
        lines.append(f"  spare files, reused by the next saves: {len(session.spares)},"
                     f" {human_bytes(sum(_size(p) for p in session.spares))}")
    if session.other:
        lines.append(f"  not part of a complete share (an unfinished save or transfer): {len(session.other)} file(s),"
                     f" {human_bytes(sum(_size(p) for p in session.other))}")
    huge = tmpfs_huge(session.path)
    if huge == "never":  # a recovery is twice as fast with huge pages (tiers/huge_pages.py)
        lines.append("  on a tmpfs without huge pages: a recovery moves and checks these files about twice as fast on a"
                     " tmpfs mounted huge=within_size (docs/tiers.md, \"A tmpfs with huge pages\")")
    elif huge is not None:
        lines.append(f"  on a tmpfs with huge={huge}")
    return "\n".join(lines)
