"""The probe's step summary, its pure parts: span, exposed and step from marks, the exposed part cut by flush, the
model's saving, the one gather's rows and the line (``planning.exposure``). No processes, no torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from owner_reduce.planning.collective_time import topology_of
from owner_reduce.planning.exposure import (
    ARRIVAL,
    MODELLED,
    NATIVE_TRIAL,
    OWNER,
    PROBE_STEPS,
    StepExposure,
    exposed_from,
    exposed_parts,
    format_step_line,
    measure_step,
    modelled_saving,
    owner_path_us,
    owner_ratio,
    pack_row,
    slowest,
    unpack_rows,
)
from owner_reduce.planning.flush_choice import FlushCost
from tests.support.fakes import flat_map


def _timeline(compute_per_layer, delay, layers, tail=0.0):
    """A backward of ``layers`` layers, each ``compute_per_layer`` long and followed by one flush of ``delay`` on one
    reduce stream (in order), then ``tail`` of compute: each flush's end, the compute end."""
    ends, free = [], 0.0
    for layer in range(1, layers + 1):
        start = max(layer * compute_per_layer, free)
        free = start + delay
        ends.append(free)
    return ends, layers * compute_per_layer + tail


@pytest.mark.parametrize("compute,delay,tail,expected_exposed", [
    (2.0, 0.5, 1.0, 0.0),  # hidden: every flush ends before the compute does
    (2.0, 3.0, 0.0, 6.0),  # in between: the flushes queue; 14 - 8
    (0.0, 5.0, 0.0, 20.0),  # exposed: every gradient at the end
])
def test_span_exposed_and_step_from_marks(compute, delay, tail, expected_exposed):
    ends, compute_end = _timeline(compute, delay, 4, tail)
    first_start = compute  # the first flush starts when its layer is done (the stream is free)
    span, exposed, step = measure_step(-3.0, first_start, compute_end, ends[-1])
    assert span == pytest.approx(ends[-1] - first_start)
    assert exposed == pytest.approx(expected_exposed)
    assert step == pytest.approx(ends[-1] + 3.0)
    assert 0 <= exposed <= span <= step
    parts = exposed_parts(exposed_from(first_start, compute_end), ends[-1], reversed(ends[:-1]))
    assert sum(parts) == pytest.approx(exposed)


def test_the_exposed_part_never_starts_before_the_first_flush():
    """One flush, issued by end_backward after the compute mark: all of it is exposed, not more."""
    span, exposed, step = measure_step(0.0, 10.0, 8.0, 15.0)
    assert (span, exposed, step) == (5.0, 5.0, 15.0)
    assert exposed_parts(exposed_from(10.0, 8.0), 15.0, ()) == (5.0,)


def test_exposed_parts_are_cut_by_flush_and_read_only_as_far_as_needed():
    ends = [5.0, 8.0, 11.0, 14.0]  # compute ends at 8: flushes 3 and 4 end after it
    read = []

    def lazily():
        for e in reversed(ends[:-1]):
            read.append(e)
            yield e

    assert exposed_parts(8.0, 14.0, lazily()) == (3.0, 3.0)
    assert read == [11.0, 8.0]  # flush 1's end is never read (on a GPU: an event read saved)
    assert exposed_parts(20.0, 14.0, lazily()) == ()  # hidden: nothing is read


def test_the_models_saving_scales_each_exposed_piece():
    assert modelled_saving((3.0, 3.0), (0.5, 1.0)) == pytest.approx(1.5)
    assert modelled_saving((), ()) == 0.0
    assert owner_ratio(2.0, 4.0) == 0.5
    assert owner_ratio(5.0, 4.0) == 1.0  # never a loss
    assert owner_ratio(1.0, 0.0) == 1.0  # nothing to say
    with pytest.raises(ValueError):
        modelled_saving((1.0,), ())


