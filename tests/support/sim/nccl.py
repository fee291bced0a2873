"""The simulated NCCL behind ``sim_cuda``: the parts of ``cupy``, ``cupy.cuda``, ``cupy.cuda.nccl`` and
``cupy.cuda.runtime`` the product uses, with NCCL's blocking and abort semantics.

- ``NcclCommunicator(ndev, uid, rank)`` blocks until every rank of ``uid`` joined (``ncclCommInitRank``); with
  ``NCCL_COMM_BLOCKING=0`` it fails as cupy 14 does on NCCL's ``ncclInProgress`` (``KeyError: 7``).
- Calls (``reduce``, ``allReduce``, ``reduceScatter``, ``allGather``, ``broadcast``, ``send``, ``recv``) take device
  pointers (resolved through the sim's allocation registry), NCCL's enum values and a stream handle, with cupy 14.2's
  signatures and argument conversion (``cython_args``: ``tests/sim/test_sim_conformance.py`` holds them to the installed
  binding). Outside a group a call is one kernel; ``groupStart``/``groupEnd`` nest per thread, and a group's calls on
  one communicator are one kernel (a failed call inside a group makes ``groupEnd`` report its error again and launch
  nothing). A call of an open group over bytes another call of that group writes or reads while one of them writes,
  or one call whose send and receive overlap other than in NCCL's in-place forms, raises ``SimOverlap``.
- Matching: collectives by the communicator's call sequence (kind, count, dtype, op, root or per-rank block), sends and
  receives per (sender, receiver) pair in order (count, dtype). Ranks that disagree are reported when the last of them
  issues the call (``SimMismatch`` on that rank's host, naming every rank's call; the others' kernels fail with
  ``ncclInvalidUsage`` as an asynchronous error), and kept in ``sim.mismatches``.
- A kernel reaches its stream's head, then spins until every member of its calls has reached the matching call;
  then the data moves for real (sums in rank order: every rank gets the same bits) and it completes. A
  communicator's kernels run in launch order even across streams (NCCL serializes a communicator's work). A launch
  blocks the host while ``fifo_bound`` kernels of the communicator are pending (``enqueue.cc``
  ``waitWorkFifoAvailable``).
- ``abort()`` sets the abort flag (spinning and later kernels of that communicator exit with an error), then waits for
  the communicator's last queued kernel, as ``commDestroySync`` does: it hangs (``SimHang``) when that kernel sits
  behind another communicator's spinning kernel. ``destroy()`` waits for its kernels to finish normally. Neither
  ever raises (cupy declares both ``void``): there is no fault to inject into them.
  ``check_async_error()`` raises after an injected or remote error; ``abort_reaches_peers`` says whether an abort
  reaches the other members as ``ncclRemoteError`` (a network) or not (NVLink: they spin until their own abort).
  Aborting a communicator that an open group of some thread holds frees it under that group: its ``groupEnd`` then
  crashes (``SimUseAfterFree``), as NCCL 2.21-2.28's would use freed memory.
- Faults (``sim.nccl.inject``): a call that raises (``NcclError`` codes), a kernel that never completes, an
  asynchronous error; ``sim.nccl.process_exit(rank)`` runs what cupy's ``__dealloc__`` does at exit (``destroy`` on
  every communicator still open).
- Multi-process ranks (``Sim(transport="processes")``): the unique id names a hub (``sim_nccl_transport``) that
  carries joins, arrivals and data between the processes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import os
import secrets
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.sim import cuda as sim_cuda
from tests.support.sim import hb_cuda

hb_cuda.skip_file(__file__)

UNIQUE_ID_BYTES = 128
# Device memory a lazy connection setup takes in the sim (``SimNccl._connect``): round figures of the sim's own, so that
# a connection made at init and one made in a flush differ in ``mem_get_info``; NCCL's depend on protocols, channels
# and transports.
CONNECT_BYTES = {"coll": 16 << 20, "p2p": 4 << 20}
VERSION = 23003  # what get_version() answers: NCCL 2.30.3
MAGIC = b"SIMNCCL"

# NCCL's enum values (nccl.h), as cupy exposes them
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

TORCH_DTYPES = {NCCL_INT8: torch.int8, NCCL_UINT8: torch.uint8, NCCL_INT32: torch.int32, NCCL_UINT32: torch.uint32,
                NCCL_INT64: torch.int64, NCCL_UINT64: torch.uint64, NCCL_FLOAT16: torch.float16,
                NCCL_FLOAT32: torch.float32, NCCL_FLOAT64: torch.float64, NCCL_BFLOAT16: torch.bfloat16}
CALL_KINDS = frozenset({"reduce", "allReduce", "reduceScatter", "allGather", "broadcast", "send", "recv"})
OP_NAMES = {NCCL_SUM: "sum", NCCL_PROD: "prod", NCCL_MAX: "max", NCCL_MIN: "min", NCCL_AVG: "avg"}

# ncclResult_t; cupy 14's NcclError knows 0-6 only (its ERROR_NAMES): 7, ncclInProgress, raises KeyError
SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = range(7)
IN_PROGRESS = 7
_ERROR_NAMES = {0: "NCCL_ERROR_SUCCESS", 1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR",
                3: "NCCL_ERROR_INTERNAL_ERROR", 4: "NCCL_ERROR_INVALID_ARGUMENT", 5: "NCCL_ERROR_INVALID_USAGE",
                6: "NCCL_ERROR_REMOTE_ERROR"}
_ERROR_STRINGS = {0: "no error", 1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
                  2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
                  3: "internal error - please report this issue to the NCCL developers",
                  4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
                  5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
                  6: "remote process exited or there was a network error", 7: "NCCL operation in progress"}


class NcclError(RuntimeError):
    """cupy 14's ``NcclError``: ``NCCL_ERROR_REMOTE_ERROR: remote process exited ...``; a status it has no name for
    (7, ``ncclInProgress``) raises ``KeyError`` from its constructor, as cupy's does."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"{_ERROR_NAMES[status]}: {_ERROR_STRINGS[status]}")

    def __reduce__(self) -> Any:
        return (type(self), (self.status,))


def check_status(status: ncclResult_t) -> None:
    if status != SUCCESS:
        raise NcclError(status)


class SimMismatch(AssertionError):
    """Ranks issued different calls at one point of a communicator's sequence (what NCCL hangs on or computes garbage
    from)."""


class SimUseAfterFree(BaseException):
    """A group ended over a communicator that ``abort()`` freed while the group held it (a crash on a GPU)."""


class SimOverlap(BaseException):
    """A call, or two calls of one group, over overlapping buffers other than NCCL's in-place forms: NCCL runs them at
    once, and the result is undefined (garbage on a GPU, no error). A BaseException, as ``SimHang``: the product cannot
    handle it into an error of its own; each one is also kept in ``sim.nccl.overlaps``."""


def _sim() -> Any:
    return sim_cuda._sim()


