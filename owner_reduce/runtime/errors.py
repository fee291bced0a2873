"""The runtime's refusal at init, in a module of its own so that ``import owner_reduce`` can export it without
importing torch (``runtime.handle`` raises it; ``runtime.deadline`` holds ``OwnerReduceCommError``)."""

from __future__ import annotations


class OwnerReduceMismatchError(RuntimeError):
    """Ranks disagree on a setting, the bucket size or the owner map, or a rank cannot use what its config names;
    raised on every rank before any training collective."""
