"""The probe's step summary: how much of a step's gradient reduction the backward did not hide, and what the owner
path's model says it would save of that. Pure: marks in, numbers and text out.

Why: the owner path saves bytes, but a user saves time only where the step waits for the reduction. A probe-only
run (``reduce_probe`` without ``reduce_to_owner``) measures that wait on the user's own model and cluster, and this
module turns it into one line per step that says how much of it the owner path could remove.

Note (marks): per step, each rank takes four kinds of marks (``runtime.exposure``), all on one clock:

- ``start``: the previous step's reduction end (below); the step runs from there to this step's end;
- ``first_start``: where the step's first flush starts (GPU: an event on the stream its work starts on, enqueued
  after that stream's wait for the compute stream, so it fires once the bucket's copies are done and the stream is
  free; CPU: the host clock before the flush's first call);
- ``compute_end``: where the backward's compute has nothing left to run (GPU: an event on the compute stream, recorded
  when ``end_backward`` is called, before it flushes what is left and waits; CPU: the host clock when ``end_backward``
  is called, or the start of the flush issued last where that flush ran before ``end_backward``: on the host every
  flush runs inside the backward's thread, so the flush that takes the last gradient is the backward's tail);
- ``end``: what ``end_backward`` waits for: an event on the reduce stream after it joined the node and rail streams
  (GPU), the host clock after the last flush returned (CPU); and each flush's own end (its bucket's free event).

From them: the step's reduction (its ``span``) runs from ``first_start`` to ``end``; its exposed part from
``max(compute_end, first_start)`` to ``end`` (zero where the reduction ended first); the step from ``start`` to
``end``. So ``exposed <= span <= step`` by construction: every mark of a step comes after its ``start``, which the host
waited for before the step's work was issued.

Note (the model's saving): the exposed part is cut into the pieces that end with each flush (the last flush's piece
from the end of the flush before it, or from ``compute_end``, to ``end``; and so on back to the first flush that
ended after ``compute_end``). Each piece is scaled by ``1 - r`` where ``r`` is the cost model's time for the owner
path's choice for that flush's gradients over its time for what ran (``flush_choice``, ``owner_layout``): the owner
path's flush is that much shorter, so the exposed tail shrinks by at least that much while the flushes before it
are no later. It is a model's number on the model's cluster, printed as modelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .flush_choice import AUTO, FlushCost, choose
from .owner_layout import analyse_flush
from .owner_map import OwnerMap
from .wording import count_noun

PROBE_STEPS = 6  # steps summarised: the 2nd to the 7th that reduced (the 1st has no step end before it)
PREFIX = "[dc-probe][r0]"  # the summary is rank 0's: it already takes every rank's numbers

# How a step's flushes ran (the line's last part; the code travels in the gathered rows).
MODELLED, OWNER, NATIVE_TRIAL, ARRIVAL = 0, 1, 2, 3
_HOW = {OWNER: "measured on the owner path",
        NATIVE_TRIAL: "measured on native's calls (the measured guard's trial step)",
        ARRIVAL: "measured in arrival order (no schedule followed in this step)"}
_FIELDS = 5  # per step in a gathered row: span, exposed, step (ns), saving (ns, -1: none), how; all -1: unmeasured


@dataclass(frozen=True)
class StepExposure:
    """One rank's step: its reduction, the exposed part of it, the step (microseconds), the model's saving of the
    exposed part (owner path off; None where the step ran the owner path: measured), and how its flushes ran."""

    step: int
    span_us: float
    exposed_us: float
    step_us: float
    saving_us: float | None = None
    how: int = MODELLED

    @property
    def exposed_share(self) -> float:
        return self.exposed_us / self.span_us if self.span_us > 0 else 0.0


def exposed_from(first_start: float, compute_end: float) -> float:
    """Where the exposed part begins: the backward's compute end, or the first flush's start if that came later."""
    return max(compute_end, first_start)


def measure_step(start: float, first_start: float, compute_end: float, end: float) -> tuple[float, float, float]:
    """(span, exposed, step) of one step from its marks (any unit, one clock): see Note (marks)."""
    span = max(0.0, end - first_start)
    exposed = min(span, max(0.0, end - exposed_from(first_start, compute_end)))
    return span, exposed, end - start


def exposed_parts(exposed_start: float, end: float, earlier_ends: Iterable[float]) -> tuple[float, ...]:
    """The exposed part cut by flush, from the last flush back (see Note (the model's saving)). ``earlier_ends``: the
    ends of every flush but the last, the latest first; it is read only as far as needed (on a GPU each end is an
    event read), up to the first flush that ended before ``exposed_start``. Empty where nothing is exposed."""
    if end <= exposed_start:
        return ()
    parts = []
    upper = end
    for earlier in earlier_ends:
        parts.append(max(0.0, upper - max(exposed_start, earlier)))
        if earlier <= exposed_start:
            return tuple(parts)
        upper = min(upper, earlier)
    parts.append(max(0.0, upper - exposed_start))  # the first flush of the step: nothing before it
    return tuple(parts)


def owner_ratio(owner_us: float, ran_us: float) -> float:
    """The model's time for the owner path's choice over its time for what ran, in [0, 1] (never a loss: the choice
    includes one AllReduce of the flush, and native's calls); 1 where the model has nothing to say."""
    if ran_us <= 0:
        return 1.0
    return min(1.0, max(0.0, owner_us / ran_us))


def owner_path_us(grads: Sequence[tuple[int, int]], owner_map: OwnerMap, cost: FlushCost, *, capacity: int,
                  order: dict[int, int] | None = None) -> float:
    """The model's time for the owner path's choice for one flush of ``grads`` ((param_id, numel) in arrival order)
    costed alone (``owner_layout.analyse_flush``; the cost model's own choice, whatever algorithm was forced)."""
    analysis = analyse_flush(grads, owner_map, True, capacity=capacity, order=order, cost=replace(cost, force=AUTO))
    return analysis.costs[choose(analysis.costs, AUTO, analysis.calls)]


def modelled_saving(parts: Sequence[float], ratios: Sequence[float]) -> float:
    """The model's saving of the exposed part: each flush's piece times ``1 - r`` (both from the last flush back)."""
    return sum(part * (1.0 - ratio) for part, ratio in zip(parts, ratios, strict=True))


# ---- every rank's numbers, in one gather -------------------------------------------------------------------------

def pack_row(samples: Sequence[StepExposure | None], steps: int = PROBE_STEPS) -> list[int]:
    """This rank's row for the one gather of the probe's steps: per step span, exposed, step and saving in ns and how
    the flushes ran; a step this rank could not measure (its events had not completed) as -1s."""
    if len(samples) != steps:
        raise ValueError(f"owner_reduce: {len(samples)} probe steps recorded, expected {steps}")
    row = [steps]
    for s in samples:
        if s is None:
            row += [-1] * _FIELDS
        else:
            row += [round(s.span_us * 1000), round(s.exposed_us * 1000), round(s.step_us * 1000),
                    -1 if s.saving_us is None else round(s.saving_us * 1000), s.how]
    return row


def unpack_rows(rows: Sequence[Sequence[int]], first_step: int = 2) -> list[list[StepExposure | None]]:
    """Every rank's ``pack_row`` -> per step, every rank's ``StepExposure`` (None: not measured there)."""
    if len({len(r) for r in rows}) != 1 or any(not r or len(r) != 1 + _FIELDS * r[0] for r in rows):
        raise RuntimeError(f"owner_reduce: ranks recorded different probe steps: rows {list(rows)}")
    steps = rows[0][0]
    out: list[list[StepExposure | None]] = []
    for k in range(steps):
        at = 1 + _FIELDS * k
        per_rank: list[StepExposure | None] = []
        for row in rows:
            span, exposed, step, saving, how = row[at:at + _FIELDS]
            per_rank.append(None if span < 0 else StepExposure(first_step + k, span / 1000, exposed / 1000,
                                                               step / 1000, None if saving < 0 else saving / 1000,
                                                               how))
        out.append(per_rank)
    return out


def slowest(per_rank: Sequence[StepExposure | None]) -> tuple[int, StepExposure] | None:
    """The rank whose step was the most exposed (what the step waits for: the others wait at the next collective),
    and its numbers; None where no rank measured the step. Ties go to the lowest rank."""
    measured = [(r, s) for r, s in enumerate(per_rank) if s is not None]
    if not measured:
        return None
    return max(measured, key=lambda rs: (rs[1].exposed_us, -rs[0]))


# ---- the line ------------------------------------------------------------------------------------------------------

def _ms(us: float) -> str:
    ms = us / 1000
    return f"{ms:.1f}" if ms >= 1 else f"{ms:.3f}"


def format_step_line(step: int, per_rank: Sequence[StepExposure | None]) -> str:
    """Rank 0's line for one probe step, from every rank's numbers, e.g. ``[dc-probe][r0] step 3: reduction 41.2 ms,
    exposed 12.7 ms (31%) of a 180.4 ms step (most exposed: rank 2); the owner path saves up to 5.9 ms of it
    (modelled)``. The numbers are the most exposed rank's; the share is of its reduction."""
    picked = slowest(per_rank)
    if picked is None:
        return (f"{PREFIX} step {step}: not measured (no rank's marks had completed a step later; the probe never "
                f"waits for them)")
    rank, s = picked
    missing = sum(x is None for x in per_rank)
    line = (f"{PREFIX} step {step}: reduction {_ms(s.span_us)} ms, exposed {_ms(s.exposed_us)} ms "
            f"({100 * s.exposed_share:.0f}%) of a {_ms(s.step_us)} ms step (most exposed: rank {rank}"
            + (f", {count_noun(missing, 'rank', 'ranks')} not measured" if missing else "") + ")")
    if s.how == MODELLED:
        saving = s.saving_us if s.saving_us is not None else 0.0
        return line + f"; the owner path saves up to {_ms(saving)} ms of it (modelled)"
    return line + "; " + _HOW.get(s.how, "measured")