# ---- calls, matches, kernels --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """What must agree across ranks (``arg``: reduce's and broadcast's root, reduceScatter's per-rank count, a
    send's or recv's peer)."""

    kind: str
    count: int
    dtype: int
    op: int | None = None
    arg: int | None = None

    def __str__(self) -> str:
        label = {"reduce": "root", "broadcast": "root", "reduceScatter": "recvcount", "send": "peer",
                 "recv": "peer"}.get(self.kind)
        dtype = str(TORCH_DTYPES.get(self.dtype, self.dtype)).removeprefix("torch.")
        parts = ([f"{label}={self.arg}"] if label else []) + [f"count={self.count}", f"dtype={dtype}"]
        if self.op is not None and self.op != NCCL_SUM:
            parts.append(f"op={OP_NAMES.get(self.op, self.op)}")
        return f"{self.kind}({', '.join(parts)})"

    @property
    def matched_as(self) -> tuple[Any, ...]:
        if self.kind in ("send", "recv"):
            return ("send/recv", self.count, self.dtype)
        return (self.kind, self.count, self.dtype, self.op, self.arg)


@dataclass(eq=False)
class Post:
    """One rank's side of a call: its buffers, its kernel, whether that kernel reached it."""

    member: Member
    call: Call
    send: tuple[torch.Tensor, int, int, int] | None  # (the allocation's bytes, byte offset, bytes, its address):
    recv: tuple[torch.Tensor, int, int, int] | None  # not the SimStorage, whose death is the allocator's free
    match: Match | None = None
    kernel: Any = None  # the sim_cuda.Op it runs in
    arrived: bool = False
    time: float = 0.0  # virtual arrival
    done: bool = False
    withdrawn: bool = False  # its kernel exited (abort) before the call ran

    def view(self, which: str) -> torch.Tensor:
        data, offset, nbytes, _ = self.send if which == "send" else self.recv
        return data[offset:offset + nbytes].view(TORCH_DTYPES[self.call.dtype])


@dataclass(eq=False)
class Match:
    """The calls of every rank at one point: a collective's sequence number, or the n-th send/recv of a pair."""

    key: tuple[Any, ...]
    expected: tuple[int, ...]
    posts: dict[int, Post] = field(default_factory=dict)
    failed: str | None = None
    executed: bool = False
    time: float = 0.0


@dataclass(eq=False)
class Kernel:
    member: Member
    posts: list[Post]
    stalled: bool = False
    duration: float = 0.0


class Group:
    """The ranks of one unique id (in process): their members and the calls matched between them."""

    _numbers = itertools.count(1)

    def __init__(self, nccl: SimNccl, uid: bytes, nranks: int) -> None:
        self.nccl = nccl
        self.uid = uid
        self.nranks = nranks
        self.number = next(self._numbers)
        self.members: dict[int, Member] = {}
        self.matches: dict[tuple[Any, ...], Match] = {}
        self.delay_s = 0.0  # added to every kernel of this communicator (virtual)
        self.label = f"communicator #{self.number} ({nranks} ranks)"
        self.connecting: dict[tuple[Any, ...], set[int]] = {}  # a connection -> the ranks that reached its setup

    def post(self, post: Post, key: tuple[Any, ...], expected: tuple[int, ...]) -> None:
        """Register ``post``; when every expected rank has posted, check that they agree (raises SimMismatch)."""
        match = self.matches.get(key)
        if match is None:
            match = self.matches[key] = Match(key, expected)
        match.posts[post.member.rank] = post
        post.match = match
        if len(match.posts) == len(match.expected) and match.failed is None:
            calls = {r: p.call for r, p in match.posts.items()}
            if len({c.matched_as for c in calls.values()}) > 1 or not self._p2p_agrees(match):
                what = (f"call #{key[1] + 1}" if key[0] == "coll" else
                        f"send #{key[3] + 1} from rank {key[1]} to rank {key[2]}")
                text = (f"{what} on {self.label} differs across ranks: "
                        + "; ".join(f"rank {r}: {calls[r]}" for r in sorted(calls)))
                match.failed = text
                self.nccl.mismatches.append(text)
                for p in match.posts.values():
                    p.member.changed()
                raise SimMismatch(text)

    def joined(self, member: Member) -> None:
        """ncclCommInitRank returns once every rank joined."""
        def missing() -> list[int]:
            return [r for r in range(self.nranks) if r not in self.members]

        self.nccl.sim._host_wait(lambda: not missing(), [member], f"ncclCommInitRank (rank {member.rank} of "
                                 f"{self.nranks}) on {self.label}, waiting for ranks {missing()} to join")

    @staticmethod
    def _p2p_agrees(match: Match) -> bool:
        if match.key[0] != "p2p":
            return True
        src, dst = match.key[1], match.key[2]
        send, recv = match.posts[src].call, match.posts[dst].call
        return send.kind == "send" and recv.kind == "recv" and send.arg == dst and recv.arg == src

    def try_execute(self, match: Match) -> None:
        """Move the data once every rank's kernel has reached the call (holding the sim's lock)."""
        if match.failed is not None or match.executed or len(match.posts) < len(match.expected):
            return
        posts = [match.posts[r] for r in sorted(match.posts)]
        if not all(p.arrived and not p.withdrawn for p in posts):
            return
        _execute(posts)
        match.executed = True
        match.time = max(p.time for p in posts)
        for p in posts:
            p.done = True
            p.member.changed()


def _execute(posts: list[Post]) -> None:
    """The data movement of one matched call, every rank's buffers at hand (ranks in order)."""
    call = posts[0].call
    kind = call.kind
    if kind in ("send", "recv"):
        send = next(p for p in posts if p.call.kind == "send")
        recv = next(p for p in posts if p.call.kind == "recv")
        recv.view("recv").copy_(send.view("send"))
        return
    if kind == "allGather":
        gathered = torch.cat([p.view("send").clone() for p in posts])
        for p in posts:
            p.view("recv").copy_(gathered)
        return
    if kind == "broadcast":
        value = next(p for p in posts if p.member.rank == call.arg).view("send").clone()
        for p in posts:
            p.view("recv").copy_(value)
        return
    acc = posts[0].view("send").clone()
    for p in posts[1:]:
        v = p.view("send")
        if call.op in (NCCL_SUM, NCCL_AVG):
            acc += v
        elif call.op == NCCL_PROD:
            acc *= v
        elif call.op == NCCL_MAX:
            torch.maximum(acc, v, out=acc)
        else:
            torch.minimum(acc, v, out=acc)
    if call.op == NCCL_AVG:
        acc /= len(posts)
    if kind == "allReduce":
        for p in posts:
            p.view("recv").copy_(acc)
    elif kind == "reduce":
        next(p for p in posts if p.member.rank == call.arg).view("recv").copy_(acc)
    elif kind == "reduceScatter":
        n = call.count
        for p in posts:
            p.view("recv").copy_(acc[p.member.rank * n:(p.member.rank + 1) * n])
    else:  # pragma: no cover - every kind is above
        raise AssertionError(kind)


