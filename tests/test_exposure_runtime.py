"""The probe's step summary in the real runtime, without processes: on the host streams (CPU) and on a counting
stand-in for ``torch.cuda`` (what the probe adds per step, and that it never waits). The simulated device's timing
checks are in ``test_exposure_sim.py``.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter

import pytest
import torch
from fakes import MirrorComm, flat_map, mirror_runtime

from owner_reduce.planning.exposure import PROBE_STEPS
from owner_reduce.runtime.streams import CudaStreams

NUMELS = [3 + (7 * i) % 11 for i in range(40)]  # 40 gradients of 3..13 elements
LINE_RE = re.compile(r"^\[dc-probe\]\[r0\] step (\d+): reduction (\d+\.\d+) ms, exposed (\d+\.\d+) ms \((\d+)%\) of a "
                     r"(\d+\.\d+) ms step \(most exposed: rank (\d+)\); (.*)$")


class CountingComm(MirrorComm):
    gathers = 0

    def all_gather_ints(self, values):
        self.gathers += 1
        return super().all_gather_ints(values)


def _train(rt, steps, grads, ga=1, numels=NUMELS):
    for _ in range(steps):
        for micro in range(ga):
            rt.start_backward(micro == ga - 1)
            for pid in reversed(range(len(numels))):
                rt.reduce_grad(grads[pid], 11, pid)
            rt.end_backward(11, False)


def _runtime(rank=0, owner=False, bucket=60, measure=False, ws=2, numels=NUMELS):
    owner_map = flat_map(numels, ws)
    comm = CountingComm(rank=rank, world_size=ws)
    rt, _ = mirror_runtime(owner_map, rank=rank, bucket=bucket, probe=True, owner=owner, measure=measure, comm=comm)
    grads = {p.param_id: torch.arange(1.0, p.numel + 1) for p in owner_map}
    return rt, comm, grads


@pytest.mark.parametrize("owner", [False, True])
def test_on_the_host_the_lines_come_once_after_the_probes_steps_and_add_up(owner):
    rt, comm, grads = _runtime(owner=owner, measure=owner)
    _train(rt, PROBE_STEPS + 1, grads)
    # The agreement at init, and the measured guard's once its trial is decided (owner path on).
    assert rt.stats.exposure_lines == [] and comm.gathers == 1 + rt.stats.trials_decided
    _train(rt, 1, grads)  # the step that reads the probe's last step gathers every rank's numbers, once
    assert comm.gathers == 2 + rt.stats.trials_decided
    lines = rt.stats.exposure_lines
    assert len(lines) == PROBE_STEPS
    for k, line in enumerate(lines):
        m = LINE_RE.match(line)
        assert m, line
        span, exposed, step = (float(m.group(i)) for i in (2, 3, 5))
        assert int(m.group(1)) == k + 2
        assert 0 <= exposed <= span <= step, line
        if owner:
            assert m.group(7) in ("measured on the owner path",
                                  "measured on native's calls (the measured guard's trial step)"), line
        else:
            assert re.fullmatch(r"the owner path saves up to \d+\.\d+ ms of it \(modelled\)", m.group(7)), line
    if owner:  # the guard's trial alternates the model's choice and native's calls from step 2
        assert [line.endswith("the owner path") for line in lines] == [True, False] * (PROBE_STEPS // 2)
    samples = rt.stats.exposure_samples
    assert [s.step for s in samples] == list(range(2, PROBE_STEPS + 2))
    assert all(0 <= s.exposed_us <= s.span_us <= s.step_us for s in samples)
    assert all((s.saving_us is None) == owner for s in samples)
    before = comm.gathers
    _train(rt, 3, grads)
    assert comm.gathers == before and len(rt.stats.exposure_lines) == PROBE_STEPS  # nothing more after the probe


def test_only_rank_0_prints_the_summary_and_every_rank_keeps_its_numbers():
    rt, _, grads = _runtime(rank=1)
    _train(rt, PROBE_STEPS + 2, grads)
    assert rt.stats.exposure_lines == [] and len(rt.stats.exposure_samples) == PROBE_STEPS


def test_backwards_that_reduce_nothing_are_not_steps():
    """ZeRO-1 with accumulation: only the boundary backward flushes; the probe counts those, and its step runs from
    one boundary's reduction end to the next (both micro-steps inside)."""
    rt, _, grads = _runtime()
    _train(rt, PROBE_STEPS + 2, grads, ga=2)
    assert rt.stats.end_backward_calls == 2 * (PROBE_STEPS + 2)
    assert len(rt.stats.exposure_lines) == PROBE_STEPS


