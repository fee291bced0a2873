"""Owner-ordered buckets in the runtime, in-process with mirror communicators: the schedule learned from the first
backward, the calls it issues, the fallback when a backward leaves it (identical on every rank), and a negative
control (a layout off by one slice)."""


import pytest
import torch

from tests.support.fakes import NUMELS, ws2_runtime


def _runtime(rank=0, bucket=64, probe=True, algo="reduce"):
    # every rank's probe lines (compile.reduce_probe_all_ranks): the tests read rank 1's too
    return ws2_runtime(rank, owner=True, probe=probe, bucket=bucket, algo=algo, all_ranks=True)


def _grads(scale=1.0):
    return {pid: torch.arange(1, n + 1, dtype=torch.float32) * scale for pid, n in NUMELS.items()}


def _backward(rt, grads, order=(2, 1, 0)):
    rt.start_backward(True)
    for pid in order:
        rt.reduce_grad(grads[pid], 11, pid)
    rt.end_backward(11, False)


def _kept_matches(rt, grads, only=None):
    """Every (chosen) non-empty grad buffer holds its slice of the gradient (identical data, pre-divided)."""
    return all(torch.equal(p.grad_buffer, grads[pid][p.offset:p.offset + p.grad_buffer.numel()])
               for pid, p in rt._params.items() if p.grad_buffer.numel() and (only is None or pid in only))


def _step_calls(comm, since):
    return comm.calls[since:]


@pytest.mark.parametrize("rank", [0, 1])
def test_second_backward_is_one_reduce_scatter(rank):
    """The cost model's own choice (16 elements: latency-bound): the arrival-order flush, whose owners interleave,
    is one AllReduce (its 4 Reduces would run as one NCCL task, one latency, but cost the host 3 more calls to issue:
    issue 39); the owner-ordered one covers both ranks: one ReduceScatter."""
    rt, comm = _runtime(rank=rank, algo="auto")
    _backward(rt, _grads())
    assert comm.calls == [("all_reduce", None, 16)]
    assert rt.stats.schedules_learned == 1 and rt.stats.scheduled_flushes == 0
    n = len(comm.calls)
    _backward(rt, _grads(2.0))
    # Partitions 8 | 8 cover both ranks with equal counts: rank 0's region a + b[0:2], rank 1's b[2:5] + c.
    assert _step_calls(comm, n) == [("reduce_scatter", None, 16)]
    assert _kept_matches(rt, _grads(2.0))
    assert rt.stats.scheduled_flushes == 1 and rt.stats.reduce_scatter_calls == 1
    assert rt.stats.probe_lines[0].endswith(" algo=allreduce") and " owner_elems=0 " in rt.stats.probe_lines[0]
    assert rt.stats.probe_lines[1].endswith(" algo=reduce_scatter")
    assert " discarded=0.0% " in rt.stats.probe_lines[1]
    _backward(rt, _grads(3.0))
    assert _kept_matches(rt, _grads(3.0)) and rt.stats.schedule_fallbacks == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_same_flush_boundaries_with_a_small_bucket(rank):
    rt, comm = _runtime(rank=rank, bucket=6)
    _backward(rt, _grads())  # c | b | a: each overflows the 6-element bucket
    first = list(comm.calls)
    assert rt.stats.flushes == 3
    _backward(rt, _grads(2.0))
    assert rt.stats.flushes == 6 and rt.stats.scheduled_flushes == 3
    # b's flush: its slices are one region each (padding rank 0's 2 to 3 would be 20%): two Reduces, as before.
    assert _step_calls(comm, len(first)) == first
    assert _kept_matches(rt, _grads(2.0))


def test_a_deviating_backward_falls_back_alike_on_every_rank():
    ranks = [_runtime(rank=r) for r in (0, 1)]
    for order, scale in (((2, 1, 0), 1.0), ((2, 0, 1), 2.0), ((2, 0, 1), 3.0), ((2, 0, 1), 4.0)):
        for rt, _ in ranks:
            _backward(rt, _grads(scale), order=order)
            assert _kept_matches(rt, _grads(scale)), (order, scale)
    (rt0, comm0), (rt1, comm1) = ranks
    assert comm0.calls == comm1.calls, "ranks issued different collective sequences"
    # Step 2 left the schedule at its second gradient: c (placed) flushed alone, then a, b[0:2] | b[2:5] in
    # arrival order; step 3 learned the new order in arrival order, step 4 followed it (Reduce forced: one per
    # owner region).
    arrival = [("reduce", 0, 8), ("reduce", 1, 3)]
    assert comm0.calls[4:] == [("reduce", 1, 5), *arrival, ("reduce", 1, 5), *arrival, ("reduce", 0, 8),
                               ("reduce", 1, 8)]
    for rt in (rt0, rt1):
        assert (rt.stats.schedule_fallbacks, rt.stats.schedules_learned, rt.stats.scheduled_flushes) == (1, 2, 2)


def test_a_backward_that_ends_early_flushes_what_it_placed():
    rt, comm = _runtime(rank=1)
    _backward(rt, _grads())
    n = len(comm.calls)
    _backward(rt, _grads(2.0), order=(2, 1))  # a never comes
    # Placed for the ReduceScatter: a@0 b[0:2]@6 | b[2:5]@8 c@11; a's hole is skipped, the rest reduce in place.
    assert _step_calls(comm, n) == [("reduce", 0, 2), ("reduce", 1, 8)]
    assert _kept_matches(rt, _grads(2.0), only={1, 2}) and rt.stats.schedule_fallbacks == 1


def test_two_graphs_in_one_backward_learn_nothing():
    rt, comm = _runtime(rank=0)
    rt.register_graph_z1(12, [0])
    rt.start_backward(True)
    grads = _grads()
    rt.reduce_grad(grads[2], 11, 2)
    rt.reduce_grad(grads[1], 11, 1)
    rt.reduce_grad(grads[0], 12, 0)
    rt.end_backward(12, False)
    assert rt.stats.schedules_learned == 0 and _kept_matches(rt, grads)


@pytest.mark.parametrize("rank", [0, 1])
def test_negative_control_layout_off_by_one_slice_is_caught(rank, monkeypatch):
    import owner_reduce.runtime.flush as flush_module
    import owner_reduce.runtime.placement as placement_module
    from harness.faults import inject

    monkeypatch.setattr(placement_module, "plan_owner_layout", placement_module.plan_owner_layout)  # restored after
    monkeypatch.setattr(placement_module, "plan_step_layouts", placement_module.plan_step_layouts)
    monkeypatch.setattr(flush_module, "plan_flush", flush_module.plan_flush)
    inject("layout_off_by_one", 2)
    rt, _ = _runtime(rank=rank)
    _backward(rt, _grads())
    assert _kept_matches(rt, _grads()), "the arrival-order step is not broken by this fault"
    _backward(rt, _grads(2.0))
    assert rt.stats.scheduled_flushes == 1 and not _kept_matches(rt, _grads(2.0))
