"""The real ``OwnerReduceRuntime`` on the simulated device, driven as DeepCompile drives it: one runtime per in-process
rank (``Sim.run_ranks``), each on the product's ``CupyNcclComm`` over the sim's NCCL, device tensors for every
gradient, parameter and grad buffer (``init``, ``register_param``, ``register_graph_z1/z2``, then per micro-step
``start_backward``, ``reduce_grad``..., ``end_backward``).

Helpers for the end-to-end grid (``test_sim_e2e.py``), the findings of issue 37 (``test_sim_findings.py``) and the
CUDA call counts (``test_cuda_calls.py``)."""

from __future__ import annotations

import collections
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from owner_reduce.planning.calls import HANDOFF, LEVELS, LOG_NAMES
from owner_reduce.planning.flags import OwnerReduceFlags
from owner_reduce.planning.owner_map import OwnerMap
from tests.support.sim.cuda import Sim

GRAPH = 11


def group_ranks_as_nodes(monkeypatch: Any, sim: Sim, per_node: int) -> None:
    """The sim's in-process ranks as nodes of ``per_node`` in launcher order: rank R reports the host name
    ``sim-node-<R // per_node>``, local rank R % per_node and ``LOCAL_WORLD_SIZE`` ``per_node`` to the runtime's
    agreement (what torchrun sets per process on several hosts)."""
    from owner_reduce.runtime import agreement

    monkeypatch.setattr(agreement, "host_name", lambda: f"sim-node-{sim._this_process().rank // per_node}")
    monkeypatch.setattr(agreement, "local_rank", lambda environ=None: sim._this_process().rank % per_node)
    monkeypatch.setattr(agreement, "launcher_ranks_per_node", lambda environ=None: (0, per_node))


def make_runtime(owner_map: OwnerMap, rank: int, comm_factory: Callable[[Any], Any], *, algo: str = "auto",
                 stage: int = 1, bucket: int = 64, measure: bool = False, dtype_of: Callable[[int], torch.dtype]
                 | None = None, double_buffer: bool = True, graph_id: int = GRAPH,
                 timeout_s: float | None = None) -> Any:
    """Rank ``rank``'s runtime, initialised (its communicator from ``comm_factory``), every parameter registered as
    DeepCompile registers it: this rank's slice of each gradient as a device grad buffer. ``timeout_s``: the flushes'
    deadline, as ``compile.reduce_to_owner_timeout_s`` gives it (None: torch's default, no process group here)."""
    from owner_reduce.planning.settings import AUTO, MODEL, OwnerReduceSettings
    from owner_reduce.runtime.handle import OwnerReduceRuntime

    settings = OwnerReduceSettings(OwnerReduceFlags(True, False), algo=MODEL if algo == AUTO and not measure else algo,
                                   timeout_s=timeout_s)
    rt = OwnerReduceRuntime(settings, owner_map, comm_factory)
    rt.init(None, types.SimpleNamespace(double_buffer=double_buffer), bucket)
    # The calls init made on each of this rank's communicators (the connection warm-up: ``comm`` Note (lazy
    # connections)): ``check_collective_log`` counts the flushes' calls after them.
    sim = _sim_or_none()
    rt.sim_calls_at_init = ([collections.Counter(m.calls) for m in sim.nccl.comms(sim._this_process().rank)]
                            if sim is not None else [])
    rt.record_collectives = True
    for p in owner_map:
        dtype = dtype_of(p.param_id) if dtype_of is not None else torch.float32
        mine = [s for s in p.slices if s.owner == rank and s.length]
        buf, offset = ((torch.zeros(mine[0].length, dtype=dtype, device="cuda"), mine[0].offset) if mine else
                       (torch.empty(0, dtype=dtype, device="cuda"), 0))
        rt.register_param(p.param_id, (p.numel,), torch.zeros(p.numel, dtype=dtype, device="cuda"), buf, offset)
    (rt.register_graph_z2 if stage == 2 else rt.register_graph_z1)(graph_id, [p.param_id for p in owner_map])
    return rt


