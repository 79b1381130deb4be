"""Recovery transfers across two real processes of one gloo group: every move of the list arrives whole and
at its own destination, whichever way it goes, with several moves between the same two ranks in flight at
once, and empty headers or empty shares among them."""

from __future__ import annotations

import torch

from processes import two_ranks

# (owner, sender, receiver, header bytes, share bytes): both directions, two moves 0 -> 1, empty parts
MOVES = [(0, 0, 1, 7, 100_000), (1, 1, 0, 5, 3_000), (2, 0, 1, 0, 50_000), (3, 0, 1, 9, 0), (4, 1, 0, 3, 1)]


def _content(owner, n, salt):
    return (torch.arange(n, dtype=torch.int64) * (owner + 3) + salt).to(torch.uint8)


def _exchange_rank(rank, _root):
    from lightning_asyncckpt.tiers import exchange
    from lightning_asyncckpt.tiers.store import Held

    moves = [(o, s, r, Held(2, o, n, 0, (2, 1, 2), head_nbytes=h)) for o, s, r, h, n in MOVES]
    prepared = exchange.prepare(
        moves,
        read=lambda m: (bytes(_content(m.owner, m.head_nbytes, 1).tolist()), _content(m.owner, m.nbytes, 2)),
        into=lambda m: torch.full((m.nbytes,), 0xEE, dtype=torch.uint8),
        me=rank,
    )
    got = exchange.transfer(moves, prepared, rank, None)
    return [(m.owner, head == bytes(_content(m.owner, m.head_nbytes, 1).tolist()),
             torch.equal(flat, _content(m.owner, m.nbytes, 2))) for m, head, flat in got]


def test_every_move_arrives_whole_at_its_receiver_with_several_in_flight_between_two_ranks(tmp_path):
    got = two_ranks(_exchange_rank, tmp_path)
    for rank in (0, 1):
        assert isinstance(got[rank], list), got[rank]
        expected = [(o, True, True) for o, _s, r, _h, _n in MOVES if r == rank]
        assert got[rank] == expected, (rank, got[rank])


def _posted_rank(rank, root):
    """Rank 1 posts its receive and then waits, outside the group, until rank 0's send of 64 MiB (far more
    than a socket buffer holds) has ended: that send can only end if the receive is already under way."""
    import time
    from pathlib import Path

    from lightning_asyncckpt.tiers import exchange
    from lightning_asyncckpt.tiers.store import Held

    nbytes = 64 << 20
    moves = [(0, 0, 1, Held(2, 0, nbytes, 0, (2, 1, 2), head_nbytes=4))]
    prepared = exchange.prepare(moves, read=lambda m: (b"head", torch.full((nbytes,), 7, dtype=torch.uint8)),
                                into=lambda m: torch.zeros(nbytes, dtype=torch.uint8), me=rank)
    posted = exchange.post(moves, prepared, rank, None)
    sent = Path(root) / "rank0-sent"
    if rank == 0:
        posted.wait()
        sent.touch()
        return "sent"
    deadline = time.monotonic() + 60
    while not sent.exists():  # the handshake: rank 0 says its send is done
        if time.monotonic() > deadline:
            return "rank 0's send never ended while the receive was posted but not waited on"
        time.sleep(0.01)
    (m, head, flat), = posted.wait()
    return head == b"head" and bool((flat == 7).all())


def test_posted_moves_run_while_the_rank_does_other_work_and_wait_returns_them(tmp_path):
    got = two_ranks(_posted_rank, tmp_path)
    assert got == {0: "sent", 1: True}, got
