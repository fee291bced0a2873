"""DeepSpeed's monitor at run time: every ``steps_per_print`` steps the runtime marks one backward, reads its marks
after that backward's own wait, and the ranks gather their rows in one small exchange; rank 0 writes the min / median /
max events (``planning.monitor`` has the metrics and the events).

Why it is wired here and not in DeepSpeed's engine: the engine writes its monitor events in ``step()``, but only the
runtime sees its flushes. ``wiring.activation`` hands the runtime a ``MonitorSink`` over the engine's monitor where the
DeepSpeed config enables one (``monitor_config.enabled``: tensorboard, wandb, csv_monitor or comet); every rank gets
it, so every rank takes the same branch and joins the exchange, and only rank 0 writes (DeepSpeed's monitors write on
rank 0 only).

Note (one exchange, none in between): nothing is marked, read or gathered in the steps between: the flush's hooks are
one ``None`` check, and ``start_backward`` one comparison. The measured step costs what a probe step costs (three
timing events and their records on a GPU; the bucket's free events made timing events meanwhile), a ``query`` per
mark after ``end_backward``'s wait (a mark not complete then leaves that rank's times out, never a wait), and one
``all_gather_ints`` of three integers on the data-parallel communicator, bounded by its deadline. The step to measure
is decided from the engine's ``global_steps``, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..planning.exposure import measure_step
from ..planning.monitor import pack_row
from .streams import HostStreams


@dataclass(frozen=True)
class MonitorSink:
    """Where and when the runtime writes: ``write`` is the engine's ``monitor.write_events`` (rank 0 writes),
    ``every`` its ``steps_per_print``, ``steps_done`` the optimizer steps the engine has taken (``global_steps``), ``x``
    the step axis of the events written at a measured step's end (DeepSpeed's: the global sample count after it)."""

    write: Callable[[list[tuple[str, float, int]]], Any]
    every: int
    steps_done: Callable[[], int]
    x: Callable[[], int]


class MonitorStep:
    """One backward's marks and bytes (``planning.exposure`` Note (marks)), from ``start_backward`` to the read after
    ``end_backward``'s wait. The flusher calls ``flush_started`` / ``flush_ended`` for each flush (as the probe's)."""

    __slots__ = ("_rank", "_streams", "first", "last_start", "compute", "end", "flushes", "flushed_before_end",
                 "saved_bytes")

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._streams: Any = None
        self.first: Any = None
        self.last_start: Any = None
        self.compute: Any = None
        self.end: Any = None
        self.flushes = 0
        self.flushed_before_end = 0
        self.saved_bytes = 0

    # ---- the flusher's hooks ------------------------------------------------------------------------------------

    def flush_started(self, streams: Any, level: str | None = None) -> None:
        if self.first is None:
            self.first = self.last_start = streams.mark(level)
        elif isinstance(streams, HostStreams):  # the wall clock: free; a GPU marks the first flush only
            self.last_start = streams.mark(level)

    def flush_ended(self, end: Any, pending: Any, cached: Any) -> None:
        self.flushes += 1
        plan = cached.plan
        self.saved_bytes += (plan.reduced_elems - plan.received_elems(self._rank)) * \
            pending.bucket.buffer.element_size()

    # ---- end_backward's hooks -----------------------------------------------------------------------------------

    def backward_ending(self, streams: Any) -> None:
        """``end_backward`` was called: the compute mark, before it flushes what is left."""
        if streams is None:
            return
        self._streams = streams
        self.compute = streams.compute_mark()
        self.flushed_before_end = self.flushes

    def backward_ended(self, streams: Any) -> None:
        """Every flush issued, before the wait: the reduction's end mark."""
        if streams is None or not self.flushes or self.compute is None:
            return
        self.end = streams.step_end_mark()
        if isinstance(streams, HostStreams) and self.flushes == self.flushed_before_end:
            # Every flush ran inside the backward's thread: the one issued last took its last gradient.
            self.compute = min(self.compute, self.last_start)

    def row(self) -> list[int]:
        """After ``end_backward``'s wait: this rank's ``planning.monitor.pack_row`` (times left out where a mark has
        not completed: never waited for)."""
        streams = self._streams
        if self.end is None or not (streams.completed(self.end) and streams.completed(self.compute)
                                    and streams.completed(self.first)):
            return pack_row(None, None, self.saved_bytes)
        at = streams.elapsed_us
        span, exposed, _ = measure_step(0.0, 0.0, at(self.first, self.compute), at(self.first, self.end))
        return pack_row(span, exposed, self.saved_bytes)


class FlushHooks:
    """Two sets of flush hooks at once (the probe's step summary and the monitor's step)."""

    __slots__ = ("_hooks",)

    def __init__(self, *hooks: Any) -> None:
        self._hooks = hooks

    def flush_started(self, streams: Any, level: str | None = None) -> None:
        for hook in self._hooks:
            hook.flush_started(streams, level)

    def flush_ended(self, end: Any, pending: Any, cached: Any) -> None:
        for hook in self._hooks:
            hook.flush_ended(end, pending, cached)
