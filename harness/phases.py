"""Phase stamps for multi-rank runs: what each rank is doing, since when, and how many collectives it issued there.

Why: a run that overstays its bound must say where it is. "Did not finish in 70 s, last line 'Launching compile
passes'" (issue 17, ws 4 on one GPU) cannot tell a slow compile from a hang; "rank 2 in 'step 1 forward (DeepCompile
compiles and profiles the forward graph)' for 48 s after 1,204 torch.distributed calls" can. Each rank prints a
line per phase (rank 0's start with ``  phase r0``) and keeps its current phase in a file of a directory the parent
chose (``OWNER_REDUCE_PHASE_DIR``); when the parent's bound expires, ``describe_phases`` reads them.

``CollectiveCounter`` counts the ``torch.distributed`` calls a rank makes (DeepCompile's compile-time profiler
issues about two all_reduces per graph node, each read back with ``.item()``), so the phase lines show how much
of a phase was collectives. It wraps module attributes; ``deepspeed.comm`` looks them up at call time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PHASE_DIR_ENV = "OWNER_REDUCE_PHASE_DIR"
COUNTED = ("all_reduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_gather_object", "reduce")


class CollectiveCounter:
    """Counts calls (and host seconds inside them) of the ``torch.distributed`` functions in ``COUNTED``."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seconds = 0.0
        self._saved: dict[str, Callable[..., Any]] = {}

    def install(self) -> CollectiveCounter:
        import torch.distributed as dist

        for name in COUNTED:
            original = getattr(dist, name, None)
            if original is None or name in self._saved:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        counted.__name__ = getattr(original, "__name__", name)
        return counted

    def snapshot(self) -> tuple[dict[str, int], float]:
        return dict(self.calls), self.seconds


def _delta(before: tuple[dict[str, int], float], after: tuple[dict[str, int], float]) -> str:
    calls = {k: v - before[0].get(k, 0) for k, v in after[0].items() if v - before[0].get(k, 0)}
    if not calls:
        return "no torch.distributed calls"
    parts = ", ".join(f"{k} {v}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1]))
    return f"{sum(calls.values())} torch.distributed calls ({parts}), {after[1] - before[1]:.2f} s inside them"


class PhaseLog:
    """One rank's phases: ``enter(name)`` closes the previous phase (printing how long it took) and opens ``name``."""

    def __init__(self, rank: int, directory: str | None = None, counter: CollectiveCounter | None = None,
                 echo: bool = True) -> None:
        self.rank = rank
        self.directory = directory if directory is not None else os.environ.get(PHASE_DIR_ENV)
        self.counter = counter
        self.echo = echo
        self.t0 = time.monotonic()
        self.current: str | None = None
        self._entered = self.t0
        self._counts: tuple[dict[str, int], float] = ({}, 0.0)
        self.history: list[dict[str, Any]] = []  # closed phases: name, start_s, seconds, collectives

    def _now_counts(self) -> tuple[dict[str, int], float]:
        return self.counter.snapshot() if self.counter is not None else ({}, 0.0)

    def enter(self, name: str) -> None:
        now = time.monotonic()
        counts = self._now_counts()
        if self.current is not None:
            seconds = now - self._entered
            what = _delta(self._counts, counts) if self.counter is not None else ""
            self.history.append({"phase": self.current, "start_s": round(self._entered - self.t0, 3),
                                 "seconds": round(seconds, 3), "collectives": what})
            self._say(f"+{now - self.t0:8.2f}s done  {self.current}: {seconds:.2f} s" + (f"; {what}" if what else ""),
                      self.current)
        self.current, self._entered, self._counts = name, now, counts
        self._say(f"+{now - self.t0:8.2f}s enter {name}", name)
        if self.directory:
            path = Path(self.directory) / f"rank{self.rank}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rank": self.rank, "phase": name, "entered_wall": time.time(),
                                       "elapsed_s": now - self.t0, "pid": os.getpid()}))
            tmp.replace(path)

    def _say(self, text: str, name: str | None = None) -> None:
        """One whole line per write (ranks share stdout). Steps after the first are recorded but not printed: they
        repeat step 1 and would bury it."""
        name = name or self.current or ""
        if self.echo and not (name.startswith("step ") and not name.startswith("step 1 ")):
            sys.stdout.write(f"  phase r{self.rank} {text}\n")
            sys.stdout.flush()


def describe_phases(directory: str | Path, world_size: int, now: float | None = None) -> str:
    """Where each rank is, from the files its ``PhaseLog`` keeps: one clause per rank, for a timeout's message."""
    now = time.time() if now is None else now
    parts = []
    for rank in range(world_size):
        path = Path(directory) / f"rank{rank}.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            parts.append(f"rank {rank}: no phase reported (still starting: imports, process group)")
            continue
        parts.append(f"rank {rank}: in '{state['phase']}' for {now - state['entered_wall']:.1f} s "
                     f"(entered {state['elapsed_s']:.1f} s after it started)")
    return "; ".join(parts)
