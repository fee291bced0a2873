"""The two opt-in flags of the ``compile`` section, validated strictly.

Why strict: DeepSpeed's config models coerce and even drop values (``"auto"`` is silently removed, pydantic
turns ``"yes"`` and ``1`` into ``True``). A flag that decides which collective every gradient takes must mean
exactly what the user wrote, so only JSON booleans are accepted and every error names ``compile.<key>``.
Pure: no torch.distributed, no DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

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