def _overlap(a: tuple[torch.Tensor, int, int, int], b: tuple[torch.Tensor, int, int, int]) -> bool:
    """Two (bytes, offset, nbytes, allocation address) regions share a byte."""
    return a[3] == b[3] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]


def _in_place(post: Post) -> bool:
    """NCCL's in-place forms of one call (its user guide, "In-place operations")."""
    kind, send, recv = post.call.kind, post.send, post.recv
    rank = post.member.rank
    if kind in ("reduce", "allReduce", "broadcast"):
        return send[1] == recv[1] and send[2] == recv[2]
    if kind == "reduceScatter":
        return recv[1] == send[1] + rank * recv[2]
    if kind == "allGather":
        return send[1] == recv[1] + rank * send[2]
    return False


class Member(sim_cuda._Watched):
    """One rank's communicator state (what the NCCL handle points at), kept by the sim while the communicator lives;
    the cupy-facing ``NcclCommunicator`` holds it."""

    __slots__ = ("__dict__",)

    def __init__(self, nccl: SimNccl, group: Any, rank: int, process: Any, device: int, index: int) -> None:
        super().__init__()
        self.nccl = nccl
        self.group = group
        self.rank = rank
        self.process = process
        self.device = device
        self.index = index  # its creation number in its process (0: the first communicator it made)
        self.aborted = False
        self.freed = False  # abort or destroy released it (cupy forgets the handle)
        self.destroyed = False
        self.async_error: int | None = None
        self.kernels: collections.deque[Any] = collections.deque()  # launched, not yet completed
        self.last_kernel: Any = None
        self.coll_seq = 0
        self.p2p_seq: collections.Counter[tuple[int, int]] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()  # issued, by kind
        self.stall_from: int | None = None  # its kernels from this number on never complete (a fault)
        self.launched = 0
        self.delay_s = 0.0
        self.connected: set[tuple[Any, ...]] = set()  # ("coll", kind) or ("p2p", peer): set up (lazy connection)

    @property
    def label(self) -> str:
        return f"rank {self.rank} of {self.group.label} (rank {self.process.rank}'s communicator #{self.index})"

    def __repr__(self) -> str:
        return f"<sim NCCL member {self.label}>"


@dataclass
class _Fault:
    kind: str
    status: int
    rank: int | None
    comm: int | None
    nth: int
    seen: int = 0
    once: bool = True


class _GroupState:
    """One thread's open NCCL group (ncclGroupStart nests per thread)."""

    def __init__(self) -> None:
        self.depth = 0
        self.calls: list[tuple[Member, Post, Any]] = []
        self.error: int | None = None
        self.linked: list[Member] = []


# ---- the module-level state ------------------------------------------------------------------------------------


