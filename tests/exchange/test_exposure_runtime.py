"""The probe's step summary in the real runtime, without processes, on the host streams (CPU). What it asks of CUDA
(per step, none per gradient, never a wait) and its timing are checked on the simulated device, in
``test_exposure_sim.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from owner_reduce.planning.exposure import PROBE_STEPS
from tests.support.fakes import MirrorComm, flat_map, mirror_runtime

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
