"""The flush algorithms, one module each, and their registry: every list of algorithms is derived from it.

Why a registry: the cost-based choice (``flush_choice``), the layout (``owner_layout``), the step's plan, the
settings' allowed values (``settings.ALGO_VALUES``) and the sizing used to list the algorithms each on its own, so an
algorithm built from existing calls touched several of them. Now an algorithm is one module (its ``cost`` and its
``layout``: ``base.Algorithm``) and one ``register`` line below; nothing else names it.

Registration order is tie order: two algorithms modelled equally fast go to the one with fewer calls, then to the one
registered first (``flush_choice.choose``). Which ones ``compile.reduce_to_owner_algo`` may force is each one's
``forceable``. Pure: no torch.
"""

from __future__ import annotations

from ...errors import UnknownAlgorithmError
from . import allreduce, handoff, native, reduce, reduce_scatter, two_level
from .base import Algorithm, Estimate, Pipeline

__all__ = ["Algorithm", "Estimate", "Pipeline", "UnknownAlgorithmError", "forceable", "get", "names", "register",
           "registered", "tie_rank", "unregister"]




_REGISTRY: dict[str, Algorithm] = {}
_ORDER: tuple[str, ...] = ()  # names in tie order, and each one's place in it: rebuilt at each (un)registration
_RANK: dict[str, int] = {}


def _reindex() -> None:
    global _ORDER, _RANK
    _ORDER = tuple(_REGISTRY)
    _RANK = {name: i for i, name in enumerate(_ORDER)}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` after those registered (it loses ties to them); a name registered already is refused."""
    if algorithm.name in _REGISTRY:
        raise ValueError(f"owner_reduce: a flush algorithm {algorithm.name!r} is registered already")
    _REGISTRY[algorithm.name] = algorithm
    _reindex()
    return algorithm


def unregister(name: str) -> Algorithm:
    """Remove an algorithm (a test's, after it ran)."""
    algorithm = get(name)
    del _REGISTRY[name]
    _reindex()
    return algorithm


def get(name: str) -> Algorithm:
    algorithm = _REGISTRY.get(name)
    if algorithm is None:
        raise UnknownAlgorithmError(name, _ORDER)
    return algorithm


def registered() -> tuple[Algorithm, ...]:
    """Every algorithm, in tie order."""
    return tuple(_REGISTRY.values())


def names() -> tuple[str, ...]:
    """Every algorithm's name, in tie order."""
    return _ORDER


def tie_rank(name: str) -> int:
    """``name``'s place in tie order (lower wins a tie)."""
    return _RANK[name]


def forceable() -> tuple[str, ...]:
    """The algorithms ``compile.reduce_to_owner_algo`` may name, in tie order."""
    return tuple(name for name, algorithm in _REGISTRY.items() if algorithm.forceable)


# One line per algorithm, in tie order (fewest calls first).
register(reduce_scatter.ALGORITHM)
register(reduce.ALGORITHM)
register(allreduce.ALGORITHM)
register(handoff.ALGORITHM)
register(native.ALGORITHM)
register(two_level.ALGORITHM)