class SimNccl:
    """NCCL of one ``Sim`` (``sim.nccl``). ``fifo_bound``: pending kernels per communicator before a launch blocks
    the host (0: every launch blocks, with nothing in flight, as a launch stuck on the host in a lazy connection to a
    dead peer, until the hang bound); ``abort_reaches_peers``: an abort reaches the other members as
    ``ncclRemoteError`` (a network) or not (NVLink); ``latency_s``/``bandwidth``: each call's virtual duration
    (``latency_s + bytes / bandwidth``, or ``cost(call, nbytes, nranks)``); ``transport``: "threads" (ranks in this
    process) or "processes" (a hub)."""

    def __init__(self, sim: Any, *, fifo_bound: int = 1024, abort_reaches_peers: bool = False, latency_s: float = 0.0,
                 bandwidth: float = float("inf"), cost: Callable[[Call, int, int], float] | None = None,
                 transport: str = "threads", device_wide_free: bool = False, lazy_connect: bool = True) -> None:
        self.sim = sim
        self.device_wide_free = device_wide_free
        self.lazy_connect = lazy_connect
        # (process rank, the communicator's label, ("coll", kind) or ("p2p", peer), the NCCL call that set it up)
        self.connections: list[tuple[int, str, tuple[Any, ...], str]] = []
        self.fifo_bound = fifo_bound
        self.abort_reaches_peers = abort_reaches_peers
        self.latency_s = latency_s
        self.bandwidth = bandwidth
        self.cost = cost
        self.transport = transport
        self.mismatches: list[str] = []
        self.trace: list[tuple[int, str]] = []  # (process rank, "groupStart" / "reduce" / "reduce failed" ...)
        self.use_after_free: list[str] = []
        self.overlaps: list[str] = []  # every SimOverlap raised
        self.misaligned: list[str] = []
        self._groups: dict[bytes, Any] = {}
        self._members: list[Member] = []
        self._faults: list[_Fault] = []
        self._on_create: list[Callable[[Member], None]] = []
        self._tls = threading.local()
        self._threads_groups: dict[int, _GroupState] = {}  # threads with an open group
        self._saved_modules: dict[str, Any] = {}
        self._hub: Any = None

    # ---- the test's side -------------------------------------------------------------------------------------

    def comms(self, rank: int | None = None) -> list[Member]:
        """Every communicator made (by ``rank``'s process), in creation order."""
        return [m for m in self._members if rank is None or m.process.rank == rank]

    def inject(self, kind: str, status: int = SYSTEM_ERROR, *, rank: int | None = None, comm: int | None = None,
               nth: int = 1, once: bool = True) -> None:
        """The ``nth`` call of ``kind`` ("reduce", "allReduce", ..., "*" for any of those, "groupStart", "groupEnd",
        "init") on ``rank``'s process (any) and its communicator number ``comm`` (any; numbered in creation order on
        that process) raises ``NcclError(status)``, counted from now. Not "abort" nor "destroy": cupy's binding
        declares ``ncclCommAbort``/``ncclCommDestroy`` ``void`` and ignores their status, so neither ever raises on
        the real stack (one that does not return: a kernel it waits for never finishes, ``stall``)."""
        if kind in ("abort", "destroy"):
            raise ValueError(f"sim.nccl.inject({kind!r}): cupy's {kind}() never raises (nccl.pyx declares "
                             f"ncclComm{kind.capitalize()} void and ignores its status); to keep it from returning, "
                             f"stall a kernel it waits for")
        self._faults.append(_Fault(kind, status, rank, comm, nth, once=once))

    def stall(self, member: Member, from_kernel: int = 1) -> None:
        """``member``'s kernels from its ``from_kernel``-th (counting from 1 at its first launch) never complete:
        they spin until the communicator is aborted, as a hung GPU kernel."""
        member.stall_from = member.launched + from_kernel if from_kernel > 0 else 1

    def async_error(self, member: Member, status: int = REMOTE_ERROR) -> None:
        with self.sim.lock:
            member.async_error = status
            member.changed()

    def on_create(self, hook: Callable[[Member], None]) -> None:
        """``hook(member)`` for every communicator made from now on (a fault for one not made yet)."""
        self._on_create.append(hook)

    def process_exit(self, rank: int) -> None:
        """What cupy's ``NcclCommunicator.__dealloc__`` does for every communicator still open at exit of ``rank``'s
        process: ``ncclCommDestroy``, which waits for its kernels. The first SimHang is raised after trying all."""
        first: BaseException | None = None
        for member in self.comms(rank):
            if not member.freed:
                try:
                    self._destroy(member)
                except BaseException as error:  # noqa: BLE001 - every communicator is tried
                    first = first or error
        if first is not None:
            raise first

    # ---- the sim's side --------------------------------------------------------------------------------------

    def install_modules(self) -> None:
        modules = make_modules()
        for name, module in modules.items():
            self._saved_modules[name] = sys.modules.get(name)
            sys.modules[name] = module

    def uninstall_modules(self) -> None:
        for name, module in self._saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        self._saved_modules.clear()
        if self._hub is not None:
            self._hub.close()
            self._hub = None

    def stopped(self) -> None:
        for member in self._members:
            member.changed()

    def state(self) -> str:
        """Calls some rank's kernel spins on, and who has not reached them (the SimHang message's diagnosis)."""
        waiting = []
        for group in {m.group for m in self._members}:
            for match in getattr(group, "matches", {}).values():
                if match.executed or match.failed:
                    continue
                arrived = [r for r, p in match.posts.items() if p.arrived and not p.withdrawn]
                if arrived:
                    missing = [r for r in match.expected if r not in arrived]
                    call = next(iter(match.posts.values())).call
                    waiting.append(f"{call} on {group.label}: ranks {arrived} spin, ranks {missing} have not "
                                   f"reached it")
        return ("NCCL: " + "; ".join(waiting[:6])) if waiting else ""

    def waiting_for(self, op: Any) -> str:
        kernel: Kernel = op.nccl
        if kernel.stalled:
            return "(a stalled NCCL kernel: never completes until aborted)"
        for post in kernel.posts:
            if not post.done and post.match is not None:
                missing = [r for r in post.match.expected
                           if r not in post.match.posts or not post.match.posts[r].arrived]
                return f"spins in {post.call} on {kernel.member.group.label}, waiting for ranks {missing}"
        return "is running"

    def run_kernel(self, op: Any) -> None:
        """The worker of ``op``'s stream runs an NCCL kernel (holding the sim's lock): arrive, spin until every call
        of it has run or the communicator is aborted."""
        sim = self.sim
        kernel: Kernel = op.nccl
        member = kernel.member
        try:
            if member.aborted or member.freed:
                op.failed = "aborted"
                return
            if kernel.stalled:
                sim._wait_locked(lambda: member.aborted, [member], None)
                op.failed = "aborted"
                return
            for post in kernel.posts:
                post.arrived = True
                post.time = op.start
            for post in kernel.posts:
                member.group.try_execute(post.match)

            def finished() -> bool:
                return member.aborted or all(p.done for p in kernel.posts) or any(
                    p.match is not None and p.match.failed for p in kernel.posts)

            sim._wait_locked(finished, [member], None)
            if all(p.done for p in kernel.posts):
                start = max(p.match.time for p in kernel.posts)
                op.end = start + kernel.duration + member.group.delay_s + member.delay_s
            elif member.aborted:
                op.failed = "aborted"
                for p in kernel.posts:
                    p.withdrawn = True
            else:
                op.failed = next(p.match.failed for p in kernel.posts if p.match is not None and p.match.failed)
                member.async_error = member.async_error or INVALID_USAGE
                for p in kernel.posts:
                    p.withdrawn = True
        finally:
            if member.kernels and member.kernels[0] is op:
                member.kernels.popleft()
            else:
                with contextlib.suppress(ValueError):
                    member.kernels.remove(op)
            member.changed()

    def _group_state(self) -> _GroupState:
        state = getattr(self._tls, "state", None)
        if state is None:
            state = self._tls.state = _GroupState()
        return state

    # ---- faults ----------------------------------------------------------------------------------------------

    def _fault(self, kind: str, member: Member | None) -> int | None:
        process = member.process if member is not None else self.sim._this_process()
        for fault in self._faults:
            if fault.kind != kind and not (fault.kind == "*" and kind in CALL_KINDS):
                continue
            if fault.rank is not None and fault.rank != process.rank:
                continue
            if fault.comm is not None and (member is None or member.index != fault.comm):
                continue
            fault.seen += 1
            if fault.seen == fault.nth or not fault.once and fault.seen >= fault.nth:
                return fault.status
        return None

    def _raise_fault(self, kind: str, member: Member | None, trace: bool = True) -> None:
        status = self._fault(kind, member)
        if status is not None:
            if trace:
                self._trace(f"{kind} failed", member)
            raise NcclError(status)

    def _trace(self, what: str, member: Member | None = None) -> None:
        process = member.process if member is not None else self.sim._this_process()
        self.trace.append((process.rank, what))
        process.counters[f"nccl {what}"] += what in ("groupStart", "groupEnd")

    def calls_of(self, rank: int = 0) -> list[str]:
        """``rank``'s NCCL calls in order (``reduce``, ``groupEnd failed``, ``abort`` ...)."""
        return [what for r, what in self.trace if r == rank]

    # ---- cupy's calls ----------------------------------------------------------------------------------------

    def new_member(self, ndev: int, uid: bytes, rank: int) -> Member:
        sim = self.sim
        process = sim._this_process()
        sim._context("ncclCommInitRank")
        self._raise_fault("init", None)
        if os.environ.get("NCCL_COMM_BLOCKING", "1").strip() == "0":
            raise NcclError(IN_PROGRESS)  # cupy 14: KeyError: 7 (a non-blocking init returns ncclInProgress)
        if len(uid) != UNIQUE_ID_BYTES or not uid.startswith(MAGIC):
            raise NcclError(INVALID_ARGUMENT)
        if not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT)
        with sim.lock:
            group = self._groups.get(uid)
            if group is None:
                group = self._groups[uid] = self._make_group(uid, ndev)
            if group.nranks != ndev or rank in group.members:
                raise NcclError(INVALID_USAGE)
            index = sum(1 for m in self._members if m.process is process)
            member = Member(self, group, rank, process, process.device, index)  # on the thread's current device
            group.members[rank] = member
            self._members.append(member)
            for m in group.members.values():
                m.changed()
        for hook in self._on_create:
            hook(member)
        group.joined(member)
        return member

    def _make_group(self, uid: bytes, ndev: int) -> Any:
        if uid[len(MAGIC)] == 1:
            from tests.support.sim import transport as sim_nccl_transport

            return sim_nccl_transport.RemoteGroup(self, uid, ndev)
        return Group(self, uid, ndev)

    def new_unique_id(self) -> bytes:
        if self.transport == "processes":
            from tests.support.sim import transport as sim_nccl_transport

            if self._hub is None:
                self._hub = sim_nccl_transport.Hub(self)
            return self._hub.unique_id()
        return (MAGIC + b"\x00" + secrets.token_bytes(UNIQUE_ID_BYTES - len(MAGIC) - 1))

    def call(self, member: Member, kind: str, send: tuple[int, int] | None, recv: tuple[int, int] | None,
             count: int, dtype: int, op: int | None, arg: int | None, stream_handle: int) -> None:
        """One NCCL call of ``member`` (host side): checked, matched, then launched or kept for the group's end."""
        sim = self.sim
        group_state = self._group_state()
        process = sim._this_process()
        sim._context(f"nccl {kind}")  # NCCL's own device switch and restore: the thread's current device's context
        process.counters[f"nccl {kind}"] += 1
        member.calls[kind] += 1
        try:
            if member.freed:
                raise NcclError(INVALID_ARGUMENT)  # cupy: the handle is gone after abort/destroy
            self._raise_fault(kind, member, trace=False)
            if dtype not in TORCH_DTYPES:
                raise NcclError(INVALID_ARGUMENT)
            itemsize = TORCH_DTYPES[dtype].itemsize
            stream = self._stream(stream_handle, member)
            bufs = []
            for ptr_count in (send, recv):
                if ptr_count is None:
                    bufs.append(None)
                    continue
                ptr, n = ptr_count
                storage, offset = sim.resolve(ptr, n * itemsize, member.device)
                bufs.append((storage.bytes, offset, n * itemsize, storage.addr))
            pointers = [p for p, _ in filter(None, (send, recv))]
            if any(p % 16 for p in pointers):
                process.counters["nccl misaligned"] += 1
                self.misaligned.append(f"{kind}(count={count}) on {member.label}: "
                                       + ", ".join(f"{p:#x}" for p in pointers if p % 16))
            call = Call(kind, count, dtype, op, arg)
            post = Post(member, call, bufs[0], bufs[1])
            self._check_buffers(post, group_state)
            self._trace(kind, member)
            with sim.lock:
                if kind in ("send", "recv"):
                    src, dst = (member.rank, arg) if kind == "send" else (arg, member.rank)
                    pair = (src, dst, kind)
                    n = member.p2p_seq[pair]
                    member.p2p_seq[pair] += 1
                    member.group.post(post, ("p2p", src, dst, n), (src, dst))
                else:
                    seq = member.coll_seq
                    member.coll_seq += 1
                    member.group.post(post, ("coll", seq), tuple(range(member.group.nranks)))
        except NcclError as error:
            self._trace(f"{kind} failed", member)
            if group_state.depth:
                group_state.error = group_state.error or error.status
            raise
        except BaseException:
            self._trace(f"{kind} failed", member)
            if group_state.depth:
                group_state.error = group_state.error or INVALID_USAGE
            raise
        nbytes = count * itemsize * (member.group.nranks if kind == "reduceScatter" else 1)
        duration = (self.cost(call, nbytes, member.group.nranks) if self.cost is not None
                    else self.latency_s + (nbytes / self.bandwidth if self.bandwidth != float("inf") else 0.0))
        if group_state.depth:
            group_state.calls.append((member, post, stream, duration))
            if member not in group_state.linked:
                group_state.linked.append(member)
            self._threads_groups[threading.get_ident()] = group_state
        else:
            self._launch(member, [(post, stream, duration)])

    def _check_buffers(self, post: Post, group_state: _GroupState) -> None:
        """Refuse (``SimOverlap``) a call whose send and receive buffers overlap other than in place (``sendbuff ==
        recvbuff`` for reduce, allReduce and broadcast; ``recvbuff == sendbuff + rank * recvcount`` for reduceScatter;
        ``sendbuff == recvbuff + rank * sendcount`` for allGather), and a call of an open group whose buffers overlap
        another call's of that group where either writes (NCCL runs a group's calls at once; two reads of one buffer,
        as two sends of it, are fine)."""
        send, recv = post.send, post.recv
        if send is not None and recv is not None and _overlap(send, recv) and not _in_place(post):
            self._refuse_overlap(f"{self._named(post)} reads {self._where(send)} and writes {self._where(recv)}: its "
                                 f"send and receive buffers overlap, and not in place")
        if not group_state.depth:
            return
        for _, other, _, _ in group_state.calls:
            for mine, theirs, what in ((post.recv, other.recv, ("writes", "writes")),
                                       (post.recv, other.send, ("writes", "reads")),
                                       (post.send, other.recv, ("reads", "writes"))):
                if mine is not None and theirs is not None and _overlap(mine, theirs):
                    self._refuse_overlap(
                        f"one NCCL group runs {self._named(other)}, which {what[1]} {self._where(theirs)}, and "
                        f"{self._named(post)}, which {what[0]} {self._where(mine)}, at once: their buffers overlap")

    def _refuse_overlap(self, text: str) -> None:
        text += " (NCCL's result is undefined: only one call's in-place forms may overlap)"
        self.overlaps.append(text)
        raise SimOverlap(text)

    @staticmethod
    def _named(post: Post) -> str:
        return f"{post.call} on {post.member.label}"

    def _where(self, region: tuple[torch.Tensor, int, int, int]) -> str:
        _, offset, nbytes, addr = region
        ref = self.sim._by_address.get(addr)
        storage = ref() if ref is not None else None
        label = storage.label if storage is not None else "an allocation"
        return f"bytes [{offset}, {offset + nbytes}) of {label} at {addr:#x}"

    def _stream(self, handle: int, member: Member) -> Any:
        sim = self.sim
        if handle in (0, 1, 2):  # the legacy / per-thread default stream
            return member.process.default_stream(member.device)
        stream = sim._streams.get(handle)
        if stream is None:
            raise NcclError(UNHANDLED_CUDA_ERROR)
        if stream.device_index != member.device:
            raise NcclError(INVALID_ARGUMENT)
        return stream

    def group_start(self) -> None:
        self.sim._context("ncclGroupStart")
        self._raise_fault("groupStart", None)
        self._trace("groupStart")
        self._group_state().depth += 1

    def group_end(self) -> None:
        self.sim._context("ncclGroupEnd")
        state = self._group_state()
        if state.depth == 0:
            self._trace("groupEnd failed")
            raise NcclError(INVALID_USAGE)
        state.depth -= 1
        if state.depth:
            return
        calls, state.calls = state.calls, []
        linked, state.linked = state.linked, []
        error, state.error = state.error, None
        self._threads_groups.pop(threading.get_ident(), None)
        freed = [m for m in linked if m.freed]
        if freed:
            text = (f"ncclGroupEnd over {', '.join(m.label for m in freed)}, which abort() freed while this group held "
                    f"it (use after free: a crash on a GPU)")
            self.use_after_free.append(text)
            raise SimUseAfterFree(text)
        if error is not None:
            self._trace("groupEnd failed")
            raise NcclError(error)  # NCCL reports the failed enqueue again and launches nothing
        self._raise_fault("groupEnd", None)
        self._trace("groupEnd")
        by_member: dict[Member, list[tuple[Post, Any, float]]] = {}
        for member, post, stream, duration in calls:
            by_member.setdefault(member, []).append((post, stream, duration))
        for member, posts in by_member.items():
            self._launch(member, posts)

    def _connect(self, member: Member, posts: list[tuple[Post, Any, float]]) -> None:
        """NCCL's lazy connection (``NCCL_RUNTIME_CONNECT=1``, the default since 2.22; enqueue.cc sets
        ``algoNeedConnect`` for an algorithm whose ``initAlgoChannels`` is false, and a send or receive to a new peer
        sets up that peer's connection, at ``ncclGroupEnd``, on the host): the first call of each collective kind on a
        communicator waits on the host for every member to reach the same setup (the transport's bootstrap exchange),
        the first send or receive with a peer for that peer, and each setup takes device memory (``CONNECT_BYTES``, the
        sim's figures, not NCCL's). Here a kind stands for the algorithms NCCL would pick for it. In-process
        communicators only (the processes' hub models none: ``sim_nccl_transport``)."""
        group = member.group
        if not self.lazy_connect or not hasattr(group, "connecting"):
            return
        sim = self.sim
        needed: dict[tuple[Any, ...], tuple[set[int], set[int], Call]] = {}  # key -> (arrived, expected, first call)
        with sim.lock:
            for post, _, _ in posts:
                call = post.call
                p2p = call.kind in ("send", "recv")
                key = ("p2p", call.arg) if p2p else ("coll", call.kind)
                if key in member.connected or key in needed:
                    continue
                setup = ("p2p", *sorted((member.rank, call.arg))) if p2p else key
                arrived = group.connecting.setdefault(setup, set())
                arrived.add(member.rank)  # every setup of the launch at once, as ncclTransportP2pSetup posts them all
                needed[key] = (arrived, set(setup[1:]) if p2p else set(range(group.nranks)), call)
            for m in group.members.values():
                m.changed()
        if not needed:
            return
        member.process.counters["nccl connection setup"] += len(needed)

        def missing() -> list[int]:
            return sorted({r for arrived, expected, _ in needed.values() for r in expected - arrived})

        sim._host_wait(lambda: not missing(), list(group.members.values()),
                       f"ncclGroupEnd's connection setup on {member.label} for "
                       f"{', '.join(str(c) for _, _, c in needed.values())} (NCCL_RUNTIME_CONNECT: waiting for ranks "
                       f"{missing()} to reach it)")
        with sim.lock:
            for key, (_, _, call) in needed.items():
                member.connected.add(key)
                sim._nccl_memory[member.device] += CONNECT_BYTES[key[0]]
                self.connections.append((member.process.rank, member.label, key, str(call)))

    def _launch(self, member: Member, posts: list[tuple[Post, Any, float]]) -> None:
        """One kernel of ``member`` with ``posts`` on the first post's stream (after the communicator's previous
        kernel: NCCL serializes a communicator's work across streams); other streams of the group join it. A first
        call of its kind (or to its peer) sets its connection up first, on the host (``_connect``)."""
        sim = self.sim
        self._connect(member, posts)
        if len(member.kernels) >= self.fifo_bound:
            oldest = member.kernels[0] if member.kernels else None  # none: ``fifo_bound`` 0, see the class
            sim._host_wait(lambda: len(member.kernels) < self.fifo_bound, [member],
                           f"an NCCL launch on {member.label}, whose work FIFO is full ({self.fifo_bound} kernels "
                           f"pending: enqueue.cc waitWorkFifoAvailable)")
            if oldest is not None:
                sim._host_joined(sim._this_process(), None, oldest.end, oldest.hb_clock)
        stream = posts[0][1]
        others = list(dict.fromkeys(s for _, s, _ in posts if s is not stream))
        member.launched += 1
        kernel = Kernel(member, [p for p, _, _ in posts],
                        stalled=member.stall_from is not None and member.launched >= member.stall_from,
                        duration=sum(d for _, _, d in posts))
        name = (f"nccl {posts[0][0].call}" + (f" (+{len(posts) - 1} calls)" if len(posts) > 1 else "")
                + f" on {member.group.label}")
        deps = [member.last_kernel, *(s.tail for s in others)]
        op = sim_cuda.Op(stream, "nccl", name, deps=deps)
        op.nccl = kernel
        for post, _, _ in posts:
            post.kernel = op
        accesses = []
        for post, _, _ in posts:
            if post.send is not None:
                accesses.append((post.send[3], post.send[1], post.send[1] + post.send[2], False))
            if post.recv is not None and not (post.call.kind == "reduce" and post.call.arg != member.rank):
                accesses.append((post.recv[3], post.recv[1], post.recv[1] + post.recv[2], True))
        previous = member.last_kernel
        with sim.lock:  # before the worker can see it: run_kernel takes it off member.kernels
            member.kernels.append(op)
            member.last_kernel = op
        sim._enqueue(op, accesses=[((s, lo, hi), write) for s, lo, hi, write in accesses],
                     hb_join=None if previous is None else previous.hb_clock)
        sim._count("nccl kernel")
        for other in others:
            sim._enqueue(sim_cuda.Op(other, "wait", f"join {name}", deps=[op]),
                         hb_join=op.hb_clock)

    def abort(self, member: Member) -> None:
        sim = self.sim
        sim._count("nccl abort")
        sim._context("ncclCommAbort")
        if member.freed:
            return
        self._trace("abort", member)
        sim._life(f"abort started: {member.label}", member.process.rank)
        try:
            self._abort(member)
        finally:
            sim._life(f"abort returned: {member.label}", member.process.rank)

    def _abort(self, member: Member) -> None:
        sim = self.sim
        with sim.lock:
            member.aborted = True
            if any(member in state.linked for state in self._threads_groups.values()):
                member.freed = True  # freed under a group still open (NCCL 2.21: at once): its groupEnd crashes
            member.changed()
            if self.abort_reaches_peers:
                for other in self._peers(member):
                    if not other.aborted:
                        other.async_error = other.async_error or REMOTE_ERROR
                        other.changed()
            self._on_abort(member)
        last = member.last_kernel
        if last is not None and not last.done:
            sim._host_wait(lambda: last.done, [member, last.stream],
                           f"ncclCommAbort on {member.label}, waiting for its last kernel {last.describe()} "
                           f"(init.cc commDestroySync)")
        if last is not None:
            sim._host_joined(sim._this_process(), None, last.end, last.hb_clock)
        self._free_resources(member, "ncclCommAbort")
        member.freed = True

    def _free_resources(self, member: Member, what: str) -> None:
        """``commFree``'s device and pinned frees (init.cc): with ``device_wide_free`` they wait, as ``cuMemFree`` and
        ``cudaFreeHost`` may, for every stream of the process on the communicator's device to drain (NCCL issue 549:
        an abort stuck in cuMemFree; PR 564: a hang from CUDA's implicit synchronization), so a kernel outside the
        communicator's family that never finishes holds the abort or destroy too."""
        sim = self.sim
        if not self.device_wide_free:
            return
        process = member.process
        tails = [(s, s.tail) for s in process.streams() if s.device_index == member.device and s.tail is not None]
        sim._host_wait(lambda: all(t.done for _, t in tails), [s for s, _ in tails],
                       f"{what} on {member.label}: its frees wait for the whole device (every stream of rank "
                       f"{process.rank} on cuda:{member.device})")

    def _on_abort(self, member: Member) -> None:
        group = member.group
        notify = getattr(group, "member_aborted", None)
        if notify is not None:
            notify(member)

    def _peers(self, member: Member) -> list[Member]:
        return [m for m in getattr(member.group, "members", {}).values() if m is not member]

    def destroy(self, member: Member) -> None:
        self.sim._count("nccl destroy")
        self.sim._context("ncclCommDestroy")
        if member.freed:
            return
        self._trace("destroy", member)
        self._destroy(member)

    def _destroy(self, member: Member) -> None:
        sim = self.sim
        last = member.last_kernel
        if last is not None:
            sim._host_wait(lambda: not member.kernels, [member, last.stream],
                           f"ncclCommDestroy on {member.label}, waiting for its kernels ({last.describe()} last)")
            sim._host_joined(sim._this_process(), None, last.end, last.hb_clock)
        self._free_resources(member, "ncclCommDestroy")
        member.freed = member.destroyed = True
        getattr(member.group, "member_destroyed", lambda m: None)(member)

    def check_async_error(self, member: Member) -> None:
        self.sim._context("ncclCommGetAsyncError")
        if member.async_error is not None:
            raise NcclError(member.async_error)
        error = getattr(member.group, "remote_error", lambda m: None)(member)
        if error is not None:
            raise NcclError(error)


