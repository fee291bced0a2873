"""Fixed samples for the measured guard (``runtime.trial_clock``): the tests' and the harness's clock, so that a
verdict is decided by the samples a test chose, never by the machine's load. Never used by the product."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from owner_reduce.planning.measured import MODEL, NATIVE_VARIANT
from owner_reduce.runtime.trial_clock import SamplePoint


class FixedSamples:
    """A test's clock: each sample from ``table[(flush, variant, round)]`` (us), whatever the streams measured. A point
    the table lacks raises a KeyError naming it: a test that forgot a sample fails, it never falls back to time."""

    def __init__(self, table: Mapping[tuple[int, int, int], float]) -> None:
        self.table = dict(table)
        self.asked: list[SamplePoint] = []  # every point asked, in order (tests read it)

    def sample_us(self, point: SamplePoint, streams: Any, start: Any, end: Any) -> float:
        self.asked.append(point)
        at = (point.flush, point.variant, point.round)
        if at not in self.table:
            raise KeyError(f"FixedSamples: no sample for trial flush {point.flush}, "
                           f"{'the model' if point.variant == MODEL else 'native'}, round {point.round} "
                           f"(schedule {point.key})")
        return float(self.table[at])

    @classmethod
    def per_flush(cls, flushes: list[tuple[list[float], list[float]]]) -> FixedSamples:
        """From (model samples by round, native samples by round) per trial flush, in trial order."""
        return cls({(i, variant, k): us for i, pair in enumerate(flushes)
                    for variant, samples in ((MODEL, pair[0]), (NATIVE_VARIANT, pair[1]))
                    for k, us in enumerate(samples)})
