"""What the hot path asks of CUDA, counted on the simulated device (``sim_cuda``): the real runtime and the real
``CudaStreams`` on the sim's ``torch.cuda``, every stream and event call counted by the sim by kind.

Why: the host time per reduce_grad on a GPU is mostly Python calls into CUDA (a stream switch, an event and a
``record_stream`` per gradient took it to 43-63 µs on an H200 host). The discipline now is one copy per piece of a
gradient and no stream or event call per gradient; per flush one stream wait, one switch and one event. This test
fails if a per-gradient CUDA call comes back, without a GPU. The communicator is one rank's mirror (its sums are
device ops, no CUDA API call): what is counted is the runtime's own use of CUDA.

Counted: what the product asks of ``torch.cuda`` (``CUDA_CALLS``); a stream ``query`` that finds work still pending
is a poll of a wait (``query (not ready)``, how often depends on the worker threads), not a call of the hot path, and
is left out.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from owner_reduce.runtime.streams import CudaStreams
from tests.support.fakes import MirrorComm, flat_map, rows_in_nodes
from tests.support.sim.cuda import Sim
from tests.support.sim.runtime import make_runtime

CUDA_CALLS = ("Stream", "Event", "current_stream", "stream switch", "wait_event", "wait_stream", "query",
              "synchronize", "Event.record", "Event.query", "Event.synchronize", "Event.elapsed_time",
              "record_stream")


def _calls(sim: Sim) -> Counter[str]:
    counters = sim.process(0).counters
    return Counter({kind: counters[kind] for kind in CUDA_CALLS if counters[kind]})


NUMELS = [3 + (7 * i) % 11 for i in range(40)]  # 40 gradients of 3..13 elements; ws 2: a straddler in the middle


def _steps(rank, bucket, steps=4, algo="auto", measure=False):
    """``steps`` backwards of rank ``rank`` of 2 on the sim; per step (CUDA calls, copies into buckets, flushes).
    ``rt.growth_per_step``: each step's host waits before a bucket grows (``buckets`` Note (growth))."""
    m = flat_map(NUMELS, 2)
    with Sim(max_ranks=1) as sim:
        rt = make_runtime(m, rank, lambda group: MirrorComm(rank=rank, world_size=2), algo=algo, bucket=bucket,
                          measure=measure)
        copies = Counter()
        streams = rt.placer.streams = CudaStreams(torch.device("cuda", 0))  # what make_streams makes for a CUDA grad

        def counting_copy(dst, src):
            copies["copy"] += 1
            CudaStreams.copy(dst, src)

        streams.copy = counting_copy
        growth = Counter()
        sync = rt.placer._sync
        rt.placer._sync = lambda call: (growth.update([call]), sync(call))
        rt.growth_per_step = []

        grads = {p.param_id: torch.arange(1.0, p.numel + 1, device="cuda") for p in m}
        per_step = []
        for _ in range(steps):
            before_calls, before_copies, before_flushes = sum(_calls(sim).values()), copies["copy"], rt.stats.flushes
            grown = growth["bucket growth"]
            rt.start_backward(True)
            for pid in reversed(range(len(NUMELS))):
                rt.reduce_grad(grads[pid], 11, pid)
            rt.end_backward(11, False)
            per_step.append((sum(_calls(sim).values()) - before_calls, copies["copy"] - before_copies,
                             rt.stats.flushes - before_flushes))
            rt.growth_per_step.append(growth["bucket growth"] - grown)
        for p in m:  # the values are right as well (identical data on both ranks, pre-divided, summed)
            buf = rt._params[p.param_id].grad_buffer.cpu()
            assert torch.equal(buf, grads[p.param_id].cpu()[rt._params[p.param_id].offset:][:buf.numel()])
        calls = _calls(sim)
    return per_step, calls, m, rt


def _assert_calls_only_per_flush(rank, bucket):
    per_step, calls_total, m, _ = _steps(rank, bucket)
    pieces = sum(max(1, len([s for s in m.slices(p.param_id) if s.length])) for p in m)
    for step, (calls, copies, flushes) in enumerate(per_step):
        assert flushes >= 1
        # Per flush: the bucket waits for its last flush (current_stream + wait_event, from the second fill on),
        # the reduce stream waits for the current one (current_stream + wait_stream + stream switch), the bucket's
        # free event (Event + record); per step, end_backward's bounded wait polls the reduce stream (query).
        assert calls <= 7 * flushes + 1, \
            f"step {step}: {calls} CUDA calls for {flushes} flushes, over 7 per flush + 1 ({dict(calls_total)})"
        if step >= 1:  # scheduled: each gradient copied whole, or slice by slice
            assert copies == pieces, (step, copies)
        else:  # arrival order: one copy per gradient
            assert copies == len(NUMELS)
    assert calls_total["Stream"] == 1  # one reduce stream for the whole run


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("bucket", [1 << 20, 60])
def test_no_cuda_call_per_gradient_only_per_flush(rank, bucket):
    _assert_calls_only_per_flush(rank, bucket)


