"""The two opt-in flags of the ``compile`` section, validated strictly.

Why strict: DeepSpeed's config models coerce and even drop values (``"auto"`` is silently removed, pydantic
turns ``"yes"`` and ``1`` into ``True``). A flag that decides which collective every gradient takes must mean
exactly what the user wrote, so only JSON booleans are accepted and every error names ``compile.<key>``.
Pure: no torch.distributed, no DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .wording import ranks_phrase

SECTION = "compile"
REDUCE_TO_OWNER = "reduce_to_owner"
REDUCE_PROBE = "reduce_probe"
FLAG_KEYS: tuple[str, ...] = (REDUCE_TO_OWNER, REDUCE_PROBE)


class OwnerReduceConfigError(ValueError):
    """A DeepSpeed config value owner_reduce cannot accept; the message names the key."""


@dataclass(frozen=True)
class OwnerReduceFlags:
    """What the user asked for; both default to off, which leaves DeepSpeed untouched."""

    reduce_to_owner: bool = False
    reduce_probe: bool = False

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
    values = {key: _check_bool(key, compile_section[key]) for key in FLAG_KEYS if key in compile_section}
    return OwnerReduceFlags(**values)


def flags_of(compile_config: Any) -> OwnerReduceFlags:
    """The flags carried by a built ``CompileConfig`` (plain DeepSpeed configs carry none: both off)."""
    return OwnerReduceFlags(**{key: bool(getattr(compile_config, key, False)) for key in FLAG_KEYS})


def inapplicable_flags(top_level: Mapping[str, Any], flags: OwnerReduceFlags, deepcompile: bool,
                       zero_stage: int) -> tuple[str, ...]:
    """Why each flag the user wrote cannot take effect, one sentence per cause (empty when all can).

    Why: a flag that silently does nothing is worse than no flag; the user believes the owner path runs.
    ``top_level`` is the whole DeepSpeed config (DeepSpeed ignores unknown top-level keys); ``flags``,
    ``deepcompile`` and ``zero_stage`` are what DeepSpeed parsed from it.
    """
    reasons = [f"owner_reduce: '{key}' at the top level of the DeepSpeed config has no effect (DeepSpeed ignores "
               f"unknown top-level keys); it belongs under 'compile': {SECTION}.{key}"
               for key in FLAG_KEYS if key in top_level]
    keys_on = [f"{SECTION}.{key}" for key, value in flags.as_dict().items() if value]
    if not keys_on:
        return tuple(reasons)
    on = f"{' and '.join(keys_on)} {'has' if len(keys_on) == 1 else 'have'}"
    if not deepcompile:
        reasons.append(f"owner_reduce: {on} no effect: {SECTION}.deepcompile is false, so DeepCompile does not "
                       "run and ZeRO reduces through its own hooks (set compile.deepcompile true and call "
                       "engine.compile())")
    elif zero_stage == 0:
        reasons.append(f"owner_reduce: {on} no effect: zero_optimization.stage is 0, where DeepCompile falls back "
                       "to the torch compiler and no gradient has one owner (use ZeRO stage 1 or 2)")
    elif zero_stage == 3:
        reasons.append(f"owner_reduce: {on} no effect: zero_optimization.stage is 3, where DeepCompile runs its "
                       "own native stage-3 runtime (owner_reduce supports ZeRO stages 1 and 2)")
    return tuple(reasons)


def pack_flags(flags: OwnerReduceFlags) -> int:
    """The flags as one integer (bit i: ``FLAG_KEYS[i]``), for the agreement all_gather at init."""
    return sum(int(getattr(flags, key)) << i for i, key in enumerate(FLAG_KEYS))


def describe_flag_disagreement(packed_by_rank: Sequence[int]) -> list[str]:
    """One sentence per flag whose value differs across ranks, naming every rank's value in words:
    ``compile.reduce_probe differs across ranks: true on rank 0, false on rank 1``."""
    sentences = []
    for i, key in enumerate(FLAG_KEYS):
        ranks_by_value: dict[bool, list[int]] = {True: [], False: []}
        for rank, packed in enumerate(packed_by_rank):
            ranks_by_value[bool(packed >> i & 1)].append(rank)
        if ranks_by_value[True] and ranks_by_value[False]:
            parts = [f"{str(value).lower()} on {ranks_phrase(ranks)}"
                     for value, ranks in sorted(ranks_by_value.items(), key=lambda item: item[1][0])]
            sentences.append(f"{SECTION}.{key} differs across ranks: {', '.join(parts)}")
    return sentences
