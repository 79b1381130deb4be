"""Restoring the local tier's newest complete step on every rank (:func:`restore`).

Three moves, each rank in the same order:

1. **Refill.** Every rank holds again what it holds after a save (its share and its clique's replicas):
   a node back with an empty directory gets them sent, each share once, into its mapped files. This is
   also what protects the next failure. For a sharded state only a rank's own share is sent here; the
   replicas it holds for its peers are prepared with it (their sends; their files are reserved later) and
   sent from the first step boundary on, in the writer's thread
   (:mod:`lightning_asyncckpt.tiers.deferred_refill`).
2. **Check.** Every rank checks the CRC32 of every share in its own holder directory that it or its node's
   other ranks read in 3, while the refill's bytes move, and of what it was sent, once it is there (a share
   it only sends is checked by its receiver; a replica no rank uses in this restore, by the restore that uses
   it); the ranks agree on the outcome (one gather), so that either all restore or all fall back.
3. **Read.** Each rank reads the shares it needs (sharded: its own; replicated: every owner's) from the
   holder directories of its own node, checked in 2; a share its node does not hold is sent from
   another node and checked on arrival.
4. **Unpack.** Each rank reads the headers of what it restores with ``torch.load(weights_only=...)`` as the
   caller asked (True unless the caller passed ``weights_only=False``, as stock loads): a header that holds
   more (a pickle that would run code) is refused on every rank (:attr:`Restored.unsafe`), naming its file,
   before the ranks' last agreement.

Before each transfer the ranks prepare (map what they send, reserve what they receive into) and agree, and
they agree once more before unpacking: a rank that fails anywhere makes every rank fall back to the
persistent tier at that point, with the reason, instead of leaving its peers in a send until the group's
timeout.

The shares are checked and sent from private (copy-on-write) mappings of the step's node-local files, and
every rank retires those files from reuse (:meth:`LocalStore.retire`), so that no later save writes into a
page that a mapping still shows (a sharded restore's later sends, :mod:`deferred_refill`); they are removed
when a newer step is complete. The checkpoint returned holds copies, each tensor its own storage, as
``torch.load`` gives them (:func:`owned`): nothing of it maps the tier's files, which are unmapped when the
restore returns, and the model and optimizer that load it own their state again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_asyncckpt.collectives import ProcessGroup
from lightning_asyncckpt.snapshot import tree
from lightning_asyncckpt.tiers import deferred_refill, exchange, packing, recovery, shares, store
from lightning_asyncckpt.tiers.store import Held, LocalStore


@dataclass
class Ranks:
    """What a restore needs to know of the run (the same on every rank but ``rank`` and ``store``)."""

    rank: int
    world: int
    root: Path
    store: LocalStore  # this rank's own holder directory
    group: ProcessGroup | None
    node_of: list[int]
    cliques: list[list[int]]
    factor: int
    topology: tuple
    gather: Callable[[object], list[object]]
    weights_only: bool = True  # how the shares' headers are read (packing.unpack)


@dataclass
class Restored:
    """The checkpoint (None where a check failed, then ``problems`` says why) and what moved."""

    checkpoint: object | None
    problems: list[str]
    sent: int  # shares sent between ranks
    read: int  # shares read from a holder directory on the reader's node
    later: deferred_refill.Deferred = field(default_factory=deferred_refill.Deferred)  # replicas sent after
    # the copies that failed their CRC32 check, ``(holder, owner)``, as every rank agreed: a retry without
    # them may still find the step complete (another copy in the clique)
    corrupt: frozenset[tuple[int, int]] = frozenset()
    # headers that weights_only refused, on any rank: the restore is refused, not retried or fallen back from
    unsafe: list[str] = field(default_factory=list)


class Findings:
    """(one rank, one restore) What went wrong on this rank, and which copies failed their check; then what
    every rank agreed on (:meth:`agree`)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.corrupt: list[tuple[int, int, str]] = []  # (holder, owner, problem)
        self.unsafe: list[str] = []  # headers weights_only refused (each also a problem); every rank's once agreed

    def __bool__(self) -> bool:
        return bool(self.problems)

    def append(self, problem: str) -> None:
        self.problems.append(problem)

    def checked(self, m: Held, head: bytes, flat: torch.Tensor, holder: int, where: str) -> bool:
        """Whether the bytes of the copy of ``m`` held by rank ``holder`` have its manifest's CRC32s."""
        problem = store.crc_mismatch(m, head, flat, f"the copy {where} rank {holder}")
        if problem:
            self.problems.append(problem)
            self.corrupt.append((holder, m.owner, problem))
        return problem is None

    def agree(self, gather: Callable[[object], list[object]]) -> tuple[list[str], frozenset[tuple[int, int]]]:
        """(every rank, together) Every rank's problems, and the corrupt copies where they are the only ones."""
        rows = gather((self.problems, self.corrupt, self.unsafe))
        problems = sorted({p for ps, _, _ in rows for p in ps})
        self.unsafe = sorted({u for _, _, us in rows for u in us})
        # one copy may be checked twice (by its holder, and by a rank it was sent to), each in its own words
        corrupt = frozenset((h, o) for _, cs, _ in rows for h, o, _p in cs)
        only = set(problems) == {p for _, cs, _ in rows for _h, _o, p in cs}  # else a retry meets the other problem
        return problems, corrupt if only else frozenset()


