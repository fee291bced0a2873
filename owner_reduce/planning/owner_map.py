"""Which rank keeps each gradient: the owner map, computed from ZeRO-1's own partition tables.

Why a separate, pure module: every rank must derive the same map without communicating (NCCL needs every
rank to issue the same collectives in the same order), so the map is a function of plain tables that are
identical on all ranks. Nothing here imports torch.distributed or cupy; ``engine_tables`` reads the tables
out of a live DeepSpeed optimizer and hands them over as ``GroupTables``.

Vocabulary: a *partition* is ZeRO-1's slice of one parameter group's flat buffer; its id is the rank of
the keeper in the group's communicator. A parameter is *single-owner* when exactly one partition holds it,
*straddling* when its elements are spread over several partitions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from ..errors import OwnerMapError
from .wording import count_noun

SUMMARY_PREFIX = "DeepCompile reduce_to_owner:"


class Placement(str, Enum):
    """How a gradient reaches its keepers."""

    ONE_OWNER = "one_owner"  # one partition holds the whole parameter: Reduce to that rank
    STRADDLES = "straddles"  # several partitions hold a slice each
    OTHER_COMM = "other_comm"  # the group reduces over another communicator (MoE experts): AllReduce
    UNPLACED = "unplaced"  # zero elements and held by no partition: nothing to send


@dataclass(frozen=True)
class ParamSlice:
    """Elements ``[offset, offset + length)`` of a flattened gradient are kept by DP rank ``owner``."""

    offset: int
    length: int
    owner: int


@dataclass(frozen=True)
class ParamPlacement:
    param_id: int
    group: int
    numel: int
    placement: Placement
    slices: tuple[ParamSlice, ...]
    # False when every keeper needs the whole gradient (Muon orthogonalizes whole matrices): a straddling
    # gradient then stays on AllReduce instead of reducing slice by slice.
    sliceable: bool = True

    @property
    def sliced(self) -> bool:
        """A straddling gradient that reduces slice by slice to each slice's owner."""
        return self.placement is Placement.STRADDLES and self.sliceable

    @property
    def owner(self) -> int | None:
        """The one DP rank that keeps the whole gradient, or None when there is no single keeper."""
        if self.placement is Placement.ONE_OWNER:
            return self.slices[0].owner
        return None


@dataclass(frozen=True)
class GroupTables:
    """One optimizer parameter group as ZeRO-1 partitioned it (copied out of the optimizer).

    ``param_ids``/``numels`` are in the group's parameter order; ``partition_ids[pid]`` and
    ``start_offsets[partition][pid]`` are DeepSpeed's ``param_to_partition_ids[g]`` and
    ``grad_start_offset[g]``. ``same_comm_as_dp`` is False when the group reduces over a communicator
    that is not the engine's data-parallel group (by size or by group-rank -> global-rank mapping).
    """

    group: int
    param_ids: tuple[int, ...]
    numels: tuple[int, ...]
    partition_count: int
    partition_ids: Mapping[int, tuple[int, ...]]
    start_offsets: Mapping[int, Mapping[int, int]]
    same_comm_as_dp: bool
    whole_param_ids: frozenset[int] = frozenset()  # keepers need the whole gradient (Muon's use_muon)


def _slices_of(tables: GroupTables, param_id: int, numel: int) -> tuple[ParamSlice, ...]:
    partitions = sorted(tables.partition_ids.get(param_id, ()))
    where = f"group {tables.group}, param_id {param_id}"
    for partition in partitions:
        if not 0 <= partition < tables.partition_count:
            raise OwnerMapError(f"{where}: partition {partition} outside 0..{tables.partition_count - 1}")
    starts = [int(tables.start_offsets[p][param_id]) for p in partitions]
    if starts and starts[0] != 0:
        raise OwnerMapError(f"{where}: first partition {partitions[0]} starts at element {starts[0]}, not 0")
    ends = starts[1:] + [numel] if starts else []
    slices = []
    for partition, start, end in zip(partitions, starts, ends, strict=True):
        if not start < end <= numel and not (numel == 0 and start == end == 0):
            raise OwnerMapError(f"{where}: partition {partition} holds [{start}, {end}) of {numel} elements")
        slices.append(ParamSlice(offset=start, length=end - start, owner=partition))
    return tuple(slices)


def _place(tables: GroupTables, param_id: int, numel: int) -> ParamPlacement:
    slices = _slices_of(tables, param_id, numel)
    if not tables.same_comm_as_dp:
        placement = Placement.OTHER_COMM
        slices = ()
    elif not slices:
        if numel:
            raise OwnerMapError(f"group {tables.group}, param_id {param_id}: {numel} elements in no partition")
        placement = Placement.UNPLACED
    elif len(slices) == 1:
        placement = Placement.ONE_OWNER
    else:
        placement = Placement.STRADDLES
    return ParamPlacement(param_id=param_id, group=tables.group, numel=numel, placement=placement, slices=slices,
                          sliceable=param_id not in tables.whole_param_ids)


