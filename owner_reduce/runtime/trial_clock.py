"""Where the measured guard's samples come from: the runtime's streams, or a table of fixed samples.

Why a seam: the product times each trial flush where its work runs (``trial`` Note (timing)): the host clock on the
CPU, CUDA events on the GPU, both read through the streams (``streams.HostStreams`` / ``CudaStreams``: ``mark`` and
``elapsed_us``). A test whose verdict came from those clocks would be decided by the machine's load (one
descheduling pause on a busy 2-core host flips it); a test hands the runtime fixed samples instead
(``runtime.trial_clock = harness.fixed_samples.FixedSamples(...)``), so that ties, noise, an outlier or a slow rank
are what the test says and the verdict follows from the rule alone. Everything else (which flushes are timed, the
marks, the agreement collective, the winners) runs as in the product.

A clock is asked once per timed flush (or step timed as a whole), after ``end_backward``'s wait, with the
``SamplePoint`` it is a sample of: the same on every rank, and in a run resumed in the middle of a trial the same
as in the run that saved it (``round`` counts the samples the resumed trial already holds).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class SamplePoint(NamedTuple):
    """One sample of a trial: the trial flush (its index in the trial, 0 for a step timed as a whole), the variant
    (``measured.MODEL`` or ``NATIVE_VARIANT``) and its round (the sample's number among that flush's samples of that
    variant, from 0); ``key``: the schedule's key (``verdict_book`` Note (key))."""

    key: str
    flush: int
    variant: int
    round: int


class TrialClock(Protocol):
    def sample_us(self, point: SamplePoint, streams: Any, start: Any, end: Any) -> float:
        """The sample, in microseconds, of ``point`` whose work lies between the marks ``start`` and ``end``."""


class StreamClock:
    """The product's clock: the time between a timed flush's two marks on the streams that ran it."""

    @staticmethod
    def sample_us(point: SamplePoint, streams: Any, start: Any, end: Any) -> float:
        return streams.elapsed_us(start, end)
