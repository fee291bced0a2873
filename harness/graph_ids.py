"""Graph ids that differ per rank and are reused across a recompile, deterministically: the worst case DeepCompile's
``id(gm.graph)`` allows, for end-to-end tests.

Why: DeepCompile names a graph by its memory address. After a recompile (``reset()``, then every graph registered
again) a new graph may land on an old graph's address on one rank and on a fresh one on another; on a CPU test
machine the addresses happen to come out fresh on every rank, so a test of the real path would not see a runtime that
keeps what it learned under an old id. With ``reuse_graph_ids(rank)``, rank 0 names its graphs 1, 2, ... afresh after
every reset (each recompiled graph reuses an old id) and every other rank never reuses a name; the runtime sees only
these names. Never active unless asked; it changes nothing but the names.
"""

from __future__ import annotations

import itertools
from typing import Any


def reuse_graph_ids(rank: int) -> None:
    """From now on, in this process, every owner_reduce runtime sees graph ids renamed as the module says."""
    from owner_reduce.runtime.handle import OwnerReduceRuntime

    names: dict[int, int] = {}  # DeepCompile's id -> the name the runtime sees
    counter = [itertools.count(1 if rank == 0 else 1000 * rank)]
    register_z1, register_z2 = OwnerReduceRuntime.register_graph_z1, OwnerReduceRuntime.register_graph_z2
    reduce_grad, end_backward, reset = (OwnerReduceRuntime.reduce_grad, OwnerReduceRuntime.end_backward,
                                        OwnerReduceRuntime.reset)

    def named(graph_id: int) -> int:
        names[graph_id] = next(counter[0])
        return names[graph_id]

    def renamed_reset(self: Any) -> None:
        names.clear()
        if rank == 0:
            counter[0] = itertools.count(1)  # the recompiled graphs reuse the old names
        reset(self)

    OwnerReduceRuntime.register_graph_z1 = lambda self, graph_id, ds_ids: register_z1(self, named(graph_id), ds_ids)
    OwnerReduceRuntime.register_graph_z2 = lambda self, graph_id, ds_ids: register_z2(self, named(graph_id), ds_ids)
    OwnerReduceRuntime.reduce_grad = lambda self, grad, graph_id, ds_id: reduce_grad(
        self, grad, names.get(graph_id, graph_id), ds_id)
    OwnerReduceRuntime.end_backward = lambda self, graph_id, release: end_backward(
        self, names.get(graph_id, graph_id), release)
    OwnerReduceRuntime.reset = renamed_reset
