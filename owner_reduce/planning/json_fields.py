"""Reading the package's JSON files (a calibration file, a verdict book): reading, parsing and type checks whose errors
name the kind of file, the file and the key (``calibration out/c.json: key 'fits.reduce' ...``).

Why one module: both files are written by one run and read by every rank of the next, by hand-edited copies too; a
bad one must fail the same way whichever it is, naming what to fix, before any rank waits on the others. Pure: no
torch.distributed, no cupy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


def read_text(path: str | Path, what: str) -> str:
    """The file's text; a ValueError names the kind of file (``what``), the path and why it cannot be read."""
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"owner_reduce: {what} {path}: cannot be read ({error.strerror or error})") from error


def parse_json(text: str, what: str, source: str) -> Any:
    """``text`` parsed; a ValueError names the kind of file and ``source`` where it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"owner_reduce: {what} {source}: not JSON ({error})") from error


class FieldCheck:
    """Type checks of one file's data, each returning the value it checked; an error names the kind of file
    (``what``), ``source`` and the key at fault. ``format``: the format's name, for a key that is not part of it."""

    def __init__(self, what: str, source: str, format: str) -> None:
        self.what, self.source, self.format = what, source, format

    def fail(self, key: str, what: str, got: Any) -> NoReturn:
        where = f"key '{key}'" if key else "the top level"
        raise ValueError(f"owner_reduce: {self.what} {self.source}: {where} {what}, got {got!r}")

    def missing(self, key: str) -> NoReturn:
        raise ValueError(f"owner_reduce: {self.what} {self.source}: key '{key}' is missing")

    def mapping(self, value: Any, key: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            self.fail(key, "must be an object", value)
        return value

    def keys(self, obj: Mapping[str, Any], key: str, required: Sequence[str], optional: Sequence[str]) -> None:
        """Every ``required`` key present and no key beyond ``required`` and ``optional``."""
        prefix = f"{key}." if key else ""
        for name in required:
            if name not in obj:
                self.missing(prefix + name)
        for name in obj:
            if name not in required and name not in optional:
                raise ValueError(f"owner_reduce: {self.what} {self.source}: key '{prefix}{name}' is not part of "
                                 f"{self.format}")

    def get(self, obj: Any, name: str, prefix: str = "") -> Any:
        """``obj[name]`` where ``obj`` is an object holding it; else the key ``prefix + name`` is missing."""
        if not isinstance(obj, dict) or name not in obj:
            self.missing(prefix + name)
        return obj[name]

    def field(self, obj: Any, name: str, prefix: str, check: Callable[[Any, str], T]) -> T:
        """``obj[name]`` (``get``) passed through ``check`` (a check below) under the key ``prefix + name``."""
        return check(self.get(obj, name, prefix), prefix + name)

    def integer(self, value: Any, key: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            self.fail(key, "must be an integer" + (f" >= {minimum}" if minimum is not None else ""), value)
        return value

    def number(self, value: Any, key: str, minimum: float = 0.0, positive: bool = False) -> float:
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
              and (value > 0 if positive else value >= minimum))
        if not ok:
            self.fail(key, "must be a positive number" if positive else f"must be a finite number >= {minimum}", value)
        return float(value)

    def finite(self, value: Any, key: str) -> float:
        """Any finite number, negative ones too."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, "must be a finite number", value)
        return float(value)

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str):
            self.fail(key, "must be a string", value)
        return value

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            self.fail(key, "must be bool", value)
        return value

    def listing(self, value: Any, key: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(key, "must be a list", value)
        return value

    def rows(self, value: Any, key: str, width: int) -> list[list[Any]]:
        if not isinstance(value, list):
            self.fail(key, f"must be a list of [{width} numbers]", value)
        for i, row in enumerate(value):
            if not isinstance(row, list) or len(row) != width:
                self.fail(f"{key}[{i}]", f"must be a list of {width} numbers", row)
        return value
