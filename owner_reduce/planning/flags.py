"""The boolean keys of ``compile`` (the two opt-in flags and ``reduce_probe_all_ranks``), validated strictly.

Why strict: DeepSpeed's config models coerce and even drop values (``"auto"`` is silently removed, pydantic
turns ``"yes"`` and ``1`` into ``True``). A flag that decides which collective every gradient takes must mean
exactly what the user wrote, so only JSON booleans are accepted and every error names ``compile.<key>``.
Pure: no torch.distributed, no DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import OwnerReduceConfigError
from .wording import by_value

SECTION = "compile"
REDUCE_TO_OWNER = "reduce_to_owner"
REDUCE_PROBE = "reduce_probe"
PROBE_ALL_RANKS = "reduce_probe_all_ranks"
FLAG_KEYS: tuple[str, ...] = (REDUCE_TO_OWNER, REDUCE_PROBE)  # the two that turn owner_reduce on
BOOL_KEYS: tuple[str, ...] = (*FLAG_KEYS, PROBE_ALL_RANKS)  # every boolean key (``OwnerReduceFlags``' fields)


@dataclass(frozen=True)
class OwnerReduceFlags:
    """What the user asked for; the two flags default to off, which leaves DeepSpeed untouched.
    ``reduce_probe_all_ranks``: the probe's lines from every rank, not rank 0's only (no effect without the probe)."""

    reduce_to_owner: bool = False
    reduce_probe: bool = False
    reduce_probe_all_ranks: bool = False

    @property
    def any_on(self) -> bool:
        return self.reduce_to_owner or self.reduce_probe

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


def _check_bool(key: str, value: Any) -> bool:
    # bool is checked by exact type: 0/1, "true", None and numpy bools are all rejected on purpose.
    if type(value) is not bool:
        raise OwnerReduceConfigError(
            f"DeepSpeed config: {SECTION}.{key} must be true or false (a JSON boolean), "
            f"got {value!r} ({type(value).__name__})")
    return value


def parse_flags(compile_section: Mapping[str, Any] | None) -> OwnerReduceFlags:
    """Read the flags from a raw ``compile`` dict; absent keys take their defaults."""
    if compile_section is None:
        return OwnerReduceFlags()
    if not isinstance(compile_section, Mapping):
        raise OwnerReduceConfigError(
            f"DeepSpeed config: {SECTION} must be a mapping, got {type(compile_section).__name__}")
    values = {key: _check_bool(key, compile_section[key]) for key in BOOL_KEYS if key in compile_section}
    return OwnerReduceFlags(**values)


def pack_flags(flags: OwnerReduceFlags) -> int:
    """The flags as one integer (bit i: ``BOOL_KEYS[i]``), for the agreement all_gather at init."""
    return sum(int(getattr(flags, key)) << i for i, key in enumerate(BOOL_KEYS))


def describe_flag_disagreement(packed_by_rank: Sequence[int]) -> list[str]:
    """One sentence per flag whose value differs across ranks, naming every rank's value in words, ranks folded:
    ``compile.reduce_probe differs across ranks: true on ranks 0-2, false on rank 3``."""
    sentences = []
    for i, key in enumerate(BOOL_KEYS):
        values = [bool(packed >> i & 1) for packed in packed_by_rank]
        if len(set(values)) > 1:
            sentences.append(f"{SECTION}.{key} differs across ranks: "
                             + by_value(values, lambda v: str(v).lower()))
    return sentences