# ---- the modules -------------------------------------------------------------------------------------------


# ---- cupy's argument conversion: what Cython does to a C-typed parameter before the binding's body runs ------------

# The C types of cupy's ``nccl.pyx`` signatures, as annotations of the sim's methods (``test_sim_conformance.py``
# compares them with the installed binding's): each names the conversion below.
intptr_t = int  # noqa: PYI042 - cupy's C type names
size_t = int  # noqa: PYI042
ncclResult_t = int  # noqa: N816 - NCCL's enum (Cython converts it as a C int)


class NcclConfig:
    """cupy's ``NcclConfig`` type, for the constructor's signature only: the sim accepts ``config=None`` alone (the
    product passes none)."""


def _nb_int(value: Any) -> int:
    """Cython's path to a C ``int`` or ``size_t`` (measured on cupy 14.2's binding): an int as is, else the type's
    ``__int__`` (a float or a 0-dim tensor truncates, NaN and infinity fail as ``int()`` does), never ``__index__``
    alone, never a str or None."""
    if isinstance(value, int):
        return int(value)
    convert = getattr(type(value), "__int__", None)
    if convert is None:
        raise TypeError("an integer is required")
    result = convert(value)
    if not isinstance(result, int):
        raise TypeError(f"__int__ returned non-int (type {type(result).__name__})")
    return int(result)


