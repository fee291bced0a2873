"""In-process stand-ins for the communicator seam (no processes): unit tests of the runtime's bookkeeping.

``MirrorComm``: one rank of a world whose ranks all hold the same data (cheap, one runtime, cannot see ranks diverge).
``ExchangeWorld``: n ranks in one process, each on its own thread, whose collectives really exchange data and are
checked call by call across ranks: for anything where ranks may differ (graph ids, schedules, hand-off, timings).
"""

from __future__ import annotations

import threading
import time
import types
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from owner_reduce.planning.flags import OwnerReduceFlags
from owner_reduce.planning.owner_map import GroupTables, OwnerMap
from owner_reduce.runtime.comm import ReduceComm, check_scatter


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
        check_scatter(self, buf, per_rank)
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


# ---- n ranks that really exchange data ----------------------------------------------------------------------------

class ExchangeMismatch(AssertionError):
    """Ranks disagreed on a collective (kind, count, dtype, root, per-rank block) or on a send/recv pair (count,
    dtype), or a send was never received: what NCCL would hang on or silently compute garbage from."""


class ExchangeTimeout(AssertionError):
    """A rank did not join a call within the world's timeout, or finished (returned or raised) without joining it.
    ``peer_failed``: the wait ended because a peer raised first (a consequence, not the cause)."""

    def __init__(self, message: str, peer_failed: bool = False) -> None:
        super().__init__(message)
        self.peer_failed = peer_failed


class ExchangeCall(NamedTuple):
    """One rank's side of a call: what must agree across ranks (``root``: reduce's root, reduce_scatter's block
    size, send/recv's peer)."""

    kind: str
    count: int
    dtype: Any
    root: int | None = None

    def __str__(self) -> str:
        who = "" if self.root is None else {"reduce": "root", "reduce_scatter": "per_rank"}.get(self.kind, "peer")
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.kind}({'' if not who else f'{who}={self.root}, '}count={self.count}, dtype={dtype})"


class _Slot:
    """The calls of every rank at one sequence number."""

    __slots__ = ("posts", "error", "done", "taken")

    def __init__(self) -> None:
        self.posts: dict[int, tuple[ExchangeCall, Any]] = {}
        self.error: BaseException | None = None
        self.done = False
        self.taken = 0


