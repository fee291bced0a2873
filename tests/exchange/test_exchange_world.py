"""The ``ExchangeWorld`` fake itself: in-process ranks whose calls really exchange data and must match across ranks.

The per-rank divergence tests (recompile, hand-off, two-level, measured trials) rely on it catching a mismatch and on
it computing what NCCL computes; both are checked here, with data that differs per rank.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.fakes import ExchangeMismatch, ExchangeTimeout, ExchangeWorld


def _data(rank: int, n: int = 6) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 100 * (rank + 1)


def test_collectives_compute_real_sums_across_three_ranks():
    world = ExchangeWorld(3, timeout_s=5)
    total = _data(0) + _data(1) + _data(2)

    def rank_main(rank):
        comm = world.comm(rank)
        a, b, c = _data(rank), _data(rank), _data(rank)
        with comm.group(flush=1):
            comm.all_reduce(a)
            comm.reduce(b, root=2)
            comm.reduce_scatter(c, per_rank=2)
        rows = comm.all_gather_ints([rank, 7])
        return a, b, c, rows

    out = world.run(rank_main)
    for rank, (a, b, c, rows) in enumerate(out):
        assert torch.equal(a, total)
        assert torch.equal(b, total) if rank == 2 else bool(b.isnan().all())  # reduce: only the root holds it
        block = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(c[block], total[block])
        assert int(c.isnan().sum()) == 4  # the other ranks' blocks never reach this rank
        assert rows == [[0, 7], [1, 7], [2, 7]]
    assert world.comm(0).calls == [("all_reduce", None, 6), ("reduce", 2, 6), ("reduce_scatter", None, 6)]
    assert world.comm(0).groups == 1 and world.comm(0).open_groups == 0


def test_grouped_sends_and_receives_exchange_between_two_ranks():
    """Both ranks send and receive in one group (each receive listed first): the sends are posted at the group's
    end before the receives wait, so neither blocks the other; pairs match in order."""
    world = ExchangeWorld(2, timeout_s=5)

    def rank_main(rank):
        comm = world.comm(rank)
        peer = 1 - rank
        first, second = torch.zeros(3), torch.zeros(2)
        with comm.group():
            comm.recv(first, peer)
            comm.recv(second, peer)
            comm.send(_data(rank, 3), peer)
            comm.send(_data(rank, 2) * -1, peer)
        return first, second

    out = world.run(rank_main)
    for rank, (first, second) in enumerate(out):
        assert torch.equal(first, _data(1 - rank, 3)) and torch.equal(second, -_data(1 - rank, 2))


@pytest.mark.parametrize("rank1_call, expected", [
    (lambda c, b: c.reduce(b, root=0), "rank 1: reduce(root=0, count=6, dtype=float32)"),
    (lambda c, b: c.all_reduce(b[:4]), "rank 1: all_reduce(count=4, dtype=float32)"),
    (lambda c, b: c.all_reduce(b.double()), "rank 1: all_reduce(count=6, dtype=float64)"),
])
def test_a_collective_that_differs_fails_on_every_rank_naming_each_call(rank1_call, expected):
    world = ExchangeWorld(2, timeout_s=5)
    failures = {}

    def rank_main(rank):
        comm = world.comm(rank)
        buf = _data(rank)
        try:
            if rank == 0:
                comm.all_reduce(buf)
            else:
                rank1_call(comm, buf)
        except ExchangeMismatch as error:
            failures[rank] = str(error)
            raise

    with pytest.raises(ExchangeMismatch, match="call #1 differs across ranks"):
        world.run(rank_main)
    assert set(failures) == {0, 1}
    assert all("rank 0: all_reduce(count=6, dtype=float32)" in f and expected in f for f in failures.values())


def test_a_different_reduce_root_is_a_mismatch():
    world = ExchangeWorld(2, timeout_s=5)
    with pytest.raises(ExchangeMismatch, match=r"rank 0: reduce\(root=0.*rank 1: reduce\(root=1"):
        world.run(lambda rank: world.comm(rank).reduce(_data(rank), root=rank))


def test_a_missing_call_fails_fast_naming_the_rank_and_the_call():
    """Rank 1 returns after one call; rank 0 issues a second: it fails at once (not at the timeout), naming both."""
    world = ExchangeWorld(2, timeout_s=30)

    def rank_main(rank):
        comm = world.comm(rank)
        comm.all_reduce(_data(rank))
        if rank == 0:
            comm.reduce(_data(rank), root=1)

    start = time.monotonic()
    with pytest.raises(ExchangeTimeout, match=r"rank 0, call #2 reduce\(root=1, count=6, dtype=float32\): rank 1 "
                                              r"returned without joining it"):
        world.run(rank_main)
    assert time.monotonic() - start < 30  # the claim: before the world's 30 s timeout, which would also name it


def test_a_stalled_rank_times_out_naming_it():
    world = ExchangeWorld(2, timeout_s=0.5)

    def rank_main(rank):
        if rank == 1:
            time.sleep(1.5)  # joins after rank 0 gave up: it gets rank 0's timeout too
        world.comm(rank).all_reduce(_data(rank))

    with pytest.raises(ExchangeTimeout, match=r"rank 0, call #1 all_reduce.*rank\(s\) \[1\] did not join within 0.5 s"):
        world.run(rank_main)


def test_the_cause_is_raised_not_the_peers_consequence():
    """Rank 1 raises before a collective; rank 0's wait ends with a consequence. run() raises rank 1's error."""
    world = ExchangeWorld(2, timeout_s=30)

    def rank_main(rank):
        if rank == 1:
            raise ValueError("rank 1's own bug")
        world.comm(rank).all_reduce(_data(rank))

    with pytest.raises(ValueError, match="rank 1's own bug") as error:
        world.run(rank_main)
    assert any("rank 1 raised ValueError without joining it" in note for note in error.value.__notes__)


def test_receive_and_send_of_different_sizes_and_an_unreceived_send_are_mismatches():
    world = ExchangeWorld(2, timeout_s=5)

    def sizes(rank):
        comm = world.comm(rank)
        if rank == 0:
            comm.send(_data(0, 4), 1)
        else:
            comm.recv(torch.zeros(3), 0)

    with pytest.raises(ExchangeMismatch, match=r"rank 1's recv #1 recv\(peer=0, count=3.*rank 0's send #1 "
                                               r"send\(peer=1, count=4"):
        world.run(sizes)

    world = ExchangeWorld(2, timeout_s=5)
    with pytest.raises(ExchangeMismatch, match=r"never received: rank 0's send #1 to rank 1 \(4 elements of float32\)"):
        world.run(lambda rank: world.comm(0).send(_data(0, 4), 1) if rank == 0 else None)


# ---- the runtime over an ExchangeWorld: a hand-off with different data per rank -------------------------------------

NUMELS_3 = [7, 5, 9, 4, 6, 3]  # flat over 3 partitions of 12; a bucket of 12 cuts flushes across partitions


def _handoff_steps(world, steps=3):
    """Three ranks, the hand-off forced, each rank its own gradients; returns the runtimes after ``steps`` backwards
    and whether every kept grad buffer held the true reduced gradient, bitwise, after every step."""
    from tests.support.fakes import exchange_runtimes, flat_map

    ids = [11, 22, 33]
    runtimes = exchange_runtimes(world, flat_map(NUMELS_3, 3), ids, algo="handoff", bucket=12)
    exact = True
    for step in range(steps):
        def grads(rank, step=step):  # multiples of 3: every share (/ 3) and every sum of shares is exact in any order
            return {pid: (torch.arange(n, dtype=torch.float32) * (rank + 1) + 10 * pid + 100 * step) * 3
                    for pid, n in enumerate(NUMELS_3)}

        def backward(rank):
            rt, g = runtimes[rank], grads(rank)
            rt.start_backward(True)
            for pid in reversed(range(len(NUMELS_3))):
                rt.reduce_grad(g[pid], ids[rank], pid)
            rt.end_backward(ids[rank], False)

        world.run(backward)
        for rt in runtimes:
            for pid, p in rt._params.items():
                kept = p.grad_buffer
                if kept.numel():
                    true = sum(grads(q)[pid] / 3 for q in range(3))[p.offset:p.offset + kept.numel()]
                    exact &= torch.equal(kept, true)
    return runtimes, exact


def test_a_forced_handoff_between_three_exchanging_ranks_gives_every_keeper_the_true_sum():
    world = ExchangeWorld(3, timeout_s=10)
    runtimes, exact = _handoff_steps(world)
    assert exact
    assert all(rt.stats.handoff_rounds > 0 and rt.stats.sends + rt.stats.recvs > 0 for rt in runtimes)


def test_negative_control_a_handoff_piece_sent_to_the_wrong_rank_shows_as_wrong_gradients(monkeypatch):
    """Every rank agrees on the misrouted transfer (it is in the shared layout), so the calls match; the true owner
    never receives that piece and keeps its ReduceScatter's NaN there."""
    import owner_reduce.runtime.placement as placement
    from harness.faults import break_layout, break_step_layouts

    original, original_step = placement.plan_owner_layout, placement.plan_step_layouts
    monkeypatch.setattr(placement, "plan_owner_layout",
                        lambda *a, **k: break_layout(original(*a, **k), "handoff_wrong_owner", 3))
    monkeypatch.setattr(placement, "plan_step_layouts",  # a learned schedule's flushes
                        lambda *a, **k: break_step_layouts(original_step(*a, **k), "handoff_wrong_owner", 3))
    runtimes, exact = _handoff_steps(ExchangeWorld(3, timeout_s=10))
    assert runtimes[0].stats.handoff_rounds > 0 and not exact
