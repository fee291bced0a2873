"""One digest for JSON-able data that every rank compares (a calibration file, a verdict book, a checkpoint's
payload): sha256 of its canonical JSON (sorted keys, no spaces), the first ``DIGEST_CHARS`` hex digits. One function,
so two files with the same contents get the same digest whichever module computes it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

DIGEST_CHARS = 12


def canonical_digest(data: Any) -> str:
    """The digest of ``data`` (objects JSON cannot write are written as their ``str``)."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:DIGEST_CHARS]
