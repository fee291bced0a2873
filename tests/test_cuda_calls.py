"""What the hot path asks of CUDA, counted on CPU: the streams seam (``CudaStreams``) driven with a fake ``torch.cuda``
that counts every stream and event call, and a counting copy.

Why: the host time per reduce_grad on a GPU is mostly Python calls into CUDA (a stream switch, an event and a
``record_stream`` per gradient took it to 43-63 µs on an H200 host). The discipline now is one copy per piece of a
gradient and no stream or event call per gradient; per flush one stream wait, one switch and one event. This test
fails if a per-gradient CUDA call comes back, without a GPU.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from fakes import MirrorComm, flat_map, mirror_runtime

from owner_reduce.runtime.streams import CudaStreams


class FakeCuda:
    """Stands in for ``torch.cuda`` in ``CudaStreams``: every call is counted by name."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._current = _FakeStream(self, "current")

    def Stream(self, device, priority=0):  # noqa: N802 - torch.cuda's name
        self.calls["Stream"] += 1
        return _FakeStream(self, "side")

    def Event(self, enable_timing=False):  # noqa: N802 - torch.cuda's name
        self.calls["Event"] += 1
        return _FakeEvent(self)

    def current_stream(self, device=None):
        self.calls["current_stream"] += 1
        return self._current

    def stream(self, stream):
        self.calls["stream switch"] += 1
        return contextlib.nullcontext()


class _FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self._cuda, self.name = cuda, name

    def wait_event(self, event):
        self._cuda.calls["wait_event"] += 1

    def wait_stream(self, stream):
        self._cuda.calls["wait_stream"] += 1

    def query(self):
        self._cuda.calls["query"] += 1
        return True

    def synchronize(self):
        self._cuda.calls["synchronize"] += 1


class _FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self._cuda = cuda

    def record(self, stream=None):
        self._cuda.calls["Event.record"] += 1

    def elapsed_time(self, end):
        self._cuda.calls["Event.elapsed_time"] += 1
        return 0.25  # ms


NUMELS = [3 + (7 * i) % 11 for i in range(40)]  # 40 gradients of 3..13 elements; ws 2: a straddler in the middle


def _steps(rank, bucket, steps=4, algo="auto", measure=False):
    m = flat_map(NUMELS, 2)
    rt, comm = mirror_runtime(m, rank=rank, bucket=bucket, algo=algo, measure=measure)
    cuda = FakeCuda()
    streams = rt.placer.streams = CudaStreams(torch.device("cpu"), cuda=cuda)
    copies = Counter()

    def counting_copy(dst, src):
        copies["copy"] += 1
        dst.copy_(src)

    streams.copy = counting_copy
    grads = {p.param_id: torch.arange(1.0, p.numel + 1) for p in m}
    per_step = []
    for _ in range(steps):
        before_calls, before_copies, before_flushes = sum(cuda.calls.values()), copies["copy"], rt.stats.flushes
        rt.start_backward(True)
        for pid in reversed(range(len(NUMELS))):
            rt.reduce_grad(grads[pid], 11, pid)
        rt.end_backward(11, False)
        per_step.append((sum(cuda.calls.values()) - before_calls, copies["copy"] - before_copies,
                         rt.stats.flushes - before_flushes))
    for p in m:  # the values are right as well (identical data on both ranks, pre-divided, summed)
        buf = rt._params[p.param_id].grad_buffer
        assert torch.equal(buf, grads[p.param_id][rt._params[p.param_id].offset:][:buf.numel()])
    return per_step, cuda, m, rt


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("bucket", [1 << 20, 60])
def test_no_cuda_call_per_gradient_only_per_flush(rank, bucket):
    per_step, cuda, m, _ = _steps(rank, bucket)
    pieces = sum(max(1, len([s for s in m.slices(p.param_id) if s.length])) for p in m)
    for step, (calls, copies, flushes) in enumerate(per_step):
        assert flushes >= 1
        # Per flush: the bucket waits for its last flush (current_stream + wait_event, from the second fill on),
        # the reduce stream waits for the current one (current_stream + wait_stream + stream switch), the bucket's
        # free event (Event + record); per step, end_backward's bounded wait polls the reduce stream (query).
        assert calls <= 7 * flushes + 1, (step, calls, flushes, cuda.calls)
        if step >= 1:  # scheduled: each gradient copied whole, or slice by slice
            assert copies == pieces, (step, copies)
        else:  # arrival order: one copy per gradient
            assert copies == len(NUMELS)
    assert cuda.calls["Stream"] == 1  # one reduce stream for the whole run


