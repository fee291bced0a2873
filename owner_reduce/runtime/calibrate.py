"""Time the calls a flush issues on this cluster, through the communicator the runtime would use: the calibration.

What is timed, each at a ladder of sizes (bytes of one call's whole input): one AllReduce, one Reduce to rank 0,
one ReduceScatter (in place, ``world_size`` equal blocks), and one grouped send/recv round in which every rank sends
to its ring neighbours at distance 1..k and receives from those at -1..-k (so the busiest rank has k peers and moves
the round's bytes, split evenly over its peers). Ring neighbours because a hand-off moves a chunk to the owners of
the regions it overlaps, and chunks and regions are both laid out in rank order: its peers are near ranks.
``peer_stride`` s puts the partners at distance s..k*s instead (s = ranks per node: every partner on another node,
to time the network rather than NVLink). Each call is issued as the flush issues it: inside
``comm.group()``, on the communicator ``comm_select.select_comm`` gives (cupy NCCL on GPUs, torch.distributed
otherwise), waited for with ``comm.wait_until`` (bounded by the runtime's deadline). And the host's cost of a call
(``host``, ``planning.calibration`` Note (host)): one group of ``n`` AllReduces splitting ``host_bytes`` into ``n``
equal parts, for each ``n`` of ``host_calls``, each group timed alone (the device idle before it, one group per
timed repeat), so that its issue is in its time; per extra call the slope, per group the intercept less one
AllReduce of the same bytes.

Note (timing): on a GPU, CUDA events on the stream the calls run on (a high-priority side stream, as the runtime's
reduce stream), around ``inner`` calls issued back to back (so the host's issue time overlaps the previous call,
as in nccl-tests), divided by ``inner``; on the host (gloo), the wall clock around issue and wait. Before every
timed repeat the ranks meet in a one-element AllReduce, so a call's time is not a late peer's. Per size the median
of ``repeats`` (after ``warmup`` untimed ones), then the maximum over ranks (one ``all_gather_ints`` of every
median in nanoseconds): every rank gets the same numbers, hence the same fits and the same ``digest()``.

Note (agreement): every rank must time the same ladder, or the collectives would not match: the ladder's
fingerprint is compared across ranks first (one ``all_gather_ints``), and a mismatch fails on every rank alike.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..planning.calibration import CALL_KINDS, Calibration, KindFit, P2pFit, fit_host, fit_kind, fit_p2p
from ..planning.calls import ALLREDUCE, REDUCE, REDUCE_SCATTER, KindTable
from ..planning.wording import ranks_phrase
from .comm import ReduceComm

P2P, HOST = "p2p", "host"  # the send/recv round and the host's per-call cost: measured, not call kinds
MEASURED = (*CALL_KINDS, P2P, HOST)
# How each call kind is timed: one call on the whole buffer, as the flush issues it (``calls`` Note (no
# fall-through)); a ReduceScatter in ``world_size`` equal blocks, a Reduce to rank 0.
_ISSUE: KindTable[str, Callable[[ReduceComm, torch.Tensor], None]] = KindTable(
    "the calibration's timed calls (runtime.calibrate)", {
        ALLREDUCE: lambda comm, buf: comm.all_reduce(buf),
        REDUCE: lambda comm, buf: comm.reduce(buf, 0),
        REDUCE_SCATTER: lambda comm, buf: comm.reduce_scatter(buf, buf.numel() // comm.world_size),
    }, complete_for=CALL_KINDS)
GPU_SIZES = tuple((4 << 10) << (2 * i) for i in range(8))  # 4 KiB .. 64 MiB
CPU_SIZES = tuple((4 << 10) << (2 * i) for i in range(6))  # 4 KiB .. 4 MiB (gloo: under a minute on 4 ranks)
MAX_PEERS = 8
HOST_CALLS = (1, 2, 4, 8, 16)  # calls per group of the per-call measurement
HOST_BYTES = 64 << 10  # the bytes every one of those groups moves: latency-bound, so its time is its calls'


@dataclass(frozen=True)
class CalibrationOptions:
    """What to time. None picks the device's default: the size ladder (``GPU_SIZES`` / ``CPU_SIZES``), the peer
    counts (1, 2, 4, ... up to ``min((world_size - 1) // peer_stride, MAX_PEERS)``, the largest included), calls per
    timed repeat (10 on a GPU, 1 on the host) and the element type (bfloat16 on a GPU, as the gradients; float32 on
    the host). ``peer_stride``: the distance between a round's partners (see the module's docstring)."""

    sizes: tuple[int, ...] | None = None
    peers: tuple[int, ...] | None = None
    warmup: int = 2
    repeats: int = 10
    inner: int | None = None
    dtype: str | None = None
    kinds: tuple[str, ...] = MEASURED
    peer_stride: int = 1
    host_calls: tuple[int, ...] = HOST_CALLS
    host_bytes: int = HOST_BYTES

    def __post_init__(self) -> None:
        if self.peer_stride < 1:
            raise ValueError(f"owner_reduce: calibration peer_stride must be >= 1, got {self.peer_stride}")
        if self.sizes is not None and (len(set(self.sizes)) < 2 or min(self.sizes) < 1):
            raise ValueError(f"owner_reduce: calibration sizes must be at least two distinct positive byte counts, "
                             f"got {self.sizes}")
        if self.warmup < 0 or self.repeats < 1 or (self.inner is not None and self.inner < 1):
            raise ValueError(f"owner_reduce: calibration needs warmup >= 0, repeats >= 1, inner >= 1, got "
                             f"{self.warmup}, {self.repeats}, {self.inner}")
        unknown = [k for k in self.kinds if k not in MEASURED]
        if unknown or not self.kinds:
            raise ValueError(f"owner_reduce: calibration kinds must be among {', '.join(MEASURED)}, got {self.kinds}")
        if HOST in self.kinds:
            if ALLREDUCE not in self.kinds:
                raise ValueError("owner_reduce: calibration kind host needs allreduce too (its per-group cost is what "
                                 "a group costs beyond one AllReduce of the same bytes)")
            if len(set(self.host_calls)) < 2 or min(self.host_calls) < 1 or self.host_bytes < 1:
                raise ValueError(f"owner_reduce: calibration host_calls must be at least two distinct call counts >= 1 "
                                 f"and host_bytes positive, got {self.host_calls}, {self.host_bytes}")


def default_peers(world_size: int, cap: int = MAX_PEERS) -> tuple[int, ...]:
    """1, 2, 4, ... below ``min(world_size - 1, cap)``, and that largest count itself (none for one rank)."""
    top = min(world_size - 1, cap)
    out = {top} if top >= 1 else set()
    p = 1
    while p < top:
        out.add(p)
        p *= 2
    return tuple(sorted(out))


@dataclass(frozen=True)
class _Measurement:
    kind: str
    nbytes: int  # the whole input of the call (p2p: the bytes each rank sends in the round; host: of the group)
    peers: int = 0
    calls: int = 0  # host: AllReduces in the group

    def describe(self) -> str:
        """One line of ``--dry-run``."""
        what = {HOST: f"one group of {self.calls} AllReduce{'s' if self.calls > 1 else ''}, timed alone",
                P2P: f"a send/recv round, {self.peers} peer{'s' if self.peers > 1 else ''} each way"}.get(self.kind,
                                                                                                  f"one {self.kind}")
        return f"{self.kind:<15} {self.nbytes:>12,} bytes   {what}"


def plan_measurements(options: CalibrationOptions, world_size: int, element_size: int,
                      on_gpu: bool) -> tuple[_Measurement, ...]:
    """The ladder, with every size rounded down to what the call can move (whole elements; a ReduceScatter's
    ``world_size`` equal blocks; a round's bytes split evenly over its peers)."""
    sizes = options.sizes or (GPU_SIZES if on_gpu else CPU_SIZES)
    top = (world_size - 1) // options.peer_stride  # partners at distinct distances s..k*s, all below world_size
    peers = options.peers if options.peers is not None else default_peers(top + 1)
    bad = [p for p in peers if not 1 <= p <= top]
    if bad:
        raise ValueError(f"owner_reduce: calibration peers must be in 1..{top} (world size {world_size}, peer stride "
                         f"{options.peer_stride}), got {bad}")
    out: list[_Measurement] = []
    for kind in options.kinds:
        if kind == HOST:
            elems = options.host_bytes // element_size
            out += [_Measurement(HOST, elems // n * n * element_size, calls=n) for n in sorted(set(options.host_calls))]
            continue
        for size in sorted(set(sizes)):
            elems = size // element_size
            if kind == REDUCE_SCATTER:
                out.append(_Measurement(kind, elems // world_size * world_size * element_size))
            elif kind == P2P:
                out += [_Measurement(kind, elems // p * p * element_size, p) for p in peers]
            else:
                out.append(_Measurement(kind, elems * element_size))
    return tuple(m for m in out if m.nbytes > 0)


def _fingerprint(measurements: Sequence[_Measurement], options: CalibrationOptions, element_size: int) -> int:
    value = 17 + 31 * options.warmup + 37 * options.repeats + 41 * element_size + 43 * options.peer_stride
    for i, m in enumerate(measurements):
        value = (value * 1_000_003 + (i + 1) * (m.nbytes * 131 + m.peers * 7 + m.calls * 11 + MEASURED.index(m.kind))
                 ) % (1 << 61)
    return value


class _HostTimer:
    """Wall clock around issue and wait (gloo's group waits for its works at its end)."""

    def __init__(self, comm: ReduceComm) -> None:
        self.comm = comm

    def time_us(self, issue: Callable[[], None], inner: int) -> float:
        start = time.perf_counter()
        for _ in range(inner):
            issue()
        self.comm.wait_until(lambda: True, "calibration")
        return (time.perf_counter() - start) * 1e6 / inner

    def time_alone_us(self, issue: Callable[[], None]) -> float:
        """One issue, from an idle device to its end (gloo's calls end before they return)."""
        return self.time_us(issue, 1)


class _CudaTimer:
    """CUDA events on the current stream (the calibration's side stream) around ``inner`` calls."""

    def __init__(self, comm: ReduceComm) -> None:
        self.comm = comm

    def time_us(self, issue: Callable[[], None], inner: int) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            issue()
        end.record()
        self.comm.wait_until(end.query, "calibration")
        return start.elapsed_time(end) * 1000.0 / inner

    def time_alone_us(self, issue: Callable[[], None]) -> float:
        """One issue, from an idle stream (the ranks' meeting waited for first): the start event completes at once,
        the group's kernel only after its issue, so the time holds the issue (``planning.calibration`` Note
        (host))."""
        idle = torch.cuda.Event()
        idle.record()
        self.comm.wait_until(idle.query, "calibration")
        return self.time_us(issue, 1)


def _issuer(comm: ReduceComm, m: _Measurement, send: torch.Tensor, recv: torch.Tensor,
            stride: int = 1) -> Callable[[], None]:
    """One call (or round) of ``m`` as the flush issues it: in a group of its own."""
    elems = m.nbytes // send.element_size()
    rank, n = comm.rank, comm.world_size
    if m.kind == HOST:
        part = elems // m.calls
        parts = [send.narrow(0, i * part, part) for i in range(m.calls)]

        def grouped() -> None:
            with comm.group():
                for buf in parts:
                    comm.all_reduce(buf)
        return grouped
    if m.kind == P2P:
        piece = elems // m.peers

        def round_trip() -> None:
            with comm.group():
                for d in range(1, m.peers + 1):
                    comm.send(send.narrow(0, (d - 1) * piece, piece), (rank + d * stride) % n)
                    comm.recv(recv.narrow(0, (d - 1) * piece, piece), (rank - d * stride) % n)
        return round_trip
    buf = send.narrow(0, 0, elems)
    issue = _ISSUE[m.kind]

    def call() -> None:
        with comm.group():
            issue(comm, buf)
    return call


def measure(comm: ReduceComm, options: CalibrationOptions, device: torch.device, backend: str, device_name: str,
            software: Sequence[tuple[str, str]] = (), log: Callable[[str], None] | None = None) -> Calibration:
    """Time the ladder on ``comm`` (collective: every rank of the communicator calls it with the same options) and
    fit it; see the module's notes. On a GPU, call it under the stream the calls should run on."""
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, options.dtype or ("bfloat16" if on_gpu else "float32"))
    element_size = torch.empty((), dtype=dtype).element_size()
    measurements = plan_measurements(options, comm.world_size, element_size, on_gpu)
    inner = options.inner or (10 if on_gpu else 1)

    # Every rank times the same ladder (see Note (agreement)); rank 0's clock dates the file.
    facts = comm.all_gather_ints([_fingerprint(measurements, options, element_size), int(time.time())])
    differing = [r for r, f in enumerate(facts) if f[0] != facts[0][0]]
    if differing:
        verb = "differs" if len(differing) == 1 else "differ"
        raise RuntimeError(f"owner_reduce: calibration ladders differ between ranks ({ranks_phrase(differing)} {verb} "
                           "from rank 0): run every rank with the same options")
    measured_at = datetime.datetime.fromtimestamp(facts[0][1], datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    largest = max(m.nbytes for m in measurements) // element_size
    send = torch.zeros(largest, dtype=dtype, device=device)
    recv = torch.zeros(largest, dtype=dtype, device=device)
    meet = torch.zeros(1, dtype=dtype, device=device)
    timer = _CudaTimer(comm) if on_gpu else _HostTimer(comm)
    medians_ns: list[int] = []
    started = time.monotonic()
    try:
        for i, m in enumerate(measurements):
            issue = _issuer(comm, m, send, recv, options.peer_stride)
            for _ in range(options.warmup):
                issue()
            times = []
            for _ in range(options.repeats):
                comm.all_reduce(meet)  # the ranks meet: see Note (timing)
                times.append(timer.time_alone_us(issue) if m.kind == HOST else timer.time_us(issue, inner))
            medians_ns.append(round(statistics.median(times) * 1000))
            last = i + 1 == len(measurements) or measurements[i + 1].kind != m.kind
            if last and log is not None:
                log(f"owner_reduce: calibration timed {m.kind} ({time.monotonic() - started:.1f}s so far)")
    finally:
        comm.wait_until(lambda: True, "calibration end")
        comm.release_buffers()
    worst = [max(column) / 1000.0 for column in zip(*comm.all_gather_ints(medians_ns), strict=True)]

    fits: list[KindFit] = []
    for kind in CALL_KINDS:
        points = [(m.nbytes, t) for m, t in zip(measurements, worst, strict=True) if m.kind == kind]
        if points:
            fits.append(fit_kind(kind, points))
    p2p_points = [(m.peers, m.nbytes, t) for m, t in zip(measurements, worst, strict=True) if m.kind == P2P]
    p2p: P2pFit | None = fit_p2p(p2p_points) if p2p_points else None
    host_points = [(m.calls, m.nbytes, t) for m, t in zip(measurements, worst, strict=True) if m.kind == HOST]
    host = fit_host(host_points, next(f for f in fits if f.kind == ALLREDUCE)) if host_points else None
    return Calibration(world_size=comm.world_size, backend=backend, device=device_name, fits=tuple(fits), p2p=p2p,
                       measured_at=measured_at, dtype=str(dtype).removeprefix("torch."), warmup=options.warmup,
                       repeats=options.repeats, software=tuple(software), host=host)


def describe(comm: ReduceComm, process_group: Any = None) -> tuple[torch.device, str, str, tuple[tuple[str, str], ...]]:
    """(device, backend, device name, software versions) of the communicator ``select_comm`` gave."""
    import torch.distributed as dist

    from .torch_comm import TorchDistComm

    software = [("torch", torch.__version__.split("+")[0])]
    device_index = getattr(comm, "device", None)
    if device_index is not None:  # cupy NCCL: its device
        device = torch.device("cuda", int(device_index))
    elif torch.cuda.is_available() and dist.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = comm.name
    if isinstance(comm, TorchDistComm):
        backend = f"{comm.name}/{dist.get_backend(process_group)}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        try:
            from .nccl_binding import nccl_runtime_version

            software.append(("nccl", ".".join(map(str, nccl_runtime_version()))))
        except Exception:  # noqa: BLE001 - only a label: torch's own NCCL then
            version = torch.cuda.nccl.version()
            software.append(("nccl", ".".join(map(str, version)) if isinstance(version, tuple) else str(version)))
    else:
        name = "cpu"
    return device, backend, name, tuple(software)


def run_calibration(options: CalibrationOptions, process_group: Any = None,
                    log: Callable[[str], None] | None = None) -> Calibration:
    """In an initialized process group: build the runtime's communicator (``select_comm``), time, check that every
    rank holds the same calibration (digest), close the communicator. Collective over ``process_group``."""
    from .comm_select import select_comm

    comm = select_comm(process_group)
    try:
        device, backend, name, software = describe(comm, process_group)
        if device.type == "cuda":
            stream = torch.cuda.Stream(device, priority=-(1 << 10))  # the runtime's reduce stream is high priority
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                cal = measure(comm, options, device, backend, name, software, log)
            torch.cuda.current_stream(device).wait_stream(stream)
        else:
            cal = measure(comm, options, device, backend, name, software, log)
        digests = comm.all_gather_ints([int(cal.digest(), 16)])
        if len({d[0] for d in digests}) != 1:
            raise RuntimeError(f"owner_reduce: calibration digests differ between ranks: "
                               f"{[format(d[0], 'x') for d in digests]}")
        return cal
    finally:
        comm.close()


def local_rank_worker(rank: int, world_size: int, options: CalibrationOptions) -> tuple[str, str]:
    """One rank of ``harness.launch.run_ranks`` (gloo, process group up): (digest, the file's text). Rank 0 prints
    its progress (a command-line tool's output; DeepSpeed's logger is at WARNING by default)."""
    cal = run_calibration(options, log=(lambda line: print(line, flush=True)) if rank == 0 else None)
    return cal.digest(), cal.to_json()