def connect_comms(sim: Sim, comms: Sequence[Any]) -> None:
    """What the runtime's init does for its communicators (``comm`` Note (lazy connections)) for ``comms``, one
    communicator per rank of one unique id: every collective kind and every peer in both directions connected on every
    rank, so that a test's stalled peer stalls a flush, not a connection setup inside ``ncclGroupEnd``."""
    ws = len(comms)

    def connect(rank: int) -> None:
        comm = comms[rank]
        comm.all_gather_ints([rank])  # as the agreement's gather
        comm.warm_up(("reduce", "allreduce", "reduce_scatter"), ws)
        others = [p for p in range(ws) if p != rank]
        comm.connect_peers(others, others)

    sim.run_ranks(connect, ws)


def _sim_or_none() -> Any:
    from tests.support.sim import cuda as sim_cuda

    return sim_cuda._ACTIVE


def cupy_runtimes(sim: Sim, owner_map: OwnerMap, **kwargs: Any) -> list[Any]:
    """One runtime per rank of ``owner_map``'s world, each on a ``CupyNcclComm`` of one unique id (the product's
    constructor: what ``CupyNcclComm.from_process_group`` builds after broadcasting the id)."""
    from owner_reduce.runtime.nccl_binding import new_unique_id
    from owner_reduce.runtime.nccl_comm import CupyNcclComm

    ws = owner_map.dp_world_size
    uid = new_unique_id()
    return sim.run_ranks(lambda rank: make_runtime(owner_map, rank, lambda group: CupyNcclComm(uid, rank, ws),
                                                   **kwargs), ws)


def exact_grads(ws: int, numels: Sequence[int], rank: int, step: int, micro: int,
                dtype_of: Callable[[int], torch.dtype] | None = None) -> dict[int, torch.Tensor]:
    """Host gradients whose pre-division by ``ws`` and every partial sum are exact (small integers times ``ws``), so
    any order of addition gives the true sum, and a share lost, doubled or sent to the wrong owner shows."""
    out = {}
    for pid, n in enumerate(numels):
        dtype = dtype_of(pid) if dtype_of is not None else torch.float32
        values = (torch.arange(n) % 3 + 1) * (rank + 1) + step + micro + pid % 3  # at most 29 at ws 8
        out[pid] = (values * ws).to(dtype)
    return out


def expected_buffers(owner_map: OwnerMap, ws: int, numels: Sequence[int], step: int, ga: int,
                     dtype_of: Callable[[int], torch.dtype] | None = None) -> dict[int, torch.Tensor]:
    """What every grad buffer must hold after step ``step``'s micro-steps: the mean over ranks, summed over them."""
    total = {pid: torch.zeros(n, dtype=torch.float64) for pid, n in enumerate(numels)}
    for micro in range(ga):
        for r in range(ws):
            for pid, grad in exact_grads(ws, numels, r, step, micro, dtype_of).items():
                total[pid] += grad.double() / ws
    return total


def train_step(sim: Sim, runtimes: Sequence[Any], numels: Sequence[int], step: int, ga: int,
               order: Sequence[int] | None = None, dtype_of: Callable[[int], torch.dtype] | None = None,
               between: Callable[[int, int], None] | None = None) -> None:
    """One optimizer step's micro-steps on every rank: each gradient copied to the device as the backward would make
    it, fed in ``order`` (default: reversed, as a backward produces them); ``between(rank, pid)`` runs before each
    ``reduce_grad`` (a layer's compute)."""
    ws = len(runtimes)
    order = list(order) if order is not None else list(reversed(range(len(numels))))

    def backward(rank: int) -> None:
        rt = runtimes[rank]
        for micro in range(ga):
            grads = exact_grads(ws, numels, rank, step, micro, dtype_of)
            rt.start_backward(micro == ga - 1)
            for pid in order:
                if between is not None:
                    between(rank, pid)
                rt.reduce_grad(grads[pid].to("cuda", non_blocking=True), GRAPH, pid)
            rt.end_backward(GRAPH, False)

    sim.run_ranks(backward, ws)


