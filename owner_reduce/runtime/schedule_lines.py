"""Rank 0's schedule lines: once per graph, when it first learns its owner-ordered schedule, what each flush will
run and what the cost model says it saves against native; the graphs' numbers in these lines.

Why numbers, not graph ids: DeepCompile names a graph by a memory address (the handle's Note (graph ids)), which
differs from rank to rank and run to run; a user compares runs by ``graph #1``, ``#2`` in the order graphs first
learn a schedule, from 1 again after a reset. The measured guard's lines name graphs by the same numbers (``guard``).
"""

from __future__ import annotations

from ..planning.calibration import Calibration
from ..planning.flush_choice import FlushCost
from ..planning.settings import ALGO, key_name
from ..planning.step_plan import FlushTimes, native_step_us
from ..planning.wording import count_noun
from .schedule import Schedule

SCHEDULE_PREFIX = "[dc-schedule][r0]"  # rank 0's line when a graph's owner-ordered schedule is learned


class GraphNumbers:
    """graph id -> its number in the schedule lines (1, 2, ...); numbers are never reused before ``clear`` (a
    reset), and a registration forgets its graph id's (``forget``)."""

    def __init__(self) -> None:
        self._numbers: dict[int, int] = {}
        self._given = 0  # schedule lines printed since the last reset

    def __contains__(self, graph_id: int) -> bool:
        return graph_id in self._numbers

    def get(self, graph_id: int) -> int | None:
        return self._numbers.get(graph_id)

    def assign(self, graph_id: int) -> int:
        """The next number, now ``graph_id``'s."""
        self._given += 1
        self._numbers[graph_id] = self._given
        return self._given

    def forget(self, graph_id: int) -> None:
        self._numbers.pop(graph_id, None)

    def clear(self) -> None:
        self._numbers.clear()
        self._given = 0


def schedule_line(number: int, schedule: Schedule, cost: FlushCost, algo: str, guard_plan: str
                  ) -> tuple[str, str | None]:
    """Graph ``number``'s line, in about 30 words, and the DEBUG line after it (None without a cost model), e.g.
    ``[dc-schedule][r0] graph #1: 3 flushes per backward: reduce_scatter+handoff x2, allreduce x1; modelled 0.41x
    native (1.234 vs 3.010 ms); measuring 2 flushes against native's calls over the next 6 steps``: the DEBUG line
    says what the model was (NCCL's tables of a named topology, or a calibration). ``algo``: the value of
    ``compile.reduce_to_owner_algo``; ``guard_plan``: what the measured guard does with it (``guard.plan``)."""
    flushes = [f for per_dtype in schedule.flushes.values() for f in per_dtype]
    choices: dict[str, int] = {}
    for f in flushes:
        choices[f.layout.algo] = choices.get(f.layout.algo, 0) + 1
    line = (f"{SCHEDULE_PREFIX} graph #{number}: {count_noun(len(flushes), 'flush', 'flushes')} per backward: "
            + ", ".join(f"{a} x{n}" for a, n in choices.items()))
    if cost.topology is None:
        return line, None
    chosen = schedule.modelled_us or sum(f.layout.modelled_us for f in flushes)
    native = native_step_us([FlushTimes(world_us=device, issue_us=(host,)) for device, host in (
        cost.for_dtype_bytes(f.dtype.itemsize).native_parts(f.numels) for f in flushes)])
    ratio = chosen / native if native else 1.0
    calibrated = isinstance(cost.calibration, Calibration)
    basis = (f"call times of calibration {cost.calibration.digest()}" if calibrated
             else f"alpha-beta model of {cost.topology.name}")
    line += f"; modelled {ratio:.2f}x native ({chosen / 1000:.3f} vs {native / 1000:.3f} ms)"
    # What the settings line says already (the calibration, a forced algorithm), and the model's name: DEBUG.
    detail = (f"{SCHEDULE_PREFIX} graph #{number}: modelled on the {basis}, {key_name(ALGO)}={algo}; native is one "
              f"AllReduce per gradient in one group")
    if schedule.overlapped:
        line += "; flushes overlap"
    return line + guard_plan, detail