def _c_int(value: Any, name: str) -> int:
    n = _nb_int(value)
    if not -(1 << 63) <= n < 1 << 63:
        raise OverflowError("Python int too large to convert to C long")
    if not -(1 << 31) <= n < 1 << 31:
        raise OverflowError("value too large to convert to int")
    return n


def _c_size_t(value: Any, name: str) -> int:
    n = _nb_int(value)
    if n < 0:
        raise OverflowError("can't convert negative value to size_t")
    if n >= 1 << 64:
        raise OverflowError("Python int too large to convert to C unsigned long")
    return n


def _c_intptr_t(value: Any, name: str) -> int:
    """An ``intptr_t`` takes an int alone (no float, no numpy or torch scalar, no ``__index__`` object)."""
    if not isinstance(value, int):
        raise TypeError("an integer is required")
    if not -(1 << 63) <= value < 1 << 63:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return int(value)


def _c_bytes(value: Any, name: str) -> bytes | None:
    """A ``bytes`` parameter: exactly bytes (no bytearray, no subclass), or None (Cython lets None through)."""
    if value is not None and type(value) is not bytes:
        raise TypeError(f"Argument '{name}' has incorrect type (expected bytes, got {type(value).__name__})")
    return value


def _c_config(value: Any, name: str) -> None:
    if value is not None:
        raise TypeError(f"Argument '{name}' has incorrect type (expected cupy_backends.cuda.libs.nccl.NcclConfig, "
                        f"got {type(value).__name__})")