def check_buffers(sim: Sim, runtimes: Sequence[Any], owner_map: OwnerMap, numels: Sequence[int], step: int, ga: int,
                  dtype_of: Callable[[int], torch.dtype] | None = None) -> int:
    """Every rank's grad buffers bitwise equal to the exact sum; returns how many buffers were compared."""
    ws = len(runtimes)
    want = expected_buffers(owner_map, ws, numels, step, ga, dtype_of)
    got = sim.run_ranks(lambda rank: {pid: p.grad_buffer.cpu() for pid, p in runtimes[rank]._params.items()}, ws)
    compared = 0
    for rank, buffers in enumerate(got):
        for pid, buf in buffers.items():
            if not buf.numel():
                continue
            offset = runtimes[rank]._params[pid].offset
            expected = want[pid][offset:offset + buf.numel()].to(buf.dtype)
            assert torch.equal(buf, expected), (f"step {step}, rank {rank}, param {pid}: {buf.tolist()} != "
                                                f"{expected.tolist()}")
            compared += 1
    return compared


# From the vocabulary (``planning.calls``): each collective-log name's NCCL function (the hand-off rounds' sends and
# receives are counted apart) and its communicator, by the levels' creation order (data-parallel, node, rail, node
# hand-off).
_LOG_TO_NCCL = {name: kind.nccl for (_, kind), name in LOG_NAMES.items() if kind != HANDOFF}
_LOG_COMM = {name: LEVELS.index(level) for (level, _), name in LOG_NAMES.items()}


def check_collective_log(sim: Sim, runtimes: Sequence[Any]) -> collections.Counter[str]:
    """Every rank's collective log against the NCCL calls the sim saw on that rank's communicators (data-parallel,
    node, rail, node hand-off, in creation order) after its init's warm-up: the same Reduces, AllReduces and
    ReduceScatters on the same communicator, and as many sends and receives as the runtime counted plus one per peer
    and direction its hand-offs connected (``connect_peers``). Returns rank 0's log by name."""
    names: collections.Counter[str] = collections.Counter()
    for rank, rt in enumerate(runtimes):
        members = sim.nccl.comms(rank)
        at_init = rt.sim_calls_at_init + [collections.Counter()] * (len(members) - len(rt.sim_calls_at_init))
        calls = [m.calls - at_init[i] for i, m in enumerate(members)]
        logged: collections.Counter[tuple[int, str]] = collections.Counter()
        for name, *_ in rt.collective_log:
            if name in _LOG_TO_NCCL:
                logged[_LOG_COMM[name], _LOG_TO_NCCL[name]] += 1
            if rank == 0:
                names[name] += 1
        seen = collections.Counter({(i, kind): n for i, c in enumerate(calls) for kind, n in c.items()
                                    if kind in ("reduce", "allReduce", "reduceScatter")})
        assert logged == seen, f"rank {rank}: logged {dict(logged)}, NCCL saw {dict(seen)}"
        s = rt.stats
        levels = rt.flusher.levels
        comms = [rt.comm, *(levels if levels is not None else ())]
        connected = [len(c._connected_peers) if c is not None else 0 for c in comms] + [0] * 4
        p2p = [sum(calls[i][k] for k in ("send", "recv")) if i < len(calls) else 0 for i in range(4)]
        assert p2p[0] == s.sends + s.recvs + connected[0], (rank, p2p, connected, s)
        assert p2p[3] == s.node_handoff_sends + s.node_handoff_recvs + connected[3], (rank, p2p, connected, s)
        assert (p2p[2] - connected[2] > 0) == (s.rail_handoffs > 0), (rank, p2p, connected, s)
    return names
