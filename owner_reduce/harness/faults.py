"""Deliberately broken reductions: the negative controls of the tests and the acceptance script.

Why in the package: a comparison that cannot fail proves nothing. The acceptance script's ``--inject-fault``
and the tests use these to show that a wrong root or a skipped range is caught. Never active unless asked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..planning.flush_plan import FlushRange

FAULTS = ("wrong_root", "skip_range", "show_unoptimized_params")


def inject(fault: str, world_size: int) -> None:
    """From now on, in this process, every flush plan has its first owner range broken as ``fault`` says;
    ``show_unoptimized_params``: DeepCompile sees frozen and zero-element parameters as parameters again (the
    upstream behaviour, which fails at the first forward)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    if fault == "show_unoptimized_params":
        import owner_reduce.wiring.activation as activation

        activation.hide_unoptimized_params = lambda backend_fn, optimized: backend_fn
        return
    import owner_reduce.runtime.handle as runtime_module

    original = runtime_module.plan_flush

    def broken(entries: Any, owner_map: Any, reduce_to_owner: bool, **kwargs: Any) -> Any:
        plan = original(entries, owner_map, reduce_to_owner, **kwargs)
        ranges = list(plan.ranges)
        i = next((i for i, r in enumerate(ranges) if r.root is not None), None)
        if i is None:
            return plan
        if fault == "wrong_root":
            ranges[i] = FlushRange(ranges[i].offset, ranges[i].count, (ranges[i].root + 1) % world_size)
        else:
            del ranges[i]
        return dataclasses.replace(plan, ranges=tuple(ranges))

    runtime_module.plan_flush = broken
