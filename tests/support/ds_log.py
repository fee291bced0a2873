"""What DeepSpeed's logger emits, captured in this process: owner_reduce logs through it (``runtime.stats.emit``),
and the logger does not propagate to the root logger, so pytest's ``caplog`` and ``capsys`` miss it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class Captured:
    """The messages (without DeepSpeed's time and place prefix) and levels the logger let through."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str]] = []

    @property
    def lines(self) -> list[str]:
        return [message for _, message in self.records]

    def at(self, level: int) -> list[str]:
        return [message for lvl, message in self.records if lvl == level]

    def text(self) -> str:
        return "\n".join(self.lines)


@contextlib.contextmanager
def ds_log(level: int | None = logging.INFO) -> Iterator[Captured]:
    """Capture DeepSpeed's logger; ``level`` (INFO by default: owner_reduce's lines) is set on it meanwhile, None
    keeps the logger's own (DeepSpeed's default is WARNING)."""
    from deepspeed.utils import logger

    captured = Captured()
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = lambda record: captured.records.append((record.levelno, record.getMessage()))  # type: ignore
    before = logger.level
    if level is not None:
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield captured
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