def restore(plan: recovery.Plan, holdings: list[list[Held]], ranks: Ranks) -> Restored:
    """(every rank, together) Restores ``plan.step``; see the module docstring. Whatever can fail on one
    rank (a full directory, a missing file, a CRC32) is found before the next step that needs its peers,
    and the ranks agree on it (:meth:`Ranks.gather`), so that all restore or all fall back at once: no rank
    is left waiting in a transfer for one that gave up."""
    me, step = ranks.rank, plan.step
    mode = plan.sources[0][1].mode
    needs = {r: ([r] if mode == shares.SHARDED else list(range(ranks.world))) for r in range(ranks.world)}
    refill = recovery.refill(plan, holdings, ranks.cliques, ranks.factor, ranks.node_of)
    # a sharded rank needs only its own share to resume: the replicas it holds for its peers are sent later
    later = [m for m in refill if m[0] not in needs[m[2]]]
    refill = [m for m in refill if m[0] in needs[m[2]]]
    fetch = recovery.fetch(plan, recovery.after(holdings, refill), ranks.node_of, needs)
    mine = set(needs[me])
    sent, read = len(refill) + len(fetch.moves), sum(len(v) for v in fetch.reads.values())
    got: dict[int, tuple[bytes, torch.Tensor]] = {}
    origin: dict[int, str] = {}  # where each share in got was read: its header's file, named in a refusal
    bad = Findings()
    corrupt: frozenset[tuple[int, int]] = frozenset()

    def agreed() -> list[str]:
        nonlocal corrupt
        problems, corrupt = bad.agree(ranks.gather)
        return problems

    maps: dict[tuple[int, int], tuple[bytes, torch.Tensor]] = {}

    def mapped(h: Held) -> tuple[bytes, torch.Tensor]:
        # one mapping per held file: what is sent in 1 is checked in 2 and returned, its pages faulted in once
        if (h.step, h.owner) not in maps:
            maps[h.step, h.owner] = ranks.store.map(h)
        return maps[h.step, h.owner]

    # 1. refill: received into files reserved before any byte moves, checked, then committed under their names
    reserved = {}

    def into(m: Held) -> torch.Tensor:
        reserved[m.owner] = ranks.store.reserve(step, m.owner, m.nbytes)
        return reserved[m.owner].tensor

    ready = _prepare(refill, mapped, into, me, bad, "refill")
    # sent from mappings of their own: the checkpoint's views of the same files change once the model trains.
    # Their files are reserved later too, in the writer's thread: reserving is allocating a share's size of
    # node-local memory, as long again as receiving the rank's own share
    deferred = deferred_refill.Deferred(later, _prepare(later, ranks.store.map, None, me, bad, "refill"))
    if problems := agreed():
        return Restored(None, problems, sent, read, corrupt=corrupt)
    senders = {(o, r): s for o, s, r, _ in refill}
    incoming = {o for o, _s, r, _ in refill if r == me}
    posted = exchange.post(refill, ready, me, ranks.group)
    try:
        # 2. while the refill's bytes move: check what is read from this rank's holder directory, by this rank
        # or (in 3b) its node's others (what it receives is checked on arrival, and so is a share it only
        # sends; a replica this restore does not use is checked by the restore that uses it)
        read_here = {owner for rows in fetch.reads.values() for owner, holder, _ in rows if holder == me}
        for h in ranks.store.holdings(ranks.topology):
            if h.step != step or h.owner in incoming or h.owner not in read_here:
                continue
            try:
                head, flat = mapped(h)
            except OSError as e:
                bad.append(f"rank {me} could not read rank {h.owner}'s share it holds: {e}")
                continue
            if bad.checked(h, head, flat, me, "held by") and h.owner in mine:
                got[h.owner] = (head, flat)
                origin[h.owner] = str(store.share_files(ranks.store.dir, h)[1])
    finally:  # whatever happened above, this rank's peers are in the transfers: they are ended
        received = posted.wait()
    refilled: dict[int, Held] = {}
    for m, head, flat in received:
        if not bad.checked(m, head, flat, senders[(m.owner, me)], "sent by"):
            continue
        try:
            ranks.store.commit(m, reserved[m.owner], head)
        except OSError as e:
            bad.append(f"rank {me} could not keep rank {m.owner}'s share it was sent: {e}")
            continue
        refilled[m.owner] = m
    ranks.store.retire(step)  # before any mapping of its files leaves this function (also on a fallback)
    for owner in mine & refilled.keys():
        try:
            got[owner] = ranks.store.map(refilled[owner])  # the bytes just received: in the page cache
            origin[owner] = str(store.share_files(ranks.store.dir, refilled[owner])[1])
        except OSError as e:
            bad.append(f"rank {me} could not map rank {owner}'s share it was sent: {e}")

    # 3a. what this rank's node does not hold: sent from another node, checked on arrival
    def fresh(m: Held) -> torch.Tensor:
        return torch.empty(m.nbytes, dtype=torch.uint8)

    ready = _prepare(fetch.moves, mapped, fresh, me, bad, "fetch")
    # also the barrier after the refill: 3b reads files that this node's other ranks have just received. Where
    # nothing moves in 3a and every rank reads only its own directory (a sharded restore), the ranks have no
    # transfer to enter together and nothing to wait for: the agreement before unpacking is the only one
    alone = not fetch.moves and all(holder == r for r, rows in fetch.reads.items() for _, holder, _ in rows)
    if not alone and (problems := agreed()):
        return Restored(None, problems, sent, read, corrupt=corrupt)
    movers = {(o, r): s for o, s, r, _ in fetch.moves}
    for m, head, flat in exchange.transfer(fetch.moves, ready, me, ranks.group):
        if bad.checked(m, head, flat, movers[(m.owner, me)], "sent by"):
            got[m.owner] = (head, flat)
            sender = movers[(m.owner, me)]
            origin[m.owner] = (f"{store.share_files(store.holder_dir(ranks.root, sender), m)[1]} on node"
                               f" {ranks.node_of[sender]} (sent by rank {sender})")

    # 3b. the rest from the other holder directories of this node, checked by their holders in 2 (not where
    # this rank has failed already: it falls back with its peers at the next agreement, for that reason alone)
    for owner, holder, manifest in [] if bad else fetch.reads.get(me, []):
        if owner not in got:
            try:
                got[owner] = store.map_share(store.holder_dir(ranks.root, holder), manifest)
                origin[owner] = str(store.share_files(store.holder_dir(ranks.root, holder), manifest)[1])
            except OSError as e:
                bad.append(f"rank {me} could not read rank {owner}'s share in holder-{holder}: {e}")
    # 4. the headers, read as the caller asked (weights_only), before the last agreement: a refusal on any
    # rank is every rank's
    unpacked = {} if bad else _unpack(got, [me] if mode == shares.SHARDED else sorted(got), origin, ranks, bad)
    if problems := agreed():
        return Restored(None, problems, sent, read, corrupt=corrupt, unsafe=bad.unsafe)
    # the checkpoint's tensors are copies (:func:`owned`): the step's mappings, and the buffers sent here, die with
    # this function's locals, unmapped at once (but the sharded refill's later sends, until they are done)
    own = unpacked[me]
    if mode == shares.SHARDED:
        return Restored(owned(own["state"]), [], sent, read, deferred)
    every = [own, *(unpacked[o] for o in sorted(unpacked) if o != me)]
    return Restored(owned(shares.assemble(own, every)), [], sent, read)


