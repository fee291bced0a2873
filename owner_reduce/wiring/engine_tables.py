"""Copies ZeRO-1's partition tables out of a live DeepSpeed engine into an ``OwnerMap``.

Why not recompute the partitioning: DeepSpeed's layout (alignment padding, round-robin reordering, MoE
groups) has changed between releases; reading the optimizer's own tables is the only way to agree with
the copy-out that actually runs. This is the one place that touches the optimizer's private attributes,
so each is checked and a missing one is reported by name.
"""

from __future__ import annotations

from typing import Any

import deepspeed.comm as dist

from ..planning.owner_map import GroupTables, OwnerMap, Placement

# The optimizer attributes read here (DeepSpeedZeroOptimizer, deepspeed 0.19.x).
REQUIRED_OPTIMIZER_ATTRS: tuple[str, ...] = (
    "bit16_groups",
    "param_to_partition_ids",
    "grad_start_offset",
    "partition_size",
    "real_dp_process_group",
    "get_param_id",
)


def _global_ranks(group: Any) -> tuple[int, ...]:
    # deepspeed.comm.get_all_ranks_from_group never ends on the WORLD group (get_global_rank is the identity
    # there), so iterate over the group's size instead.
    return tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group=group)))


def zero_optimizer_of(engine: Any) -> Any:
    """The engine's ZeRO stage 1/2 optimizer, or a TypeError that says what is missing."""
    optimizer = getattr(engine, "optimizer", None)
    missing = [name for name in REQUIRED_OPTIMIZER_ATTRS if not hasattr(optimizer, name)]
    if missing:
        raise TypeError(f"owner_reduce needs a DeepSpeed ZeRO stage 1 optimizer; {type(optimizer).__name__} "
                        f"lacks {', '.join(missing)} (is zero_optimization.stage 1 and the engine initialized?)")
    return optimizer


def group_tables(engine: Any) -> list[GroupTables]:
    optimizer = zero_optimizer_of(engine)
    dp_ranks = _global_ranks(engine.data_parallel_group)
    tables = []
    for g, params in enumerate(optimizer.bit16_groups):
        real_group = optimizer.real_dp_process_group[g]
        param_ids = tuple(optimizer.get_param_id(p) for p in params)
        partition_ids = optimizer.param_to_partition_ids[g]
        start_offsets = optimizer.grad_start_offset[g]
        tables.append(
            GroupTables(group=g,
                        param_ids=param_ids,
                        numels=tuple(p.numel() for p in params),
                        partition_count=dist.get_world_size(group=real_group),
                        partition_ids={pid: tuple(partition_ids.get(pid, ())) for pid in param_ids},
                        start_offsets={part: dict(offsets) for part, offsets in start_offsets.items()},
                        same_comm_as_dp=_global_ranks(real_group) == dp_ranks,
                        whole_param_ids=frozenset(optimizer.get_param_id(p) for p in params
                                                  if getattr(p, "use_muon", False))))
    return tables


def build_owner_map(engine: Any) -> OwnerMap:
    """The owner map of a DeepSpeed ZeRO-1 engine; identical on every rank, no communication."""
    optimizer = zero_optimizer_of(engine)
    tensor_ids = {id(p): optimizer.get_param_id(p) for params in optimizer.bit16_groups for p in params}
    return OwnerMap.from_group_tables(group_tables(engine),
                                      dp_world_size=dist.get_world_size(group=engine.data_parallel_group),
                                      tensor_ids=tensor_ids)


def disagreements_with_optimizer(owner_map: OwnerMap, engine: Any) -> list[str]:
    """Where the map contradicts this rank's optimizer; empty when they agree.

    Checks the map against what ZeRO-1 itself uses on this rank: ``is_param_in_current_partition``,
    ``params_in_partition`` (members and parameter order, which DeepCompile's buffer pairing relies on),
    ``first_offset``, and the exact element range DeepCompile copies into
    this rank's partition (``grad_start_offset`` and ``grad_partition_insertion_offset`` bounded by the
    partition size). Cheap enough to run once at init.
    """
    optimizer = zero_optimizer_of(engine)
    problems: list[str] = []
    dp_rank = dist.get_rank(group=engine.data_parallel_group)
    for g, params in enumerate(optimizer.bit16_groups):
        tables_rank = dist.get_rank(group=optimizer.real_dp_process_group[g])
        placements = [owner_map.placement(optimizer.get_param_id(p)) for p in params]
        if placements and placements[0].placement is Placement.OTHER_COMM:
            continue  # reduced over another communicator: AllReduce, nothing to agree on
        mine = {p.param_id: s for p in placements for s in p.slices if s.owner == dp_rank}
        for p in placements:
            expected = bool(optimizer.is_param_in_current_partition[p.param_id])
            if (p.param_id in mine) != expected:
                problems.append(f"group {g} param_id {p.param_id}: map says in partition of rank {dp_rank}: "
                                f"{p.param_id in mine}, optimizer says {expected}")
        in_partition = [optimizer.get_param_id(p) for p in optimizer.params_in_partition[g]]
        # DeepCompile pairs grad buffers with parameters in parameter order, so ZeRO's partition must list
        # them in that order too (round_robin_gradients reorders it, and DeepCompile would mis-pair them).
        in_param_order = [p.param_id for p in placements if p.param_id in mine]
        if in_param_order != in_partition:
            problems.append(f"group {g}: rank {dp_rank}'s partition holds params {in_partition} (optimizer), "
                            f"the map says {in_param_order} in parameter order"
                            + (" (round_robin_gradients reorders partitions, which DeepCompile does not support)"
                               if getattr(optimizer, "round_robin_gradients", False) else ""))
            continue
        first = mine[in_partition[0]].offset if in_partition else 0
        if first != optimizer.first_offset[g]:
            problems.append(f"group {g}: first_offset map {first}, optimizer {optimizer.first_offset[g]}")
        partition_size = int(optimizer.partition_size[g])
        for pid in in_partition:
            source = optimizer.grad_start_offset[g][tables_rank][pid]
            dest = optimizer.grad_partition_insertion_offset[g][tables_rank][pid]
            numel = optimizer.param_dict[pid].numel()
            kept = max(0, min(numel - source, partition_size - dest))
            piece = mine[pid]
            if (piece.offset, piece.length) != (source, kept):
                problems.append(f"group {g} param_id {pid}: map keeps [{piece.offset}, +{piece.length}) on rank "
                                f"{dp_rank}, the partition copy-out keeps [{source}, +{kept})")
    return problems