def test_the_owner_paths_modelled_time_beats_an_allreduce_where_bandwidth_rules():
    """64 MiB of bf16 over 8 ranks, one owner per eighth: the model's choice (a ReduceScatter) is about half an
    AllReduce, the bandwidth ratio; and the choice is never modelled slower than the AllReduce."""
    numels = [1 << 22] * 8
    owner_map = flat_map(numels, 8)
    cost = FlushCost(topology_of(8, 8, "hopper"))
    grads = [(i, n) for i, n in enumerate(numels)]
    owner = owner_path_us(grads, owner_map, cost, capacity=sum(numels))
    allreduce = cost.calls_us([("allreduce", sum(numels))])
    assert 0.3 < owner_ratio(owner, allreduce) < 0.7, (owner, allreduce)
    tiny = flat_map([8] * 8, 8)
    owner = owner_path_us([(i, 8) for i in range(8)], tiny, cost, capacity=64)
    assert 0 < owner <= cost.group_us([("allreduce", 64)])  # both alone, their issue included (issue 39)


def _sample(step, exposed, span=10.0, total=50.0, saving=None, how=MODELLED):
    return StepExposure(step, span * 1000, exposed * 1000, total * 1000, saving, how)


def test_rows_round_trip_and_the_most_exposed_rank_is_picked():
    ranks = [[_sample(2 + k, 1.0 + r + k, saving=0.5 * 1000) for k in range(PROBE_STEPS)] for r in range(3)]
    ranks[1][2] = None  # rank 1 could not read step 4's marks
    per_step = unpack_rows([pack_row(samples) for samples in ranks])
    assert len(per_step) == PROBE_STEPS
    assert per_step[0][2] == ranks[2][0]
    assert per_step[2][1] is None
    assert slowest(per_step[0]) == (2, ranks[2][0])
    assert slowest([None, None]) is None
    with pytest.raises(ValueError):
        pack_row(ranks[0][:2])
    with pytest.raises(RuntimeError, match="different probe steps"):
        unpack_rows([pack_row(ranks[0]), pack_row(ranks[0])[:-5]])


def test_the_line():
    s = StepExposure(3, 41_200, 12_700, 180_400, 5_900)
    assert format_step_line(3, [None, s, _sample(3, 1.0)]) == (
        "[dc-probe][r0] step 3: reduction 41.2 ms, exposed 12.7 ms (31%) of a 180.4 ms step (most exposed: rank 1, "
        "1 rank not measured); the owner path saves up to 5.9 ms of it (modelled)")
    owner = StepExposure(5, 800, 40, 2_000, None, OWNER)
    assert format_step_line(5, [owner]) == (
        "[dc-probe][r0] step 5: reduction 0.800 ms, exposed 0.040 ms (5%) of a 2.0 ms step (most exposed: rank 0); "
        "measured on the owner path")

    assert format_step_line(4, [replace(owner, how=NATIVE_TRIAL)]).endswith(
        "; measured on native's calls (the measured guard's trial step)")
    assert format_step_line(4, [replace(owner, how=ARRIVAL)]).endswith("; measured in arrival order (no schedule "
                                                                      "followed in this step)")
    assert format_step_line(6, [None, None]) == (
        "[dc-probe][r0] step 6: not measured (no rank's marks had completed a step later; the probe never waits for "
        "them)")
    assert "\n" not in format_step_line(3, [s])


def test_size_the_win_explains_the_line_with_one_the_format_makes():
    """The help's example line (wrapped there) has the line's exact shape, so a change of format shows here."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "scripts" / "size_the_win.py").read_text()
    help_text = text[text.index("READING_THE_PROBE = "):text.index("def parse_args")]
    start = help_text.index("[dc-probe][r0] step ")
    example = " ".join(line.strip() for line in help_text[start:help_text.index("(modelled)") + 10].splitlines())
    m = re.fullmatch(r"\[dc-probe\]\[r0\] step (\d+): reduction ([\d.]+) ms, exposed ([\d.]+) ms \((\d+)%\) of a "
                     r"([\d.]+) ms step \(most exposed: rank (\d+)\); the owner path saves up to ([\d.]+) ms of it "
                     r"\(modelled\)", example)
    assert m, example
    span, exposed, step, saving = (float(m.group(i)) for i in (2, 3, 5, 7))
    s = StepExposure(int(m.group(1)), span * 1000, exposed * 1000, step * 1000, saving * 1000)
    others = [replace(s, exposed_us=0.0)] * int(m.group(6))  # less exposed ranks before the one shown
    assert format_step_line(s.step, [*others, s]) == example
    assert f"({m.group(4)}%): the exposed share of the reduction" in help_text
