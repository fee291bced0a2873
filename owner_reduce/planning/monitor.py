"""What owner_reduce writes to DeepSpeed's monitor (TensorBoard, wandb, CSV, comet): every ``steps_per_print`` steps,
the step's reduction span, its exposed part and the bytes the owner path kept from this rank, each as the minimum,
median and maximum over ranks. Pure: every rank's row in, the monitor's events out.

Why min / median / max: one rank's number hides the others at 512 ranks, and the slowest rank sets the step (the
probe's step lines name the most exposed rank, for steps 2 to 7 only); Megatron's timers report min and max over ranks
for the same reason. The median says what a typical rank sees, the spread where stragglers are.

The metrics, per rank and per measured step (``runtime.monitor``):
- ``reduction_span_ms``: from the step's first flush start to its reduction's end (``planning.exposure`` Note
  (marks));
- ``exposed_ms``: the part of it after the backward's compute ended, which the step waits for;
- ``bytes_saved``: the reduced bytes native's AllReduce would have delivered to this rank and this step's flushes did
  not (their elements reduced to another rank only): 0 on the AllReduce path and in the measured guard's native
  steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

# DeepSpeed's own events are named ``Train/Samples/<what>`` and written at the step's global sample count; the CSV
# monitor names its file after the whole name (``/`` -> ``_``) and its column after the last part.
EVENT_PREFIX = "Train/Samples/owner_reduce/"
METRICS: tuple[tuple[str, float], ...] = (("reduction_span_ms", 1e-6), ("exposed_ms", 1e-6), ("bytes_saved", 1.0))
STATS: tuple[str, ...] = ("min", "median", "max")
UNMEASURED = -1  # a row's time where this rank's marks had not completed when read (never waited for)


def event_names() -> list[str]:
    """Every event name written, in order: each metric's min, median and max."""
    return [f"{EVENT_PREFIX}{name}_{stat}" for name, _ in METRICS for stat in STATS]


def pack_row(span_us: float | None, exposed_us: float | None, saved_bytes: int) -> list[int]:
    """One rank's measured step as integers (the gather carries integers): nanoseconds, ``UNMEASURED`` where None."""
    def ns(us: float | None) -> int:
        return UNMEASURED if us is None else round(us * 1000)

    return [ns(span_us), ns(exposed_us), int(saved_bytes)]


def monitor_events(rows: Sequence[Sequence[int]], x: int) -> list[tuple[str, float, int]]:
    """The events of one measured step from every rank's ``pack_row``, at ``x`` (the monitor's step axis): each
    metric's min, median and max over the ranks that measured it (a metric no rank measured is left out)."""
    events: list[tuple[str, float, int]] = []
    for i, (name, scale) in enumerate(METRICS):
        values = [row[i] for row in rows if row[i] != UNMEASURED]
        if not values:
            continue
        for stat, value in zip(STATS, (min(values), statistics.median(values), max(values)), strict=True):
            events.append((f"{EVENT_PREFIX}{name}_{stat}", value * scale, x))
    return events


def due(steps_done: int, every: int) -> bool:
    """Whether the step a backward completes (``steps_done + 1``, as DeepSpeed counts ``global_steps``) is written:
    every ``every``-th, as DeepSpeed prints every ``steps_per_print``-th."""
    return every > 0 and (steps_done + 1) % every == 0


__all__ = ["EVENT_PREFIX", "METRICS", "STATS", "UNMEASURED", "due", "event_names", "monitor_events", "pack_row"]
