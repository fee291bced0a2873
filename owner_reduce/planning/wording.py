"""Counts and rank lists in words: ``1 flush``, ``2 flushes``, ``ranks 0-255, 257-511``. Pure.

Why a helper: user-facing lines are read and grepped; "1 straddling gradients" reads as a bug and hides the
real ones. And a message about 512 ranks must stay a line: every list of ranks is folded into ranges and capped
(``RANGES_SHOWN``), and every per-rank listing of values is grouped by value (``GROUPS_SHOWN``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

RANGES_SHOWN = 8  # ranges (or single ranks) a rank list names before "and N more"
GROUPS_SHOWN = 4  # distinct values a per-rank listing names before "and N other values"


def count_noun(n: int, singular: str, plural: str | None = None) -> str:
    """``n`` followed by the noun in the form ``n`` takes (``plural`` defaults to ``singular + "s"``)."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def _runs(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct ranks as (first, last) runs of consecutive ranks."""
    runs: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return runs


def rank_ranges(ranks: Iterable[int], shown: int = RANGES_SHOWN) -> str:
    """``0-255, 257-511``: the ranks sorted, runs of three or more folded into ``first-last``, a pair written as two
    ranks; past ``shown`` items, ``and N more`` (N ranks)."""
    items: list[tuple[str, int]] = []  # (text, ranks it covers)
    for first, last in _runs(ranks):
        if last - first >= 2:
            items.append((f"{first}-{last}", last - first + 1))
        else:
            items.extend((str(r), 1) for r in range(first, last + 1))
    text = ", ".join(t for t, _ in items[:shown])
    rest = sum(n for _, n in items[shown:])
    return text + (f" and {rest} more" if rest else "")


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 1, 4`` or ``ranks 0-255, 257-511``: the ranks a message names (folded and capped)."""
    return f"rank{'s' if len(set(ranks)) > 1 else ''} {rank_ranges(ranks)}"


def by_value(values: Sequence[T], show: Callable[[T], str] = str, shown: int = GROUPS_SHOWN) -> str:
    """Every rank's value (``values[r]`` is rank r's) grouped by value, in the order of each value's first rank:
    ``auto on ranks 0-2, reduce on rank 3``; past ``shown`` values, ``and N other values on ranks ...``."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(show(value), []).append(rank)
    text = ", ".join(f"{text} on {ranks_phrase(ranks)}" for text, ranks in list(groups.items())[:shown])
    others = [r for ranks in list(groups.values())[shown:] for r in ranks]
    if others:
        text += f" and {count_noun(len(groups) - shown, 'other value')} on {ranks_phrase(others)}"
    return text


def by_reason(reasons: Sequence[str | None]) -> list[str]:
    """``ranks 0-3: the reason`` for each distinct reason (None: that rank has none), in the order of each reason's
    first rank; at most ``GROUPS_SHOWN`` reasons, then how many other reasons on which ranks."""
    groups: dict[str, list[int]] = {}
    for rank, reason in enumerate(reasons):
        if reason:
            groups.setdefault(reason, []).append(rank)
    items = list(groups.items())
    parts = [f"{ranks_phrase(ranks)}: {reason}" for reason, ranks in items[:GROUPS_SHOWN]]
    others = [r for _, ranks in items[GROUPS_SHOWN:] for r in ranks]
    if others:
        parts.append(f"{ranks_phrase(others)}: {count_noun(len(items) - GROUPS_SHOWN, 'other reason')}")
    return parts