def test_the_measured_guard_times_each_trial_flush_with_two_events_and_stops_after_its_trial():
    """With the guard on (the product's default): in each of the six trial steps every timed flush adds two timing
    events on the reduce stream and one elapsed-time read after the bounded wait, nothing per gradient; from the
    step after the verdict the calls are the steady state's again."""
    steady, _, _, _ = _steps(0, 1 << 20, steps=3)
    per_step, cuda, _, rt = _steps(0, 1 << 20, steps=10, measure=True)
    assert rt.stats.trial_steps == 6 and rt.stats.trials_decided == 1
    assert cuda.calls["Event.elapsed_time"] == 6 * per_step[1][2]
    for step in range(1, 7):  # learned in step 0; steps 1-6 alternate the model's choice and native's calls
        calls, _, flushes = per_step[step]
        assert calls == steady[-1][0] + 5 * flushes, (step, per_step, steady)
    assert all(calls == steady[-1][0] for calls, _, _ in per_step[7:]), (per_step, steady)


class _NodesOfTwo(MirrorComm):
    """The mirror communicator for ranks in nodes of two (launcher order): the agreement sees each rank's local rank,
    and ``split`` makes the node and rail communicators (mirrors too)."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        rows = [list(values) for _ in range(self.world_size)]
        for r, row in enumerate(rows):
            if len(row) > 10:
                row[10] = r % 2
        return rows

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
    rt, _ = mirror_runtime(m, rank=1, bucket=60, algo="two_level", comm=_NodesOfTwo(rank=1, world_size=4))
    cuda = FakeCuda()
    rt.placer.streams = CudaStreams(torch.device("cpu"), cuda=cuda)
    grads = {p.param_id: torch.arange(1.0, p.numel + 1) for p in m}
    for step in range(4):
        before, flushes, stages = Counter(cuda.calls), rt.stats.flushes, rt.stats.two_level_stages
        rt.start_backward(True)
        for pid in reversed(range(len(NUMELS))):
            rt.reduce_grad(grads[pid], 11, pid)
        rt.end_backward(11, False)
        calls = cuda.calls - before
        flushes, stages = rt.stats.flushes - flushes, rt.stats.two_level_stages - stages
        if step >= 2:  # scheduled (learned in step 0), every flush two-level; the level streams exist
            assert flushes > 1 and stages >= flushes, (step, flushes, stages)
            assert calls["Event"] == flushes, calls  # the buckets' free events only
            assert calls["Event.record"] == flushes + stages, calls
            assert calls["wait_event"] <= flushes + stages, calls
            assert calls["wait_stream"] == 2 * flushes + 2, calls  # levels() x2 per flush; join() x2 per step
            assert calls["stream switch"] <= 2 * flushes + 2 * stages, calls
            assert sum(calls.values()) <= 7 * flushes + 1 + 3 * flushes + 4 * stages, calls
    assert cuda.calls["Stream"] == 3  # the reduce stream and the two level streams, once


def test_the_counter_sees_a_per_gradient_call():
    """Negative control: a streams object that records an event per copy (the old copy-stream discipline) shows
    up as calls growing with the gradients."""
    per_step, _, _, _ = _steps(0, 1 << 20)
    baseline = per_step[-1][0]

    class EventPerCopy(CudaStreams):
        pass

    m = flat_map(NUMELS, 2)
    rt, _ = mirror_runtime(m, rank=0)
    cuda = FakeCuda()
    streams = rt.placer.streams = EventPerCopy(torch.device("cpu"), cuda=cuda)

    def copy_with_event(dst, src):
        dst.copy_(src)
        cuda.Event().record(streams.reduce_stream)

    streams.copy = copy_with_event
    for _ in range(3):
        rt.start_backward(True)
        before = sum(cuda.calls.values())
        for pid in reversed(range(len(NUMELS))):
            rt.reduce_grad(torch.ones(NUMELS[pid]), 11, pid)
        rt.end_backward(11, False)
    assert sum(cuda.calls.values()) - before >= baseline + 2 * len(NUMELS)
