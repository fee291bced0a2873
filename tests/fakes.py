"""In-process stand-ins for the communicator seam (no processes): unit tests of the runtime's bookkeeping."""

from __future__ import annotations

import types

import torch

from owner_reduce.planning.flags import OwnerReduceFlags
from owner_reduce.planning.owner_map import GroupTables, OwnerMap
from owner_reduce.runtime.comm import ReduceComm


class MirrorComm(ReduceComm):
    """Rank ``rank`` of ``world_size`` ranks that all hold the same data: a SUM multiplies by world_size.

    Where this rank is not the root of a reduce, the result is undefined, so it is filled with NaN: any copy
    of a value that never reached this rank shows up as NaN in the grad buffers.
    """

    name = "mirror"

    def __init__(self, rank: int = 0, world_size: int = 2, fail_on_call: int | None = None) -> None:
        super().__init__(rank, world_size)
        self.calls: list[tuple[str, int | None, int]] = []
        self.groups = 0
        self.open_groups = 0
        self.fail_on_call = fail_on_call
        self.gathered_rows: list[list[int]] | None = None
        self.buffer_releases = 0
        self._scattered: torch.Tensor | None = None  # every rank's input of the last ReduceScatter (all alike here)

    def _group_start(self) -> None:
        self.groups += 1
        self.open_groups += 1

    def _group_end(self) -> None:
        self.open_groups -= 1

    def _maybe_fail(self) -> None:
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise RuntimeError("injected collective failure")

    def reduce(self, buf: torch.Tensor, root: int) -> None:
        self._maybe_fail()
        self.calls.append(("reduce", root, buf.numel()))
        if root == self.rank:
            buf.mul_(self.world_size)
        else:
            buf.fill_(float("nan"))

    def all_reduce(self, buf: torch.Tensor) -> None:
        self._maybe_fail()
        self.calls.append(("all_reduce", None, buf.numel()))
        buf.mul_(self.world_size)

    def reduce_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        self._check_scatter(buf, per_rank)
        self._maybe_fail()
        self.calls.append(("reduce_scatter", None, buf.numel()))
        self._scattered = buf.clone()
        self._scattered_at = buf.storage_offset()
        start = self.rank * per_rank
        buf.narrow(0, start, per_rank).mul_(self.world_size)
        buf.narrow(0, 0, start).fill_(float("nan"))  # the other blocks never reach this rank
        buf.narrow(0, start + per_rank, buf.numel() - start - per_rank).fill_(float("nan"))

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self._maybe_fail()
        self.calls.append(("send", peer, buf.numel()))

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        """What ``peer`` reduced in the last ReduceScatter: the same elements of every rank's (identical) input,
        summed; NaN where ``peer`` did not hold them (its block), so a wrong hand-off shows."""
        self._maybe_fail()
        self.calls.append(("recv", peer, buf.numel()))
        at = buf.storage_offset() - self._scattered_at
        buf.copy_(self._scattered[at:at + buf.numel()] * self.world_size)
        per_rank = self._scattered.numel() // self.world_size
        if not (peer * per_rank <= at and at + buf.numel() <= (peer + 1) * per_rank):
            buf.fill_(float("nan"))

    def release_buffers(self) -> None:
        self.buffer_releases += 1

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return self.gathered_rows if self.gathered_rows is not None else [list(values)] * self.world_size


# ws=2, partition_size 8: a(6) -> r0, b(5) straddles [0:2]->r0 [2:5]->r1, c(5) -> r1
NUMELS = {0: 6, 1: 5, 2: 5}
TABLES = GroupTables(group=0, param_ids=(0, 1, 2), numels=(6, 5, 5), partition_count=2,
                     partition_ids={0: (0,), 1: (0, 1), 2: (1,)},
                     start_offsets={0: {0: 0, 1: 0}, 1: {1: 2, 2: 0}}, same_comm_as_dp=True)


def ws2_runtime(rank=0, owner=True, probe=True, bucket=64, problems=(), comm=None, algo="reduce"):
    """A runtime of rank ``rank`` of 2 on ``TABLES``, grad buffers registered as DeepCompile does (rank 0: a whole,
    b's first 2 elements at offset 0, nothing of c), graph 11; ``algo`` forces the flush algorithm (these flushes
    are tiny: the cost model alone would AllReduce them)."""
    return mirror_runtime(OwnerMap.from_group_tables([TABLES], 2), rank=rank, bucket=bucket, algo=algo, probe=probe,
                          owner=owner, problems=problems, comm=comm)