class OwnerMap:
    """Immutable placement of every trainable parameter, keyed by the optimizer's param id.

    The param id is the id DeepCompile passes to ``reduce_grad`` (``init_z1_and_2`` sets
    ``param.param_id = optimizer.get_param_id(param)``), so the runtime looks gradients up by it directly.
    """

    def __init__(self, placements: Sequence[ParamPlacement], dp_world_size: int,
                 tensor_ids: Mapping[int, int] | None = None) -> None:
        by_id: dict[int, ParamPlacement] = {}
        for placement in placements:
            if placement.param_id in by_id:
                raise OwnerMapError(f"param_id {placement.param_id} appears twice")
            for piece in placement.slices:
                if not 0 <= piece.owner < dp_world_size:
                    raise OwnerMapError(
                        f"param_id {placement.param_id}: owner {piece.owner} outside 0..{dp_world_size - 1}")
            by_id[placement.param_id] = placement
        self._placements = MappingProxyType(by_id)
        self._dp_world_size = dp_world_size
        # Python object ids of the live parameters, so owner(param) accepts tensors; not part of the map.
        self._tensor_ids = MappingProxyType(dict(tensor_ids or {}))

    @classmethod
    def from_group_tables(cls, groups: Sequence[GroupTables], dp_world_size: int,
                          tensor_ids: Mapping[int, int] | None = None) -> OwnerMap:
        placements = [
            _place(tables, param_id, numel) for tables in groups
            for param_id, numel in zip(tables.param_ids, tables.numels, strict=True)
        ]
        return cls(placements, dp_world_size, tensor_ids)

    @property
    def dp_world_size(self) -> int:
        return self._dp_world_size

    def __len__(self) -> int:
        return len(self._placements)

    def __iter__(self) -> Iterator[ParamPlacement]:
        return iter(self._placements.values())

    def __contains__(self, param: object) -> bool:
        return self._param_id(param) in self._placements

    def _param_id(self, param: object) -> int | None:
        if isinstance(param, int):
            return param
        return self._tensor_ids.get(id(param), getattr(param, "param_id", None))

    def placement(self, param: object) -> ParamPlacement:
        """The placement of a parameter given as tensor or as the optimizer's param id."""
        param_id = self._param_id(param)
        try:
            return self._placements[param_id]
        except KeyError:
            raise KeyError(f"parameter {param_id if param_id is not None else type(param).__name__} "
                           "is not in the owner map (not trainable, or from another engine)") from None

    def owner(self, param: object) -> int | None:
        return self.placement(param).owner

    def slices(self, param: object) -> tuple[ParamSlice, ...]:
        return self.placement(param).slices

    def count(self, placement: Placement) -> int:
        return sum(1 for p in self if p.placement is placement)

    def summary(self) -> str:
        """The init line, exactly: ``DeepCompile reduce_to_owner: X/Y gradients reduce to one rank``."""
        return f"{SUMMARY_PREFIX} {self.count(Placement.ONE_OWNER)}/{len(self)} gradients reduce to one rank"

    def owner_share(self, sliced: bool = False) -> float:
        """Share of gradient elements on the owner path: single-owner parameters, plus sliced straddlers."""
        total = sum(p.numel for p in self)
        owned = sum(p.numel for p in self if p.placement is Placement.ONE_OWNER or (sliced and p.sliced))
        return owned / total if total else 0.0

    def init_line(self, sliced: bool) -> str:
        """What rank 0 prints at init: the summary, plus the sliced straddlers when slicing is on."""
        if not sliced:
            return self.summary()
        n = sum(1 for p in self if p.sliced)
        verb = "reduces in slices to its owners" if n == 1 else "reduce in slices to their owners"
        return (f"{self.summary()}; {count_noun(n, 'straddling gradient')} {verb} "
                f"({100 * self.owner_share(sliced=True):.1f}% of elements on the owner path)")

    def digest(self) -> str:
        """A stable hash of the whole map; equal on every rank exactly when the maps are equal."""
        h = hashlib.sha256(f"owner_map/v1 ws={self._dp_world_size};".encode())
        for p in sorted(self, key=lambda p: p.param_id):
            pieces = ",".join(f"{s.offset}+{s.length}@{s.owner}" for s in p.slices)
            h.update(f"{p.param_id}:{p.group}:{p.numel}:{p.placement.value}:{int(p.sliceable)}:{pieces};".encode())
        return h.hexdigest()