class ExchangeWorld:
    """``world_size`` ranks in this process whose collectives really exchange data, so that ranks that diverge
    (different graph ids, schedules, hand-offs, measured choices) show as a mismatch or as wrong numbers.

    Use::

        world = ExchangeWorld(2)
        runtimes = world.run(lambda rank: make_runtime(rank, comm=world.comm(rank)))  # init's all_gather exchanges
        world.run(lambda rank: backward(runtimes[rank], grads[rank]))

    ``run(fn)`` calls ``fn(rank)`` for every rank, each on its own thread, and returns the results by rank; it
    raises the first failure (a cause rather than a peer's consequence; the other ranks' errors are attached as
    notes). ``comm(rank)`` is rank ``rank``'s ``ExchangeComm`` (a ``ReduceComm``; ``calls`` records
    ``(kind, root or peer, count)`` as ``MirrorComm`` does).

    Matching: the n-th collective of every rank (reduce, all_reduce, reduce_scatter, all_gather_ints) is one call and
    must agree in kind, count, dtype and root (reduce) or block size (reduce_scatter); else every rank raises
    ``ExchangeMismatch`` naming the call number and each rank's call. Sends and receives are matched per (sender,
    receiver) pair in order, and must agree in count and dtype; inside a group a rank's sends are posted at the
    group's end, before its receives wait (NCCL's grouped launch lets two ranks exchange). A send never received is
    a mismatch when ``run`` ends.

    Results, computed for real in rank order (every rank gets the same bits): all_reduce sums; reduce sums into the
    root, other ranks' buffers become NaN (undefined in NCCL); reduce_scatter sums each rank's block into that rank's
    buffer, the rest becomes NaN; recv copies what the peer sent.

    Timeouts: a rank waits at most ``timeout_s`` for its peers, and not at all for a peer that already finished
    without joining: ``ExchangeTimeout`` names the missing rank(s) and the call, so a divergent test fails in
    seconds instead of hanging. After a failed ``run`` the world is spent: make a new one.
    """

    def __init__(self, world_size: int, timeout_s: float = 10.0, parent: ExchangeWorld | None = None,
                 members: Sequence[int] = (), role: str = "data-parallel") -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        # A node or rail world (``ExchangeComm._split``) shares its parent's condition and finished ranks: its rank r is
        # the parent's ``members[r]``.
        self.parent = parent
        self.members = tuple(members) if parent is not None else tuple(range(world_size))
        self.role = role
        self._cond = parent._cond if parent is not None else threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._mail: dict[tuple[int, int], deque[tuple[int, torch.Tensor]]] = {}  # (src, dst) -> (send number, data)
        self._finished: dict[int, str] = {}  # rank -> "returned" or "raised ..." (during run)
        self._subworlds: dict[tuple[int, tuple[int, ...]], ExchangeWorld] = {}  # (split number, members) -> world
        self._comms = [ExchangeComm(self, r) for r in range(world_size)]

    def subworld(self, number: int, members: Sequence[int], role: str) -> ExchangeWorld:
        """The world of ``members`` (ranks of this world) made by split number ``number``: one per group, shared by its
        ranks (the first to ask makes it)."""
        key = (number, tuple(members))
        with self._cond:
            world = self._subworlds.get(key)
            if world is None:
                world = self._subworlds[key] = ExchangeWorld(len(members), self.timeout_s, parent=self,
                                                             members=members, role=role)
            return world

    def _finished_rank(self, rank: int) -> str | None:
        """How rank ``rank`` of this world finished its ``run`` (a node or rail world asks its parent)."""
        if self.parent is not None:
            return self.parent._finished_rank(self.members[rank])
        return self._finished.get(rank)

    def comm(self, rank: int) -> ExchangeComm:
        return self._comms[rank]

    @property
    def comms(self) -> list[ExchangeComm]:
        return list(self._comms)

    # ---- running ranks ---------------------------------------------------------------------------------------

    def run(self, fn: Callable[[int], Any], timeout_s: float | None = None) -> list[Any]:
        """``fn(rank)`` on one thread per rank; the results by rank, or the first failure raised."""
        results: list[Any] = [None] * self.world_size
        errors: dict[int, BaseException] = {}
        with self._cond:
            self._finished = {}

        def main(rank: int) -> None:
            try:
                results[rank] = fn(rank)
                outcome = "returned"
            except BaseException as error:  # noqa: BLE001 - reported by run()
                errors[rank] = error
                outcome = f"raised {type(error).__name__}"
            with self._cond:
                self._finished[rank] = outcome
                self._cond.notify_all()

        threads = [threading.Thread(target=main, args=(r,), name=f"exchange-rank-{r}", daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        limit = time.monotonic() + (timeout_s if timeout_s is not None else 6 * self.timeout_s)
        for r, t in enumerate(threads):
            t.join(max(0.0, limit - time.monotonic()))
            if t.is_alive():
                raise ExchangeTimeout(f"ExchangeWorld.run: rank {r} still running after "
                                      f"{timeout_s if timeout_s is not None else 6 * self.timeout_s:g} s")
        if errors:
            causes = [r for r in sorted(errors) if not getattr(errors[r], "peer_failed", False)] or sorted(errors)
            first = errors[causes[0]]
            first.add_note(f"(ExchangeWorld: raised on rank {causes[0]})")
            for r in sorted(errors):
                if r != causes[0]:
                    first.add_note(f"rank {r}: {type(errors[r]).__name__}: {errors[r]}")
            raise first
        self._check_mail_drained()
        return results

    def _check_mail_drained(self) -> None:
        for world in list(self._subworlds.values()):
            world._check_mail_drained()
        with self._cond:
            left = [(src, dst, n, t) for (src, dst), q in self._mail.items() for n, t in q]
            self._mail.clear()
        if left:
            raise ExchangeMismatch("sends never received: " + "; ".join(
                f"rank {src}'s send #{n} to rank {dst} ({t.numel()} elements of {str(t.dtype).removeprefix('torch.')})"
                for src, dst, n, t in left))

    # ---- waiting -----------------------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], bool], missing: Callable[[], list[int]], rank: int, what: str) -> None:
        """Wait (holding the condition) until ``ready()``; fail fast on a peer that finished, else at the timeout."""
        limit = time.monotonic() + self.timeout_s
        where = "" if self.parent is None else f" on the {self.role} communicator"
        while not ready():
            gone = {r: how for r in missing() if (how := self._finished_rank(r)) is not None}
            if gone:
                raise ExchangeTimeout(f"rank {rank}, {what}{where}: "
                                      + ", ".join(f"rank {r} {how}" for r, how in gone.items())
                                      + " without joining it", peer_failed=any(h != "returned" for h in gone.values()))
            remaining = limit - time.monotonic()
            if remaining <= 0:
                raise ExchangeTimeout(f"rank {rank}, {what}{where}: rank(s) {missing()} did not join within "
                                      f"{self.timeout_s:g} s")
            self._cond.wait(min(remaining, 0.05))

    # ---- collectives -------------------------------------------------------------------------------------

    def _collective(self, rank: int, seq: int, call: ExchangeCall, payload: Any) -> Any:
        with self._cond:
            slot = self._slots.setdefault(seq, _Slot())
            slot.posts[rank] = (call, payload)
            if len(slot.posts) == self.world_size and slot.error is None:  # else a rank gave up on it already
                try:
                    slot.done = True
                    self._compute(seq, slot)
                except BaseException as error:  # noqa: BLE001 - every rank raises it
                    slot.error = error
                self._cond.notify_all()
            try:
                if slot.error is None:
                    self._wait(lambda: slot.done or slot.error is not None,
                               lambda: sorted(set(range(self.world_size)) - set(slot.posts)), rank,
                               f"call #{seq + 1} {call}")
            except ExchangeTimeout as error:
                slot.error = error  # ranks that arrive later raise it too
                self._cond.notify_all()
                raise
            finally:
                slot.taken += 1
                if slot.taken == self.world_size:
                    del self._slots[seq]
            if slot.error is not None:
                _raise_copy(slot.error, rank)
            return slot.posts[rank][1]

    def _compute(self, seq: int, slot: _Slot) -> None:
        calls = {r: c for r, (c, _) in sorted(slot.posts.items())}
        if len(set(calls.values())) > 1:
            where = "" if self.parent is None else (f" on the {self.role} communicator of data-parallel ranks "
                                                    f"{', '.join(map(str, self.members))}")
            raise ExchangeMismatch(f"call #{seq + 1}{where} differs across ranks: "
                                   + "; ".join(f"rank {r}: {c}" for r, c in calls.items()))
        kind = calls[0].kind
        data = [slot.posts[r][1] for r in range(self.world_size)]
        if kind == "split":
            return
        if kind == "all_gather_ints":
            rows = [list(values) for values in data]
            for r in range(self.world_size):
                slot.posts[r] = (calls[r], [list(row) for row in rows])
            return
        total = data[0].clone()
        for buf in data[1:]:
            total += buf
        if kind == "all_reduce":
            for buf in data:
                buf.copy_(total)
        elif kind == "reduce":
            root = calls[0].root
            for r, buf in enumerate(data):
                if r == root:
                    buf.copy_(total)
                else:
                    buf.fill_(float("nan"))
        elif kind == "reduce_scatter":
            per_rank = calls[0].root
            for r, buf in enumerate(data):
                block = total[r * per_rank:(r + 1) * per_rank].clone()
                buf.fill_(float("nan"))
                buf[r * per_rank:(r + 1) * per_rank] = block
        else:
            raise ValueError(f"ExchangeWorld: unknown collective {kind}")

    # ---- sends and receives ------------------------------------------------------------------------------

    def _send(self, src: int, dst: int, number: int, buf: torch.Tensor) -> None:
        with self._cond:
            self._mail.setdefault((src, dst), deque()).append((number, buf.detach().clone()))
            self._cond.notify_all()

    def _recv(self, dst: int, src: int, number: int, buf: torch.Tensor) -> None:
        mine = ExchangeCall("recv", buf.numel(), buf.dtype, src)
        with self._cond:
            box = self._mail.setdefault((src, dst), deque())
            self._wait(lambda: bool(box), lambda: [src], dst, f"recv #{number} {mine}")
            sent_number, data = box.popleft()
        if data.numel() != buf.numel() or data.dtype != buf.dtype:
            raise ExchangeMismatch(f"rank {dst}'s recv #{number} {mine} met rank {src}'s send #{sent_number} "
                                   f"{ExchangeCall('send', data.numel(), data.dtype, dst)}")
        buf.copy_(data)


def _raise_copy(error: BaseException, rank: int) -> None:
    """Raise ``error`` (recorded once for a call) on ``rank`` as an exception of its own: one instance is never raised
    on several threads at once."""
    if isinstance(error, ExchangeTimeout):
        raise ExchangeTimeout(str(error), error.peer_failed)
    if isinstance(error, ExchangeMismatch):
        raise ExchangeMismatch(str(error))
    raise RuntimeError(f"rank {rank}: ExchangeWorld failed to compute a call: {type(error).__name__}: {error}")


class ExchangeComm(ReduceComm):
    """Rank ``rank`` of an ``ExchangeWorld`` (see there): a communicator whose calls really meet the other ranks'."""

    name = "exchange"

    def __init__(self, world: ExchangeWorld, rank: int) -> None:
        super().__init__(rank, world.world_size)
        self.world = world
        self.calls: list[tuple[str, int | None, int]] = []
        self.groups = 0
        self.open_groups = 0
        self.buffer_releases = 0
        self._seq = 0  # collectives issued
        self._sent: dict[int, int] = {}  # peer -> sends issued to it
        self._received: dict[int, int] = {}
        self._p2p: list[tuple[bool, torch.Tensor, int]] = []  # (send, buf, peer) deferred to the group's end

    def _collective(self, call: ExchangeCall, payload: Any) -> Any:
        seq, self._seq = self._seq, self._seq + 1
        return self.world._collective(self.rank, seq, call, payload)

    def _group_start(self) -> None:
        self.groups += 1
        self.open_groups += 1

    def _group_end(self) -> None:
        self.open_groups -= 1
        ops, self._p2p = self._p2p, []
        for send, buf, peer in ops:  # sends first: two ranks exchanging must not wait on each other's receive
            if send:
                self._post_send(buf, peer)
        for send, buf, peer in ops:
            if not send:
                self._do_recv(buf, peer)

    def reduce(self, buf: torch.Tensor, root: int) -> None:
        self.calls.append(("reduce", root, buf.numel()))
        self._collective(ExchangeCall("reduce", buf.numel(), buf.dtype, root), buf)

    def all_reduce(self, buf: torch.Tensor) -> None:
        self.calls.append(("all_reduce", None, buf.numel()))
        self._collective(ExchangeCall("all_reduce", buf.numel(), buf.dtype), buf)

    def reduce_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        check_scatter(self, buf, per_rank)
        self.calls.append(("reduce_scatter", None, buf.numel()))
        self._collective(ExchangeCall("reduce_scatter", buf.numel(), buf.dtype, per_rank), buf)

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self.calls.append(("send", peer, buf.numel()))
        if self.in_group:
            self._p2p.append((True, buf, peer))
        else:
            self._post_send(buf, peer)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self.calls.append(("recv", peer, buf.numel()))
        if self.in_group:
            self._p2p.append((False, buf, peer))
        else:
            self._do_recv(buf, peer)

    def _post_send(self, buf: torch.Tensor, peer: int) -> None:
        number = self._sent[peer] = self._sent.get(peer, 0) + 1
        self.world._send(self.rank, peer, number, buf)

    def _do_recv(self, buf: torch.Tensor, peer: int) -> None:
        number = self._received[peer] = self._received.get(peer, 0) + 1
        self.world._recv(self.rank, peer, number, buf)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return self._collective(ExchangeCall("all_gather_ints", len(values), "int64"), list(values))

    def _split(self, groups: Sequence[Sequence[int]]) -> ExchangeComm:
        """This rank's group as a world of its own, whose calls really exchange among its ranks (and are checked call
        by call there); the split itself is one call of this world, so ranks that split differently mismatch."""
        mine = next((g for g in groups if self.rank in g), None)
        if mine is None:
            raise ValueError(f"rank {self.rank} is in none of the groups {[list(g) for g in groups]}")
        number = self._splits = getattr(self, "_splits", 0) + 1
        shape = hash(tuple(tuple(g) for g in groups)) & 0xFFFFFFFF
        self._collective(ExchangeCall("split", len(groups), "groups", shape), None)
        world = self.world.subworld(number, mine, self._split_role)
        return world.comm(list(mine).index(self.rank))

    def split(self, groups: Sequence[Sequence[int]], role: str) -> ReduceComm:
        self._split_role = role  # the sub-world's name in its mismatch messages
        return super().split(groups, role)

    def release_buffers(self) -> None:
        self.buffer_releases += 1


def exchange_runtimes(world: ExchangeWorld, owner_map: OwnerMap, graph_ids: Sequence[int], **kwargs: Any) -> list:
    """One runtime per rank of ``world`` on ``owner_map`` (``mirror_runtime``'s registration, ``kwargs`` as there),
    rank r's graph registered as ``graph_ids[r]``; their ``init`` runs the real all_gather agreement."""
    return world.run(lambda rank: mirror_runtime(owner_map, rank=rank, graph_id=graph_ids[rank],
                                                 comm=world.comm(rank), **kwargs)[0])


# ws=2, partition_size 8: a(6) -> r0, b(5) straddles [0:2]->r0 [2:5]->r1, c(5) -> r1
NUMELS = {0: 6, 1: 5, 2: 5}
TABLES = GroupTables(group=0, param_ids=(0, 1, 2), numels=(6, 5, 5), partition_count=2,
                     partition_ids={0: (0,), 1: (0, 1), 2: (1,)},
                     start_offsets={0: {0: 0, 1: 0}, 1: {1: 2, 2: 0}}, same_comm_as_dp=True)


def exchange_backward(world: ExchangeWorld, runtimes: Sequence[Any], grads_of: Callable[[int], dict[int, torch.Tensor]],
                      graph: int, order: Sequence[int],
                      check: Callable[[torch.Tensor, torch.Tensor, str], None]) -> None:
    """One backward on every rank of ``world`` (rank ``r``'s gradients ``grads_of(r)``, fed in ``order``), then every
    rank's grad buffers against the true reduced gradient (the mean over ranks, as pre-division makes it), each by
    ``check(got, want, "rank R, param P")``."""
    def backward(rank: int) -> None:
        rt, grads = runtimes[rank], grads_of(rank)
        rt.start_backward(True)
        for pid in order:
            rt.reduce_grad(grads[pid], graph, pid)
        rt.end_backward(graph, False)

    world.run(backward)
    ws = len(runtimes)
    every = [grads_of(r) for r in range(ws)]
    for rank, rt in enumerate(runtimes):
        for pid, param in rt._params.items():
            buf = param.grad_buffer
            if buf.numel():
                want = sum(g[pid] / ws for g in every)[param.offset:param.offset + buf.numel()]
                check(buf, want, f"rank {rank}, param {pid}")


def ws2_runtime(rank=0, owner=True, probe=True, bucket=64, problems=(), comm=None, algo="reduce", all_ranks=False):
    """A runtime of rank ``rank`` of 2 on ``TABLES``, grad buffers registered as DeepCompile does (rank 0: a whole,
    b's first 2 elements at offset 0, nothing of c), graph 11; ``algo`` forces the flush algorithm (these flushes
    are tiny: the cost model alone would AllReduce them)."""
    return mirror_runtime(OwnerMap.from_group_tables([TABLES], 2), rank=rank, bucket=bucket, algo=algo, probe=probe,
                          owner=owner, problems=problems, comm=comm, all_ranks=all_ranks)


def shared_gpu_env(world_size: int, torch_pg: bool = False) -> dict[str, str]:
    """The environment for ``world_size`` NCCL ranks on this machine's GPUs, or a skip. Ranks outnumbering the GPUs
    share them, which needs NCCL >= 2.30 and its opt-in (``NCCL_MULTI_RANK_GPU_ENABLE``) in cupy's NCCL, and also in
    torch's when the ranks' process group is NCCL (``torch_pg``). Each rank's device is its index among the visible
    GPUs (``harness.launch.local_device``), never its rank."""
    import pytest

    from owner_reduce.runtime import nccl_binding

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() >= world_size:
        return {}
    versions = {"cupy": nccl_binding.nccl_runtime_version()}
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
                   problems=(), comm=None, measure=False, calibration=None, env_problems=(), verdicts=None,
                   verdicts_path=None, timeout_s=None, all_ranks=False):
    """A runtime of rank ``rank`` on ``owner_map`` with a ``MirrorComm`` (or ``comm``), every parameter registered as
    DeepCompile registers it (this rank's slice of each gradient as its grad buffer), one graph of every parameter.

    ``measure`` is off by default here, unlike in the product: these unit tests count the exact calls of the model's
    choice in every step; the measured guard (which alternates native's calls for six steps) has its own tests
    (``test_measured_guard.py``, and the end-to-end runs, which keep the product's default)."""
    from owner_reduce.planning.rank_inputs import RankInputs
    from owner_reduce.planning.settings import AUTO, MODEL, OwnerReduceSettings
    from owner_reduce.runtime.handle import OwnerReduceRuntime

    comm = comm or MirrorComm(rank=rank, world_size=owner_map.dp_world_size)
    settings = OwnerReduceSettings(OwnerReduceFlags(owner, probe, all_ranks),
                                   algo=MODEL if algo == AUTO and not measure else algo, timeout_s=timeout_s)
    inputs = RankInputs(calibration=calibration, verdicts=verdicts, verdicts_path=verdicts_path, problems=env_problems)
    rt = OwnerReduceRuntime(settings, owner_map, lambda group: comm, inputs=inputs, map_problems=problems)
    rt.init(None, types.SimpleNamespace(double_buffer=True), bucket)
    for p in owner_map:
        mine = [s for s in p.slices if s.owner == rank and s.length]
        buf, offset = (torch.zeros(mine[0].length), mine[0].offset) if mine else (torch.empty(0), 0)
        rt.register_param(p.param_id, (p.numel,), torch.zeros(p.numel), buf, offset)
    (rt.register_graph_z2 if stage == 2 else rt.register_graph_z1)(graph_id, [p.param_id for p in owner_map])
    return rt, comm


def exchange_thread_rank() -> int:
    """The rank of the ``ExchangeWorld`` thread running now (its name is ``exchange-rank-R``)."""
    name = threading.current_thread().name
    if not name.startswith("exchange-rank-"):
        raise RuntimeError(f"not an ExchangeWorld rank's thread: {name}")
    return int(name.removeprefix("exchange-rank-"))


def group_threads_as_nodes(monkeypatch: Any, per_node: int) -> None:
    """In-process ranks as nodes of ``per_node`` in launcher order: each thread's rank R reports the host name
    ``node-<R // per_node>``, local rank R % per_node and ``LOCAL_WORLD_SIZE`` ``per_node`` to the runtime's agreement
    (what torchrun sets per process on several hosts)."""
    from owner_reduce.runtime import agreement

    monkeypatch.setattr(agreement, "host_name", lambda: f"node-{exchange_thread_rank() // per_node}")
    monkeypatch.setattr(agreement, "local_rank", lambda environ=None: exchange_thread_rank() % per_node)
    monkeypatch.setattr(agreement, "launcher_ranks_per_node", lambda environ=None: (0, per_node))


def rows_in_nodes(values: list[int], world_size: int, per_node: int) -> list[list[int]]:
    """Every rank's row of a gather of ``values``, where ``values`` is this rank's init-time agreement row (any other
    gather: ``values`` for every rank), as ranks in nodes of ``per_node`` in launcher order send it: rank R with its
    global rank, local rank R % per_node and the host name ``node-<R // per_node>`` (a mirror communicator's world,
    which one process plays)."""
    from dataclasses import replace

    from owner_reduce.planning.nodes import pack_host
    from owner_reduce.runtime.agreement import PROTOCOL, ROW_LENGTH, AgreementRow
    from owner_reduce.runtime.topology import host_digest

    if len(values) != ROW_LENGTH or values[0] != PROTOCOL:
        return [list(values) for _ in range(world_size)]
    mine = AgreementRow.unpack(values)
    return [replace(mine, local_rank=r % per_node, host_digest=host_digest(f"node-{r // per_node}"), global_rank=r,
                    host=tuple(pack_host(f"node-{r // per_node}"))).pack() for r in range(world_size)]