def shared_gpu_env(world_size: int, torch_pg: bool = False) -> dict[str, str]:
    """The environment for ``world_size`` NCCL ranks on this machine's GPUs, or a skip. Ranks outnumbering the GPUs
    share them, which needs NCCL >= 2.30 and its opt-in (``NCCL_MULTI_RANK_GPU_ENABLE``) in cupy's NCCL, and also in
    torch's when the ranks' process group is NCCL (``torch_pg``). Each rank's device is its index among the visible
    GPUs (``harness.launch.local_device``), never its rank."""
    import pytest

    from owner_reduce.runtime import nccl_comm

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() >= world_size:
        return {}
    versions = {"cupy": nccl_comm.nccl_runtime_version()}
    if torch_pg:
        versions["torch"] = tuple(torch.cuda.nccl.version())
    old = {k: ".".join(map(str, v)) for k, v in versions.items() if tuple(v) < (2, 30, 0)}
    if old:
        pytest.skip(f"{world_size} ranks on {torch.cuda.device_count()} GPU(s) need NCCL >= 2.30 "
                    f"(NCCL_MULTI_RANK_GPU_ENABLE); loaded: {old}")
    return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


def two_gpu_ranks_env() -> dict[str, str]:
    """``shared_gpu_env(2)``: two ranks whose process group is gloo, their communicator cupy's NCCL."""
    return shared_gpu_env(2)


def flat_map(numels, ws, other_comm_numels=()):
    """ZeRO-1-like tables: parameters laid flat, cut into ``ws`` partitions of ceil(total/ws); optionally a second
    group on another communicator (MoE experts)."""
    total = sum(numels)
    size = max(1, -(-total // ws))
    ids = tuple(range(len(numels)))
    parts, starts = {}, {r: {} for r in range(ws)}
    flat = 0
    for pid, numel in zip(ids, numels, strict=True):
        first = min(flat // size, ws - 1)
        last = min(max(flat, flat + numel - 1) // size, ws - 1)
        parts[pid] = tuple(range(first, last + 1))
        for r in parts[pid]:
            starts[r][pid] = max(0, r * size - flat)
        flat += numel
    groups = [GroupTables(group=0, param_ids=ids, numels=tuple(numels), partition_count=ws, partition_ids=parts,
                          start_offsets=starts, same_comm_as_dp=True)]
    if other_comm_numels:
        oids = tuple(range(len(numels), len(numels) + len(other_comm_numels)))
        groups.append(GroupTables(group=1, param_ids=oids, numels=tuple(other_comm_numels), partition_count=1,
                                  partition_ids={i: (0,) for i in oids}, start_offsets={0: dict.fromkeys(oids, 0)},
                                  same_comm_as_dp=False))
    return OwnerMap.from_group_tables(groups, dp_world_size=ws)


def mirror_runtime(owner_map, rank=0, bucket=1 << 20, algo="auto", probe=False, stage=1, graph_id=11, owner=True,
                   problems=(), comm=None):
    """A runtime of rank ``rank`` on ``owner_map`` with a ``MirrorComm`` (or ``comm``), every parameter registered as
    DeepCompile registers it (this rank's slice of each gradient as its grad buffer), one graph of every parameter."""
    from owner_reduce.runtime.handle import OwnerReduceRuntime, RuntimeSettings

    comm = comm or MirrorComm(rank=rank, world_size=owner_map.dp_world_size)
    rt = OwnerReduceRuntime(RuntimeSettings(OwnerReduceFlags(owner, probe), owner_map, problems, flush_algo=algo),
                            comm_factory=lambda group: comm)
    rt.init(None, types.SimpleNamespace(double_buffer=True), bucket)
    for p in owner_map:
        mine = [s for s in p.slices if s.owner == rank and s.length]
        buf, offset = (torch.zeros(mine[0].length), mine[0].offset) if mine else (torch.empty(0), 0)
        rt.register_param(p.param_id, (p.numel,), torch.zeros(p.numel), buf, offset)
    (rt.register_graph_z2 if stage == 2 else rt.register_graph_z1)(graph_id, [p.param_id for p in owner_map])
    return rt, comm