_C_TYPES: dict[str, Callable[[Any, str], Any]] = {"int": _c_int, "ncclResult_t": _c_int, "size_t": _c_size_t,
                                                  "intptr_t": _c_intptr_t, "bytes": _c_bytes, "NcclConfig": _c_config}


def cython_args(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its C-typed parameters (annotated with the C type's name, as in cupy's ``.pyx``) converted as
    Cython converts them, in order, before the body runs: a wrong type is cupy's ``TypeError``, a value out of the C
    type's range its ``OverflowError``, never a silent coercion (``bytes(commId)``) nor a value cupy would refuse.
    Arity and keywords follow Python's rules, as Cython's ``def`` methods do (each parameter by its name)."""
    signature = inspect.signature(fn)
    converters = {name: _C_TYPES[p.annotation] for name, p in signature.parameters.items()
                  if p.annotation in _C_TYPES}

    @functools.wraps(fn)
    def converted(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        for name in list(arguments):
            convert = converters.get(name)
            if convert is not None:
                arguments[name] = convert(arguments[name], name)
        return fn(*bound.args, **bound.kwargs)

    return converted


class NcclCommunicator:
    """cupy's ``cupy.cuda.nccl.NcclCommunicator`` on the sim: cupy 14.2's signatures and argument conversion
    (``cython_args``); an instance made without ``__init__`` (``NcclCommunicator.__new__``) is cupy's NULL handle:
    every call on it fails with ``ncclInvalidArgument`` after its arguments were converted, ``abort``/``destroy`` do
    nothing. ``abort()`` and ``destroy()`` never raise: the binding declares ``ncclCommAbort``/``ncclCommDestroy``
    ``void`` and ignores their status (``nccl.pyx``), so a failing abort cannot reach the product."""

    _member: Member | None = None  # the NULL handle until __init__ joined
    _nccl: SimNccl | None = None

    @cython_args
    def __init__(self, ndev: int, commId: bytes, rank: int, config: NcclConfig = None) -> None:  # noqa: N803, RUF013
        if len(commId) != UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {UNIQUE_ID_BYTES}.")
        self._nccl = _sim().nccl
        self._member = self._nccl.new_member(ndev, commId, rank)

    @property
    def member(self) -> Member:
        return self._member

    def _m(self) -> Member:
        if self._member is None:
            raise NcclError(INVALID_ARGUMENT)
        return self._member

    def _live(self) -> Member:
        """The handle for a query: after ``abort``/``destroy`` cupy holds NULL, which NCCL refuses."""
        member = self._m()
        if member.freed:
            raise NcclError(INVALID_ARGUMENT)
        return member

    def rank_id(self) -> int:
        return self._live().rank

    def size(self) -> int:
        return self._live().group.nranks

    def device_id(self) -> int:
        return self._live().device

    @cython_args
    def reduce(self, sendbuf: intptr_t, recvbuf: intptr_t, count: size_t, datatype: int, op: int, root: int,
               stream: intptr_t) -> None:
        m = self._m()
        recv = (recvbuf, count) if m.rank == root else None
        self._nccl.call(m, "reduce", (sendbuf, count), recv, count, datatype, op, root, stream)

    @cython_args
    def allReduce(self, sendbuf: intptr_t, recvbuf: intptr_t, count: size_t, datatype: int, op: int,  # noqa: N802
                  stream: intptr_t) -> None:
        m = self._m()
        self._nccl.call(m, "allReduce", (sendbuf, count), (recvbuf, count), count, datatype, op, None, stream)

    @cython_args
    def reduceScatter(self, sendbuf: intptr_t, recvbuf: intptr_t, recvcount: size_t, datatype: int,  # noqa: N802
                      op: int, stream: intptr_t) -> None:
        m = self._m()
        self._nccl.call(m, "reduceScatter", (sendbuf, recvcount * m.group.nranks), (recvbuf, recvcount), recvcount,
                        datatype, op, recvcount, stream)

    @cython_args
    def allGather(self, sendbuf: intptr_t, recvbuf: intptr_t, count: size_t, datatype: int,  # noqa: N802
                  stream: intptr_t) -> None:
        m = self._m()
        self._nccl.call(m, "allGather", (sendbuf, count), (recvbuf, count * m.group.nranks), count, datatype, None,
                        None, stream)

    @cython_args
    def broadcast(self, sendbuff: intptr_t, recvbuff: intptr_t, count: size_t, datatype: int, root: int,
                  stream: intptr_t) -> None:
        m = self._m()
        send = (sendbuff, count) if m.rank == root else None
        self._nccl.call(m, "broadcast", send, (recvbuff, count), count, datatype, None, root, stream)

    @cython_args
    def bcast(self, buff: intptr_t, count: size_t, datatype: int, root: int, stream: intptr_t) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    @cython_args
    def send(self, sendbuf: intptr_t, count: size_t, datatype: int, peer: int, stream: intptr_t) -> None:
        m = self._m()
        self._nccl.call(m, "send", (sendbuf, count), None, count, datatype, None, peer, stream)

    @cython_args
    def recv(self, recvbuf: intptr_t, count: size_t, datatype: int, peer: int, stream: intptr_t) -> None:
        m = self._m()
        self._nccl.call(m, "recv", None, (recvbuf, count), count, datatype, None, peer, stream)

    def abort(self) -> None:
        if self._member is not None:
            self._nccl.abort(self._member)

    def destroy(self) -> None:
        if self._member is not None:
            self._nccl.destroy(self._member)

    def check_async_error(self) -> None:
        member = self._live()
        self._nccl.check_async_error(member)

    def __del__(self) -> None:
        """cupy's ``__dealloc__``: ``ncclCommDestroy`` on a communicator still open (it waits for its kernels)."""
        member = getattr(self, "_member", None)
        sim = sim_cuda._ACTIVE
        if member is None or member.freed or sim is None or sim.stopped or sim.nccl is not self._nccl:
            return
        with contextlib.suppress(BaseException):  # a destructor cannot raise; a SimHang is kept in sim.hangs
            self._nccl._destroy(member)


def get_unique_id() -> bytes:
    return _sim().nccl.new_unique_id()


def get_version() -> int:
    return VERSION


def get_build_version() -> int:
    return VERSION


def groupStart() -> None:  # noqa: N802 - cupy's name
    _sim().nccl.group_start()


def groupEnd() -> None:  # noqa: N802 - cupy's name
    _sim().nccl.group_end()


class _Device:
    """``cupy.cuda.Device(i)``: a context that makes ``i`` cupy's current device."""

    def __init__(self, device: int | None = None) -> None:
        self.id = _sim()._this_process().device if device is None else int(device)
        self._previous: list[int] = []

    def use(self) -> None:
        _sim()._this_process().device = self.id  # cudaSetDevice: the same per-thread device torch reads

    def __enter__(self) -> _Device:
        process = _sim()._this_process()
        self._previous.append(process.device)
        process.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _sim()._this_process().device = self._previous.pop()


class _DeviceId(types.SimpleNamespace):
    pass


class SimArray:
    """What ``cupy.from_dlpack`` returns on the sim: the bytes' pointer and device (all the product reads)."""

    def __init__(self, capsule: Any) -> None:
        self.data = types.SimpleNamespace(ptr=capsule.ptr)
        self.device = _DeviceId(id=capsule.device)
        self.nbytes = capsule.nbytes
        self.shape = capsule.shape
        self._capsule = capsule


def from_dlpack(array: Any, *, device: Any = None, copy: Any = None) -> SimArray:
    if hasattr(array, "__dlpack__") and not isinstance(array, sim_cuda.SimCapsule):
        array = array.__dlpack__(stream=1)  # cupy 14 passes its current stream: the legacy default one
    if not isinstance(array, sim_cuda.SimCapsule):
        raise TypeError(f"the simulated cupy takes a sim DLPack capsule, not {type(array).__name__}")
    if array.consumed:
        raise RuntimeError("a DLPack capsule can be consumed once")
    array.consumed = True
    return SimArray(array)


def make_modules() -> dict[str, types.ModuleType]:
    """``cupy``, ``cupy.cuda``, ``cupy.cuda.nccl``, ``cupy.cuda.runtime`` (fresh modules over this one's objects)."""
    cupy = types.ModuleType("cupy", "the simulated cupy (tests/support/sim/nccl.py)")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    runtime = types.ModuleType("cupy.cuda.runtime")
    for name, value in globals().items():
        if name.startswith("NCCL_") and isinstance(value, int):
            setattr(nccl, name, value)
    nccl.NcclError = NcclError
    nccl.NcclCommunicator = NcclCommunicator
    nccl.get_unique_id = get_unique_id
    nccl.get_version = get_version
    nccl.get_build_version = get_build_version
    nccl.groupStart = groupStart
    nccl.groupEnd = groupEnd
    nccl.check_status = cython_args(check_status)
    nccl.available = True
    runtime.getDevice = lambda: _sim()._this_process().device
    runtime.setDevice = lambda device: setattr(_sim()._this_process(), "device", int(device))
    runtime.getDeviceCount = lambda: _sim().device_count
    cuda.Device = _Device
    cuda.nccl = nccl
    cuda.runtime = runtime
    cupy.cuda = cuda
    cupy.from_dlpack = from_dlpack
    cupy.__version__ = "14.2.0"
    cupy.__path__ = []  # a package: ``import cupy.cuda.nccl`` finds the submodules in sys.modules
    cuda.__path__ = []
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl, "cupy.cuda.runtime": runtime}


__all__ = ["Call", "Member", "NcclCommunicator", "NcclError", "SimMismatch", "SimNccl", "SimOverlap",
           "SimUseAfterFree", "cython_args"]
