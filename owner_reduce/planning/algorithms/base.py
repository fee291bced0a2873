"""What an algorithm is (``Algorithm``): a name, its cost for one flush, its layout; the registry (the package's
``__init__``) holds the registered ones in tie order.

Why a module of its own: each algorithm module and the registry import it, and nothing else of the package, so the
algorithm modules import no registry and the registry imports them without a cycle. Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..flush_layout import CostModel, FlushFacts, OwnerLayout
    from ..step_plan import FlushTimes


@dataclass(frozen=True)
class Estimate:
    """One algorithm's modelled time for one flush alone: ``us`` its host issue then its device time, ``issue_us`` the
    host's part, ``calls`` the calls it issues (ties go to the fewest: ``flush_choice.choose``), ``detail`` what its
    layout needs from the costing (the hand-off's transfers, the cut of the Reduces, the two-level pipelines)."""

    us: float
    issue_us: float
    calls: int
    detail: Any = None


@dataclass(frozen=True)
class Pipeline:
    """An algorithm whose flush runs as one of several pipelines the step's plan picks among (``step_plan``: a
    pipeline's stages overlap the next flush's): ``options(estimate)`` its pipelines for the flush, ``times(facts,
    option)`` one as the schedule sees it, ``recost(facts, option, cost)`` one costed under another model (the
    sizing's sensitivity; None where that model cannot run it)."""

    options: Callable[[Estimate], tuple[Any, ...]]
    times: Callable[[FlushFacts, Any], FlushTimes]
    recost: Callable[[FlushFacts, Any, CostModel], Any]


@dataclass(frozen=True)
class Algorithm:
    """A flush algorithm (``docs/design.md`` "Adding an algorithm").

    ``cost(facts)``: its ``Estimate`` for the flush, or None where it does not apply (the flush alone:
    ``owner_layout.analyse_flush``). ``layout(facts, estimate, option)``: the flush laid out for it, an
    ``OwnerLayout`` of its pieces' places, calls, padding and transfers (``option``: the pipeline, a ``pipeline``'s
    only); ``owner_layout.build_layout`` adds the choice and its modelled times. ``forceable``:
    ``compile.reduce_to_owner_algo`` may name it. ``calibrated``: a calibration file times every call it issues (the
    data-parallel communicator's only), so under a calibration it competes; otherwise it does only when forced.
    ``pipeline``: see ``Pipeline``; None for a flush issued as one or two groups."""

    name: str
    cost: Callable[[FlushFacts], Estimate | None]
    layout: Callable[[FlushFacts, Estimate, Any], OwnerLayout]
    forceable: bool = True
    calibrated: bool = True
    pipeline: Pipeline | None = None