def test_no_lines_without_the_probe():
    owner_map = flat_map(NUMELS, 2)
    rt, _ = mirror_runtime(owner_map, probe=False)
    grads = {p.param_id: torch.ones(p.numel) for p in owner_map}
    _train(rt, PROBE_STEPS + 3, grads)
    assert rt.stats.exposure_lines == [] and rt.stats.exposure_samples == []
    assert rt.flusher.exposure is None


def test_the_models_saving_is_there_where_the_owner_path_would_win():
    """Gradients large enough for the model to prefer the owner path at ws 8 (bandwidth-bound): a probe-only run's
    lines carry a positive modelled saving, never more than what was exposed."""
    numels = [1 << 16] * 16
    rt, _, grads = _runtime(ws=8, bucket=1 << 17, numels=numels)
    _train(rt, PROBE_STEPS + 2, grads, numels=numels)
    samples = rt.stats.exposure_samples
    assert all(0 < s.saving_us <= s.exposed_us for s in samples), samples


# ---- what the probe asks of CUDA ----------------------------------------------------------------------------------

class TimedCuda:
    """Stands in for ``torch.cuda`` in ``CudaStreams``: counts every call by name, gives each record the next tick of
    a clock (so elapsed times are defined), and answers ``query`` False for the events in ``not_ready``."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.ticks = 0
        self.not_ready: set[int] = set()
        self.timing_events = 0
        self._current = _Stream(self)

    def Stream(self, device, priority=0):  # noqa: N802 - torch.cuda's name
        self.calls["Stream"] += 1
        return _Stream(self)

    def Event(self, enable_timing=False):  # noqa: N802 - torch.cuda's name
        self.calls["Event"] += 1
        self.timing_events += enable_timing
        return _Event(self, enable_timing)

    def current_stream(self, device=None):
        self.calls["current_stream"] += 1
        return self._current

    def stream(self, stream):
        self.calls["stream switch"] += 1
        return contextlib.nullcontext()


class _Stream:
    def __init__(self, cuda):
        self._cuda = cuda

    def wait_event(self, event):
        self._cuda.calls["wait_event"] += 1

    def wait_stream(self, stream):
        self._cuda.calls["wait_stream"] += 1

    def query(self):
        self._cuda.calls["query"] += 1
        return True

    def synchronize(self):
        self._cuda.calls["synchronize"] += 1


class _Event:
    def __init__(self, cuda, timing):
        self._cuda, self.timing, self.tick = cuda, timing, None

    def record(self, stream=None):
        self._cuda.calls["Event.record"] += 1
        self._cuda.ticks += 1
        self.tick = self._cuda.ticks

    def query(self):
        self._cuda.calls["Event.query"] += 1
        return id(self) not in self._cuda.not_ready

    def synchronize(self):
        self._cuda.calls["Event.synchronize"] += 1

    def elapsed_time(self, end):
        self._cuda.calls["Event.elapsed_time"] += 1
        assert self.timing and end.timing, "elapsed_time of an event made without enable_timing"
        return (end.tick - self.tick) * 0.001


def _cuda_steps(probe, steps, numels=NUMELS, bucket=60):
    owner_map = flat_map(numels, 2)
    rt, _ = mirror_runtime(owner_map, rank=0, bucket=bucket, probe=probe, owner=False)
    cuda = TimedCuda()
    rt.placer.streams = CudaStreams(torch.device("cpu"), cuda=cuda)
    grads = {p.param_id: torch.ones(p.numel) for p in owner_map}
    per_step = []
    for _ in range(steps):
        before, flushes = Counter(cuda.calls), rt.stats.flushes
        _train(rt, 1, grads, numels=numels)
        per_step.append((cuda.calls - before, rt.stats.flushes - flushes))
    return rt, cuda, per_step


@pytest.mark.parametrize("gradients", [40, 120])
def test_the_probe_adds_a_few_cuda_calls_per_step_none_per_gradient_and_never_waits(gradients):
    """Per probe step: three timing events and their records (the compute mark on the current stream), and a step
    later two queries and at most three elapsed-time reads plus one per flush read back; never a synchronize. The
    same for 40 and 120 gradients (more flushes too); after the probe's steps, exactly the calls of a run without
    it."""
    numels = [3 + (7 * i) % 11 for i in range(gradients)]
    steps = PROBE_STEPS + 4
    _, _, plain = _cuda_steps(False, steps, numels)
    rt, cuda, probed = _cuda_steps(True, steps, numels)
    assert len(rt.stats.exposure_lines) == PROBE_STEPS
    for step, ((calls, flushes), (base, base_flushes)) in enumerate(zip(probed, plain, strict=True)):
        assert flushes == base_flushes and flushes >= 2
        added = calls - base
        assert not (base - calls), (step, base - calls)  # nothing of the plain run's is dropped
        assert added["synchronize"] == added["Event.synchronize"] == 0 and calls["Event.synchronize"] == 0
        if step <= PROBE_STEPS:  # steps 1..7 recorded (step 1 marks where step 2 starts)
            assert added["Event"] == 3 and added["Event.record"] == 3 and added["current_stream"] == 1, added
        if 2 <= step <= PROBE_STEPS + 1:  # steps 3..8 read the step before (step 1 is only a start)
            assert added["Event.query"] == 2, added
            assert 3 <= added["Event.elapsed_time"] <= 3 + flushes, added
        reads = added["Event.query"] + added["Event.elapsed_time"]
        assert sum(added.values()) <= 7 + reads
        assert sum(added.values()) <= 7 + 2 + 3 + flushes  # per step and per flush read, never per gradient
        if step > PROBE_STEPS + 1:
            assert not added, (step, added)  # the probe is done: the plain run's calls exactly
    # The free events of the probe's steps were timing events (each flush's end mark), and only those.
    probe_flushes = sum(f for _, f in probed[:PROBE_STEPS + 1])
    assert cuda.timing_events == 3 * (PROBE_STEPS + 1) + probe_flushes


def test_a_step_whose_marks_have_not_completed_is_not_measured_and_never_waited_for():
    """Negative control of the no-wait rule: the compute mark of one step answers query() False a step later; that
    step is 'not measured' (no elapsed_time read of it, which CUDA would refuse), the others are read."""
    owner_map = flat_map(NUMELS, 2)
    rt, _ = mirror_runtime(owner_map, rank=0, bucket=60, probe=True, owner=False)
    cuda = TimedCuda()
    rt.placer.streams = CudaStreams(torch.device("cpu"), cuda=cuda)
    grads = {p.param_id: torch.ones(p.numel) for p in owner_map}
    compute_mark = CudaStreams.compute_mark
    marks = []

    def remembered(self):
        marks.append(compute_mark(self))
        return marks[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CudaStreams, "compute_mark", remembered)
        _train(rt, 3, grads)
        cuda.not_ready.add(id(marks[2]))  # step 3's compute mark, read at step 4's end_backward
        _train(rt, PROBE_STEPS, grads)
    assert cuda.calls["Event.synchronize"] == 0
    samples = rt.stats.exposure_samples
    assert [s is None for s in samples] == [k == 1 for k in range(PROBE_STEPS)]
    assert rt.stats.exposure_lines[1] == ("[dc-probe][r0] step 3: not measured (no rank's marks had completed a step "
                                          "later; the probe never waits for them)")