def test_the_measured_guard_times_each_trial_flush_with_two_events_and_stops_after_its_trial():
    """With the guard on (the product's default): in each of the six trial steps every timed flush adds two timing
    events on the reduce stream and one elapsed-time read after the bounded wait, nothing per gradient; from the
    step after the verdict the calls are the steady state's again. The buckets grow once, for both variants, at the
    end of the learning step, never in a timed step (``placement`` Note (trial room)); a growth's wait is one call."""
    steady, _, _, steady_rt = _steps(0, 1 << 20, steps=3)
    per_step, calls_total, _, rt = _steps(0, 1 << 20, steps=10, measure=True)
    assert rt.stats.trial_steps == 6 and rt.stats.trials_decided == 1
    assert calls_total["Event.elapsed_time"] == 6 * per_step[1][2]
    assert rt.growth_per_step[0] == 1 and rt.growth_per_step[1:] == [0] * 9, rt.growth_per_step
    for step in range(1, 7):  # learned in step 0; steps 1-6 alternate the model's choice and native's calls
        calls, _, flushes = per_step[step]  # (double-buffered: a bucket's free event is waited for from step 2 on)
        without_growth = steady[min(step, 2)][0] - steady_rt.growth_per_step[min(step, 2)]
        assert calls == without_growth + 5 * flushes, (step, per_step, steady, steady_rt.growth_per_step)
    assert all(calls == steady[-1][0] for calls, _, _ in per_step[7:]), (per_step, steady)


class _NodesOfTwo(MirrorComm):
    """The mirror communicator for ranks in nodes of two (launcher order): the agreement sees each rank's host and
    local rank, and ``split`` makes the node and rail communicators (mirrors too)."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return rows_in_nodes(values, self.world_size, 2)

    def _split(self, groups):
        members = list(next(g for g in groups if self.rank in g))
        return MirrorComm(rank=members.index(self.rank), world_size=len(members))


def test_a_two_level_flush_adds_a_few_cuda_calls_per_stage_and_none_per_gradient(monkeypatch):
    """Two nodes of two, every owner-ordered flush two-level: per stage a switch to each level's stream and one
    record and wait of the stage event (made once: no event per stage); per flush the node stream's waits for the
    current and the reduce stream (never for the rail: flushes overlap) and the switch to the rail stream for the
    copy-out; per step the reduce stream's waits for both levels before the host waits; the level streams made once,
    nothing per gradient."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    m = flat_map(NUMELS, 4)
    with Sim(max_ranks=1) as sim:
        rt = make_runtime(m, 1, lambda group: _NodesOfTwo(rank=1, world_size=4), algo="two_level", bucket=60)
        grads = {p.param_id: torch.arange(1.0, p.numel + 1, device="cuda") for p in m}
        for step in range(4):
            before, flushes, stages = _calls(sim), rt.stats.flushes, rt.stats.two_level_stages
            rt.start_backward(True)
            for pid in reversed(range(len(NUMELS))):
                rt.reduce_grad(grads[pid], 11, pid)
            rt.end_backward(11, False)
            calls = _calls(sim) - before
            flushes, stages = rt.stats.flushes - flushes, rt.stats.two_level_stages - stages
            if step >= 2:  # scheduled (learned in step 0), every flush two-level; the level streams exist
                assert flushes > 1 and stages >= flushes, (step, flushes, stages)
                assert calls["Event"] == flushes, calls  # the buckets' free events only
                assert calls["Event.record"] == flushes + stages, calls
                assert calls["wait_event"] <= flushes + stages, calls
                assert calls["wait_stream"] == 2 * flushes + 2, calls  # levels() x2 per flush; join() x2 per step
                assert calls["stream switch"] <= 2 * flushes + 2 * stages, calls
                assert sum(calls.values()) <= 7 * flushes + 1 + 3 * flushes + 4 * stages, calls
        assert _calls(sim)["Stream"] == 3  # the reduce stream and the two level streams, once


@pytest.mark.parametrize("bucket", [1 << 20, 60])
def test_the_bound_rejects_a_per_gradient_cuda_call_in_the_placement(monkeypatch, bucket):
    """Negative control of the bound above: the product's placement of a scheduled gradient also records an event on
    the current stream (the old copy-stream discipline's per-gradient call, three CUDA calls: Event, current_stream,
    record). The same assertions then fail on the per-flush bound, at the first scheduled step."""
    from owner_reduce.runtime.placement import GradPlacer

    place = GradPlacer._place

    def place_and_record(self, step, grad):
        place(self, step, grad)
        torch.cuda.Event().record(torch.cuda.current_stream(grad.device))

    monkeypatch.setattr(GradPlacer, "_place", place_and_record)
    with pytest.raises(AssertionError, match=r"^step 1: \d+ CUDA calls for \d+ flushes, over 7 per flush \+ 1"):
        _assert_calls_only_per_flush(0, bucket)
