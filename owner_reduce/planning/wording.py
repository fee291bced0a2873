"""Counts in words: ``1 flush``, ``2 flushes``. Pure.

Why a helper: user-facing lines are read and grepped; "1 straddling gradients" reads as a bug and hides the
real ones.
"""

from __future__ import annotations

from collections.abc import Sequence


def count_noun(n: int, singular: str, plural: str | None = None) -> str:
    """``n`` followed by the noun in the form ``n`` takes (``plural`` defaults to ``singular + "s"``)."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 1, 4``: the ranks an error names."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
