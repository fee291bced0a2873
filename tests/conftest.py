"""Suite-wide guard: a flush watchdog (``owner_reduce/runtime/watchdog.py``) that decides to end its process ends it
with ``os._exit``, which inside pytest would end every test at once, silently (its last words go to the captured
stderr). In this process its ``end`` only records, and the test that got there fails naming why; tests that check the
ending give their watchdog a fake ``end`` of their own, and subprocess tests see the real one."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_flush_watchdog_ends_pytest(monkeypatch):
    from owner_reduce.runtime.watchdog import FlushWatchdog

    ended: list[int] = []
    monkeypatch.setattr(FlushWatchdog, "end", staticmethod(ended.append))
    yield
    assert not ended, "a flush watchdog ended its process (see the captured stderr for why)"