def owned(checkpoint: object) -> object:
    """``checkpoint`` with each tensor copied into a storage of its own, as ``torch.load`` gives them: one
    copy, at memory speed (the CRC32 checks have faulted the pages in). A view of the share's flat buffer
    would keep the whole buffer alive, and its mapping (a second copy of the state, on ``/dev/shm`` in RAM)
    for as long as any one tensor lives: ``optimizer.load_state_dict`` keeps a tensor of the parameter's
    device and dtype as it is, so AdamW's moments would stay views for the rest of the run, and every later
    ``torch.save`` would write the whole buffer for each of them. A tensor held in several places stays one
    tensor; an ``nn.Parameter`` stays one, with its ``requires_grad``."""
    copies: dict[int, torch.Tensor] = {}

    def own(path: tuple, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            fresh = t.detach().clone(memory_format=torch.contiguous_format)
            if isinstance(t, torch.nn.Parameter):
                fresh = torch.nn.Parameter(fresh, requires_grad=t.requires_grad)
            copies[id(t)] = fresh
        return copies[id(t)]

    return tree.walk(checkpoint, (), own, objects=True)


def _unpack(got: dict[int, tuple[bytes, torch.Tensor]], owners: list[int], origin: dict[int, str], ranks: Ranks,
            bad: Findings) -> dict[int, object]:
    """Each of ``owners``' shares unpacked (``packing.unpack``, as the caller asked: ``ranks.weights_only``);
    a header that ``weights_only`` refuses is added to ``bad``, naming its file."""
    out = {}
    for owner in owners:
        try:
            out[owner] = packing.unpack(*got[owner], weights_only=ranks.weights_only)
        except packing.UnsafeShareError as e:
            problem = f"{origin.get(owner, f'rank {owner} share')}: {e}"
            bad.append(problem)
            bad.unsafe.append(problem)
    return out


def _prepare(moves: list[exchange.Move], read: Callable[[Held], tuple[bytes, torch.Tensor]],
             into: Callable[[Held], torch.Tensor] | None, me: int, bad: Findings, what: str) -> exchange.Prepared:
    """This rank's side of ``moves``, or an empty one with the reason added to ``bad`` (then the ranks
    agree to fall back before any transfer starts)."""
    try:
        return exchange.prepare(moves, read, into, me)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch could not allocate the memory
        bad.append(f"rank {me} could not get ready for the {what} transfers: {e}")
        return exchange.Prepared()

