"""A simulated CUDA device and NCCL on CPU: CUDA's asynchrony and NCCL's blocking and abort semantics, so that the
product's cupy path (``CupyNcclComm``, ``CudaStreams``, the real ``OwnerReduceRuntime``) runs end to end in CI, and
what only a GPU would show (hangs, ordering races) fails in CI. No product code knows about it: the product keeps
calling ``torch.cuda.*``, ``cupy`` and ``cupy.cuda.nccl``; ``Sim`` patches those while it is installed.

API::

    from tests.support.sim.cuda import Sim, SimHang, sim_fixture  # the ``sim`` fixture: a Sim() installed for the test

    with Sim(launch_bound=1000, hang_bound_s=10.0, hb=False) as sim:   # installed (this thread: rank 0's process)
        x = torch.zeros(8, device="cuda")        # a device tensor (``SimTensor``) on the current device
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)                            # enqueued on ``side``, run later by its worker thread
        x.cpu()                                  # a D2H copy: synchronizes the current stream, a plain CPU tensor
        results = sim.run_ranks(fn, 4)           # fn(rank) on 4 threads, each rank a process of its own: its own
                                                 # current device (rank % device_count), default stream, host
        sim.kernel(0.002, name="layer 3")        # a synthetic compute kernel of 2 ms (virtual) on the current stream
        release = sim.stall()                    # a kernel that never completes until ``release.set()``
        sim.nccl.stall(member), sim.nccl.inject("reduce", 6, rank=0), sim.nccl.async_error(member)  # faults
        sim.counters["wait_event"], sim.nccl.comms(rank=0), sim.nccl.calls_of(0), sim.races (hb=True), sim.hangs,
        sim.nccl.mismatches, sim.nccl.process_exit(0)  # what cupy's __dealloc__ does at a process's exit

``Sim(transport="processes")`` in each of several processes: the unique id names a hub in the process that made it
(``sim_nccl_transport``). ``sim_runtime`` drives the real runtime on it.

What it models (``docs/notes/issue-37-simulated-device.md`` says where it departs from CUDA and NCCL):

- Streams: each a FIFO run asynchronously in order by a worker thread of its own. Ops: kernels (torch ops on device
  tensors, NCCL kernels, ``sim.kernel``), event records, event waits, stream waits. A launch blocks the host while the
  stream holds ``launch_bound`` pending operations (CUDA's launch queue). ``query()`` is true only when drained.
  Events as CUDA's: a wait takes the event's last record at enqueue time; a never-recorded event is complete.
- Torch ops on device tensors (``__torch_dispatch__``): views run at once on the host (no data); ops returning Python
  values (``item``, ``equal``) and D2H copies (``.cpu()``) synchronize the current stream first; in-place and ``out=``
  ops are enqueued and return their mutated argument; functional ops get their outputs allocated from metadata (the
  op on meta tensors) and are enqueued. Where metadata cannot be computed the op synchronizes and runs at once:
  ``sim.fallbacks`` counts those by op. ``torch.tensor(..., device="cuda")`` and ``.to("cuda")`` are H2D copies: the
  source is read at the call, the copy enqueued; a blocking one (``non_blocking=False``) then synchronizes the stream
  (``counters["blocking copy"]``), as CUDA's does.
- Pinned host memory (``pin_memory()``, ``is_pinned()``): a non-blocking D2H copy into it is enqueued, its destination
  holds ``POISON_BYTE`` until the copy runs, and a host read of it (``tolist``, ``item``, ``int()`` ...) before the
  copy ran is counted (``counters["host read of a pending copy"]``, ``sim.early_reads``) and, with ``hb``, a race
  unless a wait ordered it; a D2H copy into pageable memory synchronizes. ``SimTensor.__dlpack__`` is torch's.
- A virtual clock per stream, independent of machine load: an op starts at max(its stream's clock, what it waits for,
  its host's clock when launched) and ends ``duration`` later (``op_cost(name, args)`` for torch ops, default 0;
  ``sim.kernel(seconds)``; NCCL: ``sim.nccl.cost`` and a per-communicator ``delay_s``). Events carry virtual times, so
  ``elapsed_time`` is exact; a host wait moves its host's clock to what it waited for.
- NCCL (``sim_nccl``): see there. Threads the product starts (a watchdog) act in the process that started them.
  Every host wait that would block forever on a GPU (a full launch queue, a
  synchronize, a blocking copy, NCCL's init, work FIFO, abort and destroy waits) gives up after ``hang_bound_s`` wall
  seconds with ``SimHang`` naming where the host was blocked and what every stream's head waits for; ``SimHang`` is a
  ``BaseException``, so the product's ``except Exception`` cannot swallow what on a GPU would never return, and each
  one is also kept in ``sim.hangs``.
- Happens-before (``hb=True``): every enqueued op's reads and writes (from its schema) go to ``hb_cuda.HbChecker``
  with vector clocks advanced by the waits the product asked for, so a missing wait is a race even where the
  scheduling hid it: ``sim.races``, ``sim.hb_report()``.
- Counters: ``sim.counters`` (CUDA API calls by kind, launches, blocking copies, NCCL calls by kind, misaligned NCCL
  pointers), per process ``sim.process(rank).counters``, per stream ``stream.launches``.

A device tensor holds an inner CPU tensor over a storage the sim keeps in a registry of simulated addresses
(``data_ptr()``, DLPack's ``.data.ptr``): NCCL's pointers map back to inner storages through it, never through a raw
address read.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from tests.support.sim import hb_cuda

hb_cuda.skip_file(__file__)

DEFAULT_LAUNCH_BOUND = 1000  # CUDA's launch queue: about a thousand pending launches block the host
DEFAULT_STREAM_POOL = 32  # torch's c10/cuda/CUDAStream.cpp kStreamsPerPool: streams per priority per device
DEFAULT_HANG_BOUND_S = 10.0
ADDRESS_ALIGNMENT = 512  # the caching allocator's block alignment (cudaMalloc's is 256)
DEVICE_MEMORY = 80 << 30
POISON_BYTE = 0xA5  # what pinned host memory holds until the non-blocking device-to-host copy into it has run
_HOST_READS = ("tolist", "item", "__int__", "__float__", "__index__", "__bool__", "numpy")  # host tensors' value reads

_ACTIVE: Sim | None = None  # the installed sim (one at a time)


class SimHang(BaseException):
    """A host wait that on a GPU would never return passed the sim's hang bound. A BaseException: product code that
    catches ``Exception`` must not turn a hang into an error it could handle."""


class SimStopped(BaseException):
    """The sim was stopped (its test ended) while this thread waited in it."""


class SimError(RuntimeError):
    """A use the simulated device refuses (what CUDA would crash or fail on: a freed pointer, mixed devices)."""


# ---- waiting --------------------------------------------------------------------------------------------------


class _Watched:
    """Something threads wait on (a stream's progress, a communicator, the sim): ``changed()`` wakes them."""

    __slots__ = ("watchers",)

    def __init__(self) -> None:
        self.watchers: set[threading.Condition] = set()

    def changed(self) -> None:
        for cond in self.watchers:
            cond.notify()


# ---- processes, streams, events ---------------------------------------------------------------------------------


class SimHost:
    """One host thread's knowledge: its virtual time and its happens-before identity. A rank's main thread and each
    thread it starts (a watchdog, an abort) have one each, as threads have on a real host: what a watchdog learns by a
    ``query`` neither delays nor orders what the main thread launches, so the virtual timeline does not depend on when
    a polling thread happened to look.

    Its CUDA state is its own, as a real thread's is: the current device (``cudaGetDevice``; torch's and cupy's current
    device are this one) and torch's current stream per device (thread-local in torch). A rank's main thread starts on
    the rank's device (the launcher's ``set_device``); a thread it starts begins on device 0, with every device's
    default stream current, until it sets its own."""

    __slots__ = ("name", "host_time", "device", "current")

    def __init__(self, name: str, host_time: float = 0.0, device: int = 0) -> None:
        self.name = name
        self.host_time = host_time
        self.device = device
        self.current: dict[int, SimStream] = {}  # torch's current stream per device, where not the default one


class SimProcess:
    """One rank's process: its device (``own_device``, the one its launcher gave it), its streams per device (the
    default one first), its main host thread (``main``; threads it starts have hosts of their own: ``SimHost``), the
    CUDA contexts its threads made (``contexts``). ``device`` and ``current_stream`` are the calling thread's."""

    def __init__(self, sim: Sim, rank: int) -> None:
        self.sim = sim
        self.rank = rank
        self.own_device = (sim.first_device + rank) % sim.device_count
        self.host = hb_cuda.HOST if sim.max_ranks == 1 else f"r{rank}/{hb_cuda.HOST}"
        # the rank's main thread: its virtual seconds, its happens-before name, its CUDA state
        self.main = SimHost(self.host, device=self.own_device)
        self.counters: collections.Counter[str] = collections.Counter()
        self._default: dict[int, SimStream] = {}
        self.error: BaseException | None = None  # a kernel that failed: sticky, as a CUDA error
        # device -> {thread name: the first CUDA call it made there}: each device's primary context, made by the first
        # runtime call of any of this process's threads whose current device (or the guard's) it was
        self.contexts: dict[int, dict[str, str]] = {}
        if sim.hb is not None:
            sim.hb.thread(self.host)

    @property
    def host_time(self) -> float:
        """The main thread's virtual time."""
        return self.main.host_time

    @property
    def device(self) -> int:
        """The calling thread's current CUDA device."""
        return self.sim._this_host(self).device

    @device.setter
    def device(self, index: int) -> None:
        self.sim._this_host(self).device = index

    def default_stream(self, device: int) -> SimStream:
        stream = self._default.get(device)
        if stream is None:
            stream = self._default[device] = SimStream(self.sim, self, device, 0, "default")
        return stream

    def current_stream(self, device: int | None = None) -> SimStream:
        """The calling thread's current stream on ``device`` (its current device)."""
        host = self.sim._this_host(self)
        stream = host.current.get(host.device if device is None else device)
        return stream if stream is not None else self.default_stream(host.device if device is None else device)

    def streams(self) -> list[SimStream]:
        return [s for s in self.sim._streams.values() if s.process is self]

    def check_error(self) -> None:
        if self.error is not None:
            raise SimError(f"a kernel failed earlier on rank {self.rank} (CUDA errors are sticky): "
                           f"{type(self.error).__name__}: {self.error}") from self.error


class Op:
    """One operation of a stream's FIFO."""

    __slots__ = ("stream", "seq", "kind", "name", "fn", "deps", "duration", "not_before", "done", "failed", "start",
                 "end", "hb_clock", "nccl", "process")

    def __init__(self, stream: SimStream, kind: str, name: str, fn: Callable[[], Any] | None = None,
                 deps: Sequence[Op] = (), duration: float = 0.0) -> None:
        self.stream = stream
        self.seq = 0
        self.kind = kind  # kernel, record, wait, nccl
        self.name = name
        self.fn = fn
        self.deps = [d for d in deps if d is not None]  # done ones too: their end times start this op (virtual)
        self.duration = duration
        self.not_before = 0.0
        self.done = False
        self.failed: BaseException | str | None = None
        self.start = 0.0
        self.end = 0.0
        self.hb_clock: dict[str, int] | None = None
        self.nccl: Any = None  # sim_nccl's kernel state
        self.process = stream.process

    def describe(self) -> str:
        return f"{self.name} (op #{self.seq} of {self.stream.name})"


class SimStream(_Watched):
    """``torch.cuda.Stream`` on the simulated device."""

    _handles = itertools.count(0x5000)

    def __init__(self, sim: Sim, process: SimProcess, device: int, priority: int, name: str | None = None) -> None:
        super().__init__()
        self.sim = sim
        self.process = process
        self.device_index = device
        self.device = torch.device("cuda", device)
        self.priority = priority
        self.cuda_stream = next(self._handles)
        number = sum(1 for s in sim._streams.values() if s.process is process and s.device_index == device)
        base = name or f"stream#{number}"
        full = base if sim.max_ranks == 1 else f"r{process.rank}/{base}"
        taken = {s.name for s in sim._streams.values()}
        self.name = full if full not in taken else f"{full}@cuda:{device}"
        self.queue: collections.deque[Op] = collections.deque()
        self.enqueued = 0
        self.completed = 0
        self.launches = 0  # kernels (torch ops, NCCL kernels, sim.kernel) ever launched here
        self.clock = 0.0  # the virtual end of the last completed op
        self.tail: Op | None = None  # the last op enqueued
        self._worker: threading.Thread | None = None
        self._work_ready = _Watched()  # what the idle worker waits on (an enqueue wakes only it)
        self._idle = False
        sim._streams[self.cuda_stream] = self
        if sim.hb is not None:
            sim.hb.thread(self.name)

    # ---- torch.cuda.Stream's surface ------------------------------------------------------------------------

    def wait_event(self, event: SimEvent) -> None:
        self.sim._count("wait_event")
        self.sim._context("torch.cuda.Stream.wait_event", self.device_index)
        self.sim._enqueue(Op(self, "wait", f"wait_event({event.name})", deps=[event.last]),
                          hb_join=event.hb_clock)

    def wait_stream(self, stream: SimStream) -> None:
        self.sim._count("wait_stream")
        self.sim._context("torch.cuda.Stream.wait_stream", self.device_index)
        hb = self.sim.hb
        self.sim._enqueue(Op(self, "wait", f"wait_stream({stream.name})", deps=[stream.tail]),
                          hb_join=None if hb is None else hb.snapshot(stream.name))

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else self.sim.new_event()
        event.record(self)
        return event

    def query(self) -> bool:
        self.sim._context("torch.cuda.Stream.query", self.device_index)  # torch's CUDAStream::query has a guard
        self.process.check_error()
        done = not self.queue
        self.sim._count("query" if done else "query (not ready)")
        if done:
            self.sim._host_joined(self.sim._this_process(), self.name, self.clock)
        return done

    def synchronize(self) -> None:
        self.sim._count("synchronize")
        self.sim._context("torch.cuda.Stream.synchronize", self.device_index)
        self.sim._wait_for_tail(self, f"{self.name}.synchronize()")
        self.process.check_error()

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return self.cuda_stream

    def __repr__(self) -> str:
        return f"<sim stream {self.name} cuda:{self.device_index} priority={self.priority}>"


class SimEvent:
    """``torch.cuda.Event`` on the simulated device."""

    _numbers = itertools.count(1)

    def __init__(self, sim: Sim, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.sim = sim
        self.enable_timing = enable_timing
        self.name = f"event#{next(self._numbers)}"
        self.last: Op | None = None  # the op of its last record
        self.hb_clock: dict[str, int] | None = None
        self.device: int | None = None  # torch creates the CUDA event at its first record, on the stream's device
        self.rank: int | None = None  # the process that created it

    def __del__(self) -> None:
        """``~CUDAEvent``: ``cudaEventDestroy`` on the thread that drops the last reference (torch's destructor takes
        a device guard; the CUDA driver's locks it takes are what a watchdog must not wait on before its aborts):
        ``Sim.lifecycle`` records where."""
        if self.device is not None:
            self.sim._destroyed(self)

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream if stream is not None else self.sim._this_process().current_stream()
        self.sim._count("Event.record")
        self.sim._context("torch.cuda.Event.record", stream.device_index)  # a guard on the stream's device
        if self.device is None:
            self.device, self.rank = stream.device_index, stream.process.rank
        op = Op(stream, "record", f"record({self.name})")
        self.sim._enqueue(op)
        self.last = op
        if self.sim.hb is not None:
            self.hb_clock = self.sim.hb.snapshot(stream.name)

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else self.sim._this_process().current_stream()).wait_event(self)

    def query(self) -> bool:
        # torch's CUDAEvent::query has no device guard: cudaEventQuery runs on the thread's current device, whose
        # primary context it makes where there is none (issue 46, finding 1); a sticky CUDA error raises here.
        self.sim._count("Event.query")
        self.sim._context("torch.cuda.Event.query")
        if self.last is not None:
            self.last.process.check_error()
        done = self.last is None or self.last.done
        if done and self.last is not None:
            self.sim._host_joined(self.sim._this_process(), None, self.last.end, self.hb_clock)
        return done

    def synchronize(self) -> None:
        self.sim._count("Event.synchronize")
        self.sim._context("torch.cuda.Event.synchronize")  # no device guard either
        last = self.last
        if last is None:
            return
        self.sim._host_wait(lambda: last.done, [last.stream], f"{self.name}.synchronize()")
        self.sim._host_joined(self.sim._this_process(), None, last.end, self.hb_clock)

    def elapsed_time(self, end: SimEvent) -> float:
        """Milliseconds between two completed timing events (virtual time); CUDA's errors otherwise."""
        self.sim._count("Event.elapsed_time")
        self.sim._context("torch.cuda.Event.elapsed_time", self.device)
        for event in (self, end):
            if not event.enable_timing:
                raise RuntimeError("CUDA error: invalid resource handle (an event created without enable_timing)")
            if event.last is None or not event.last.done:
                raise RuntimeError("CUDA error: device not ready (elapsed_time of an event not completed)")
        return (end.last.end - self.last.end) * 1e3

    @property
    def time(self) -> float | None:
        """The virtual time of its last record, once completed (the sim's own reading, for tests)."""
        return self.last.end if self.last is not None and self.last.done else None

    def __repr__(self) -> str:
        return f"<sim {self.name}>"


# ---- device memory ----------------------------------------------------------------------------------------------


class SimStorage:
    """A device allocation: its simulated address, its bytes (a CPU storage), where it was allocated. Every device
    tensor over it holds it; when the last one dies the allocation is freed (the caching allocator's free)."""

    __slots__ = ("sim", "process", "device", "addr", "nbytes", "data", "bytes", "alloc_stream", "recorded", "label",
                 "__weakref__")

    def __init__(self, sim: Sim, process: SimProcess, device: int, data: torch.UntypedStorage,
                 alloc_stream: SimStream, label: str) -> None:
        self.sim = sim
        self.process = process
        self.device = device
        self.data = data
        self.nbytes = data.nbytes()
        self.bytes = torch.empty(0, dtype=torch.uint8).set_(data, 0, (self.nbytes,))
        self.alloc_stream = alloc_stream
        self.recorded: set[SimStream] = set()
        self.label = label
        self.addr = sim._allocate_address(self)
        weakref.finalize(self, sim._freed, self.addr, self.nbytes, device, process, alloc_stream.name,
                         self.recorded)


class SimTensor(torch.Tensor):
    """A CUDA tensor of the simulated device: CUDA metadata outside (``.device.type == "cuda"``), an inner CPU tensor
    over its ``SimStorage`` inside; every aten op on it goes through ``Sim._dispatch``."""

    _inner: torch.Tensor
    _sim_storage: SimStorage

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105 - a CUDA tensor is a plain torch.Tensor to code that reads its class
        return torch.Tensor  # (placement.py's hot path tests ``targets.__class__ is torch.Tensor``)

    @staticmethod
    def __new__(cls, inner: torch.Tensor, storage: SimStorage) -> SimTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=torch.device("cuda", storage.device), requires_grad=False)
        t._inner = inner
        t._sim_storage = storage
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206 - torch's protocol
        return _sim()._dispatch(func, args, kwargs or {})

    # ---- what torch's Python bindings would do through a CUDA device guard, or refuse for a subclass ---------------

    def __getitem__(self, index: Any) -> SimTensor:
        index = index if isinstance(index, tuple) else (index,)
        out, dim = self, 0
        for i in index:
            if i is Ellipsis:
                dim = out.dim() - (len(index) - 1 - index.index(Ellipsis))
            elif i is None:
                out = torch.ops.aten.unsqueeze.default(out, dim)
                dim += 1
            elif isinstance(i, slice):
                start, stop, step = i.indices(out.shape[dim])
                out = torch.ops.aten.slice.Tensor(out, dim, start, max(start, stop), step)
                dim += 1
            elif isinstance(i, int):
                out = torch.ops.aten.select.int(out, dim, i)
            else:
                raise SimError(f"the simulated device supports basic indexing only (ints, slices), not {i!r}")
        return out

    def __setitem__(self, index: Any, value: Any) -> None:
        view = self[index]
        if isinstance(value, torch.Tensor):
            view.copy_(value)
        else:
            view.fill_(value)

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> SimTensor:
        return torch.ops.aten.copy_.default(self, src, non_blocking)

    def new_tensor(self, data: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype or self.dtype).to(self.device)

    def nonzero(self) -> torch.Tensor:
        return torch.ops.aten.nonzero.default(self)

    def __index__(self) -> int:
        return int(self.item())

    def tolist(self) -> Any:
        return self.cpu().tolist()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def cuda(self, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
        target = torch.device("cuda", _sim()._device_index(device))
        return self if target == self.device else self.to(target, non_blocking=non_blocking)

    def data_ptr(self) -> int:
        return self._sim_storage.addr + self.storage_offset() * self.element_size()

    def untyped_storage(self) -> Any:
        raise SimError("a simulated device tensor has no host-visible storage (use data_ptr(), or .cpu())")

    def record_stream(self, stream: SimStream) -> None:
        sim = _sim()
        sim._count("record_stream")
        if stream.device_index != self._sim_storage.device:
            raise RuntimeError(f"record_stream: stream on cuda:{stream.device_index}, tensor on {self.device}")
        self._sim_storage.recorded.add(stream)

    def __dlpack__(self, *, stream: Any | None = -1, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[Any, int] | None = None, copy: bool | None = None) -> SimCapsule:
        """A DLPack capsule of the sim (``cupy.from_dlpack`` of the sim reads it), with torch 2.13's signature
        (keyword-only) and checks (``torch/_tensor.py``, ``_C._to_dlpack``): the tensor's device must be the current
        one (``BufferError``); ``stream`` an int or None (``TypeError``): -1 synchronizes nothing, None and 1 make
        the legacy default stream wait for the current one, 2 (the per-thread default stream) is a ``BufferError``, 0
        an ``AssertionError``, any other a stream handle that waits for the current stream; ``dl_device`` a pair of
        ints naming this device, or another one with ``copy=False`` (``ValueError``); ``copy=True`` exports a copy."""
        sim = _sim()
        if self.requires_grad:
            raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
        index = self._sim_storage.device
        current_device = torch.cuda.current_device()  # the sim's: this thread's
        if index != current_device:
            raise BufferError(f"Can't export tensors on a different CUDA device index. Expected: {index}. Current "
                              f"device: {current_device}.")
        if stream is not None and type(stream) is not int:
            raise TypeError("stream must be ``int`` or ``none``")
        if stream != -1:
            if stream is None or stream == 1:
                consumer = torch.cuda.default_stream()
            else:
                if stream == 2:
                    raise BufferError("per-thread default stream is not supported.")
                if stream == 0:
                    raise AssertionError("unsupported stream on CUDA: 0.")
                consumer = sim._streams.get(stream)
                if consumer is None:
                    raise SimError(f"__dlpack__(stream={stream:#x}): no stream of the simulated device has this "
                                   f"handle (CUDA: an invalid resource handle)")
            current = torch.cuda.current_stream()
            if consumer is not current:
                event = torch.cuda.Event()
                event.record(current)
                consumer.wait_event(event)
        tensor = self
        versioned = max_version is not None and max_version[0] >= 1  # read first, as torch's
        if dl_device is not None and (not isinstance(dl_device, tuple | list)
                                      or not all(isinstance(v, int) for v in dl_device)):
            raise TypeError(f"_to_dlpack(): argument 'dl_device' must be tuple of ints, not "
                            f"{type(dl_device).__name__}")
        if copy is not None and not isinstance(copy, bool):
            raise TypeError(f"_to_dlpack(): argument 'copy' must be bool, not {type(copy).__name__}")
        if dl_device is not None:
            if len(dl_device) != 2:
                raise RuntimeError("dl_device must be either None or a tuple of ints")
            kind, target = int(dl_device[0]), int(dl_device[1])
            if kind not in _DL_DEVICES:
                raise BufferError(f"Unsupported device_type: {kind}")
            if (kind, target) != (2, index):  # kDLCUDA on this device
                where = f"{_DL_DEVICES[kind]}:{target}" if kind != 1 else "cpu"
                if copy is False:
                    raise ValueError(f"cannot move (i.e. copy=False) tensor from {self.device} to {where} without "
                                     f"copying.")
                raise SimError(f"__dlpack__(dl_device={tuple(dl_device)}): an export copied to {where} is not "
                               f"modelled on the simulated device")
        if copy:
            tensor = self.clone()
        return SimCapsule(tensor, versioned=versioned)

    def __dlpack_device__(self) -> tuple[Any, int]:
        from torch.utils.dlpack import DLDeviceType

        return (DLDeviceType.kDLCUDA, self._sim_storage.device)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        """The values where the current stream has nothing pending (a repr never waits: pytest prints locals)."""
        sim = _ACTIVE
        with contextlib.suppress(BaseException):
            if sim is not None and not sim._this_process().current_stream(self._sim_storage.device).queue:
                return f"{self._inner!r}[sim {self.device}]"
        return f"<sim tensor {tuple(self.shape)} {self.dtype} {self.device} (work pending)>"

    def __format__(self, spec: str) -> str:
        return self.item().__format__(spec) if self.dim() == 0 else repr(self)


_DL_DEVICES = {1: "cpu", 2: "cuda", 4: "opencl", 8: "mps", 10: "hip", 12: "privateuseone", 13: "cuda", 14: "xpu",
               17: "maia"}  # DLPack device types torch maps to a device (DLConvertor.cpp dlDeviceToTorchDevice)


class SimCapsule:
    """What ``SimTensor.__dlpack__`` hands out: the bytes a consumer may address (device, pointer, size); ``versioned``:
    DLPack 1.0's capsule (``max_version`` >= (1, 0)), else the unversioned one."""

    def __init__(self, tensor: SimTensor, versioned: bool = False) -> None:
        self.versioned = versioned
        self.device = tensor._sim_storage.device
        self.ptr = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self._keep = tensor._sim_storage  # the producer keeps the memory alive while a consumer holds it
        self.consumed = False


# ---- factory calls and host tensors' .to() with a CUDA device (torch would build them in the CUDA backend) ---------


_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "empty_strided", "rand", "randn", "randint", "linspace",
              "eye", "zeros_like", "ones_like", "empty_like", "full_like")
_HOST_TO_DEVICE = ("tensor", "as_tensor")


def _is_cuda(device: Any) -> bool:
    if device is None or isinstance(device, int):
        return False
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


_OVERRIDES: dict[Any, Any] = {}


class _OpInfo:
    __slots__ = ("name", "kind", "writes", "returns_alias", "tensor_returns")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.name = func.__name__.split(".")[0]
        self.writes = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None
                            and a.alias_info.is_write)
        alias_of = {}
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None:
                for s in a.alias_info.before_set:
                    alias_of[s] = i
        self.returns_alias = tuple(next((alias_of[s] for s in r.alias_info.before_set if s in alias_of), None)
                                   if r.alias_info is not None else None for r in schema.returns)
        self.tensor_returns = any("Tensor" in str(r.type) for r in schema.returns)
        if self.writes:
            self.kind = "mutate"
        elif any(r.alias_info is not None for r in schema.returns):
            self.kind = "view"
        elif not self.tensor_returns:
            self.kind = "scalar"
        else:
            self.kind = "functional"


_METADATA_ONLY = {"is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous",
                  "dim", "size", "stride", "numel", "is_complex", "is_floating_point", "is_nonzero_meta"}


# ---- the simulator -------------------------------------------------------------------------------------------------


class Sim(_Watched):
    """The simulated device and NCCL; ``with Sim() as sim:`` installs it (see the module's docstring).

    ``launch_bound``: pending operations per stream before a launch blocks the host. ``hang_bound_s``: wall seconds
    before a host wait that would never return raises ``SimHang``. ``hb``: record accesses for the happens-before
    checker. ``device_count``, ``capability``, ``device_name``: what ``torch.cuda`` reports. ``max_ranks``: the
    in-process ranks it will hold (names get a rank prefix when more than one). ``op_cost(name, args)``: a torch op's
    virtual duration in seconds (default 0). ``nccl_*``: see ``sim_nccl.SimNccl``.
    """

    def __init__(self, *, launch_bound: int = DEFAULT_LAUNCH_BOUND, hang_bound_s: float = DEFAULT_HANG_BOUND_S,
                 hb: bool = False, device_count: int = 8, max_ranks: int = 8, capability: tuple[int, int] = (9, 0),
                 device_name: str = "NVIDIA H100 80GB HBM3 (simulated)",
                 op_cost: Callable[[str, tuple[Any, ...]], float] | None = None,
                 stream_pool: int = DEFAULT_STREAM_POOL, strict_contexts: bool = True, first_device: int = 0,
                 **nccl_options: Any) -> None:
        super().__init__()
        from tests.support.sim import nccl as sim_nccl

        if stream_pool < 1:
            raise ValueError(f"stream_pool must be at least 1, got {stream_pool}")
        self.stream_pool = stream_pool
        self.strict_contexts = strict_contexts
        self.first_device = first_device  # rank r's own device: (first_device + r) % device_count
        # (sequence, what, thread name, rank): every CUDA event destroyed, every NCCL abort's start and return, in order
        self.lifecycle: list[tuple[int, str, str, int | None]] = []
        self._lifecycle_seq = itertools.count()
        self._pools: dict[tuple[int, int, int], list[SimStream]] = {}  # (rank, device, priority) -> the pool's streams
        self._pool_next: collections.Counter[tuple[int, int, int]] = collections.Counter()
        self.launch_bound = launch_bound
        self.hang_bound_s = hang_bound_s
        self.device_count = device_count
        self.max_ranks = max_ranks
        self.capability = capability
        self.device_name = device_name
        self.op_cost = op_cost
        self.hb = hb_cuda.HbChecker() if hb else None
        self.lock = threading.RLock()
        self.stopped = False
        self.hangs: list[str] = []  # every SimHang raised (also those a product or a destructor swallowed)
        self.fallbacks: collections.Counter[str] = collections.Counter()  # ops that synchronized for lack of metadata
        self._streams: dict[int, SimStream] = {}
        self._processes: dict[int, SimProcess] = {}
        self._tls = threading.local()
        self._addresses: list[int] = []  # sorted allocation addresses (the registry)
        self._by_address: dict[int, weakref.ref[SimStorage]] = {}  # weak: a storage dies with its last tensor
        self._next_address = 0x7F0000000000
        self._allocated: collections.Counter[int] = collections.Counter()  # bytes per device (torch's tensors)
        self._nccl_memory: collections.Counter[int] = collections.Counter()  # NCCL's own, per device (connections)
        self._patches: list[tuple[Any, str, Any]] = []
        self._installed = False
        self._pinned: dict[int, _PinnedBlock] = {}  # pinned host storages by data_ptr (while they live)
        self._pinned_numbers = itertools.count(1)
        self.early_reads: list[str] = []  # host reads of pinned memory a pending copy had not written yet
        self.nccl = sim_nccl.SimNccl(self, **nccl_options)

    # ---- processes and threads ----------------------------------------------------------------------------------

    def process(self, rank: int = 0) -> SimProcess:
        with self.lock:
            process = self._processes.get(rank)
            if process is None:
                if len(self._processes) >= self.max_ranks and rank not in self._processes:
                    raise SimError(f"more than max_ranks={self.max_ranks} simulated processes")
                process = self._processes[rank] = SimProcess(self, rank)
            return process

    def _this_process(self) -> SimProcess:
        process = getattr(self._tls, "process", None)
        if process is None:
            if len(self._processes) <= 1:
                return self.process(0)
            raise SimError(f"thread {threading.current_thread().name!r} is bound to no simulated rank "
                           f"(sim.run_ranks binds its threads; sim.bind(rank) binds another)")
        return process

    def _this_host(self, process: SimProcess) -> SimHost:
        """The host thread acting for ``process`` now: this thread's own where it was started by a rank's thread
        (``bind(rank, host)``), else the rank's main thread."""
        host = getattr(self._tls, "host", None)
        return host if host is not None and getattr(self._tls, "process", None) is process else process.main

    def _new_host(self, process: SimProcess, starter: SimHost, name: str) -> SimHost:
        """A thread started by ``starter``'s thread: it knows what its starter knew (thread start orders), no more. Its
        CUDA state is a new thread's: device 0, every device's default stream current (``SimHost``)."""
        host = SimHost(f"{process.host}/{name}", starter.host_time, device=0)
        if self.hb is not None:
            with self.lock:
                self.hb.thread(host.name)
                self.hb.host_joins(host.name, self.hb.snapshot(starter.name))
        return host

    @contextlib.contextmanager
    def bind(self, rank: int, host: SimHost | None = None) -> Iterator[SimProcess]:
        """This thread acts as rank ``rank``'s process while inside (as its main thread, or as ``host``)."""
        previous = getattr(self._tls, "process", None), getattr(self._tls, "host", None)
        self._tls.process = self.process(rank)
        self._tls.host = host
        try:
            yield self._tls.process
        finally:
            self._tls.process, self._tls.host = previous

    def run_ranks(self, fn: Callable[[int], Any], world_size: int, timeout_s: float | None = None,
                  raise_first: bool = True) -> list[Any]:
        """``fn(rank)`` for every rank, each on its own thread bound to its own process; the results by rank. A rank
        that raises: its exception (the first, others as notes) unless ``raise_first`` is false, where the results
        hold the exceptions. Bounded by ``timeout_s`` (default: three hang bounds)."""
        results: list[Any] = [None] * world_size
        errors: dict[int, BaseException] = {}

        def main(rank: int) -> None:
            try:
                with self.bind(rank):
                    results[rank] = fn(rank)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors[rank] = error

        threads = [threading.Thread(target=main, args=(r,), name=f"sim-rank-{r}", daemon=True)
                   for r in range(world_size)]
        for t in threads:
            t._sim_unbound = True  # type: ignore[attr-defined] - bound by main()
            t.start()
        allowed = timeout_s if timeout_s is not None else 3 * self.hang_bound_s + 5
        limit = time.monotonic() + allowed
        for r, t in enumerate(threads):
            t.join(max(0.0, limit - time.monotonic()))
            if t.is_alive():
                state = self.state()
                self.stop()
                for u in threads:
                    u.join(2.0)
                raise SimHang(f"sim.run_ranks: rank {r} still running after {allowed:g} s "
                              f"(raised meanwhile: {sorted(errors)}): {state}")
        if not raise_first:
            return [errors.get(r, results[r]) for r in range(world_size)]
        if errors:
            first_rank = min(errors, key=lambda r: (isinstance(errors[r], SimStopped), r))
            first = errors[first_rank]
            first.add_note(f"(sim.run_ranks: raised on rank {first_rank})")
            for r in sorted(errors):
                if r != first_rank:
                    first.add_note(f"rank {r}: {type(errors[r]).__name__}: {str(errors[r])[:300]}")
            raise first
        return results

    # ---- installing -------------------------------------------------------------------------------------------

    def __enter__(self) -> Sim:
        self.install()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.uninstall()
        if exc_type is None and self.strict_contexts:
            self.check_contexts()

    def install(self) -> None:
        global _ACTIVE
        if _ACTIVE is not None:
            raise SimError("another Sim is installed")
        _ACTIVE = self
        self._installed = True
        self._patch_torch_cuda()
        self._patch_host_memory()
        self.nccl.install_modules()
        self._tls.process = self.process(0)

    def uninstall(self) -> None:
        global _ACTIVE
        if not self._installed:
            return
        self.stop()
        for obj, name, old in reversed(self._patches):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._patches.clear()
        self.nccl.uninstall_modules()
        self._installed = False
        self._tls.process = None
        _ACTIVE = None

    def stop(self) -> None:
        """Wake every thread waiting in the sim (they raise ``SimStopped``; workers end); nothing runs after."""
        with self.lock:
            self.stopped = True
            self.changed()
            for stream in self._streams.values():
                stream.changed()
                stream._work_ready.changed()
            self.nccl.stopped()

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value`` until uninstalled (an attribute ``obj`` only inherited is deleted again)."""
        own = name in vars(obj) if isinstance(obj, type) else hasattr(obj, name)
        self._patches.append((obj, name, getattr(obj, name) if own else _MISSING))
        setattr(obj, name, value)

    def _patch_torch_cuda(self) -> None:
        cuda = torch.cuda
        sim = self

        @contextlib.contextmanager
        def stream(s: SimStream | None) -> Iterator[None]:
            # torch.cuda.StreamContext: the stream's device and the stream become this thread's current ones.
            if s is None:
                yield
                return
            sim._count("stream switch")
            host = sim._this_host(sim._this_process())
            device, previous = host.device, host.current.get(s.device_index)
            host.device = s.device_index
            host.current[s.device_index] = s
            try:
                yield
            finally:
                if previous is None:
                    host.current.pop(s.device_index, None)
                else:
                    host.current[s.device_index] = previous
                host.device = device

        class device:  # noqa: N801 - torch.cuda's name
            def __init__(self, index: Any) -> None:
                self.index = sim._device_index(index)

            def __enter__(self) -> None:
                host = sim._this_host(sim._this_process())
                self.previous, host.device = host.device, self.index

            def __exit__(self, *exc: Any) -> None:
                sim._this_host(sim._this_process()).device = self.previous

        def set_device(index: Any) -> None:
            # cudaSetDevice: since CUDA 12 it makes the device's primary context (the rank's own: no report).
            dev = sim._device_index(index)
            sim._context("torch.cuda.set_device", dev)
            sim._this_host(sim._this_process()).device = dev

        def synchronize(index: Any = None) -> None:
            sim._count("synchronize")
            process = sim._this_process()
            dev = sim._device_index(index)
            sim._context("torch.cuda.synchronize", dev)
            for s in [s for s in process.streams() if s.device_index == dev]:
                sim._wait_for_tail(s, f"torch.cuda.synchronize({dev}), waiting for {s.name}")
            process.check_error()

        def current_stream(index: Any = None) -> SimStream:
            sim._count("current_stream")
            return sim._this_process().current_stream(sim._device_index(index))

        def default_stream(index: Any = None) -> SimStream:
            return sim._this_process().default_stream(sim._device_index(index))

        def set_stream(s: SimStream) -> None:
            host = sim._this_host(sim._this_process())
            host.device = s.device_index  # torch's _cuda_setStream makes the stream's device current too
            host.current[s.device_index] = s

        def mem_get_info(index: Any = None) -> tuple[int, int]:
            dev = sim._device_index(index)
            sim._context("torch.cuda.mem_get_info", dev)
            return DEVICE_MEMORY - sim._allocated[dev] - sim._nccl_memory[dev], DEVICE_MEMORY

        patches = {
            "_lazy_init": lambda: None, "is_available": lambda: True, "is_initialized": lambda: True,
            "device_count": lambda: sim.device_count,
            "current_device": lambda: sim._this_process().device, "set_device": set_device, "device": device,
            "Stream": lambda device=None, priority=0: sim.new_stream(device, priority),
            "Event": lambda enable_timing=False, blocking=False, interprocess=False: sim.new_event(enable_timing),
            "current_stream": current_stream, "default_stream": default_stream, "set_stream": set_stream,
            "stream": stream, "synchronize": synchronize, "mem_get_info": mem_get_info,
            "get_device_capability": lambda index=None: sim.capability,
            "get_device_name": lambda index=None: sim.device_name,
            "memory_allocated": lambda index=None: sim._allocated[sim._device_index(index)],
            # No caching allocator here: what torch reserves is what its tensors hold.
            "memory_reserved": lambda index=None: sim._allocated[sim._device_index(index)],
        }
        for name, value in patches.items():
            self._patch(cuda, name, value)
        for name in _FACTORIES:
            self._patch(torch, name, _factory_patch(self, getattr(torch, name)))
        for name in _HOST_TO_DEVICE:
            self._patch(torch, name, _h2d_patch(self, getattr(torch, name)))
        original_to = torch.Tensor.to

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if type(tensor) is not SimTensor and (any(_is_cuda(a) for a in args) or _is_cuda(kwargs.get("device"))):
                device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
                return sim.h2d(tensor, sim._device_index(device), dtype, non_blocking)
            return original_to(tensor, *args, **kwargs)

        def cuda_(tensor: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
            if type(tensor) is SimTensor:
                return SimTensor.cuda(tensor, device, non_blocking)
            return sim.h2d(tensor, sim._device_index(device), None, non_blocking)

        self._patch(torch.Tensor, "to", to)
        self._patch(torch.Tensor, "cuda", cuda_)
        original_start = threading.Thread.start

        def start(thread: threading.Thread) -> None:
            # A thread the product starts (a watchdog) acts in the process that started it, with the sim's modes.
            process = getattr(sim._tls, "process", None)
            if process is not None and not getattr(thread, "_sim_unbound", False):
                run = thread.run
                host = sim._new_host(process, sim._this_host(process), thread.name)

                def bound_run() -> None:
                    if sim._installed:
                        with sim.bind(process.rank, host):
                            run()
                    else:
                        run()

                thread.run = bound_run  # type: ignore[method-assign]
            original_start(thread)

        self._patch(threading.Thread, "start", start)

    def _patch_host_memory(self) -> None:
        """Pinned host memory (``Tensor.pin_memory``, ``is_pinned``; torch's CPU build has none) and the host's reads of
        it (``tolist``, ``item``, ``int()`` ...), which ``_host_read`` checks against the copies still writing it."""
        sim = self

        def pin_memory(tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
            if type(tensor) is SimTensor:
                raise RuntimeError(f"cannot pin a {tensor.device} tensor: only dense CPU tensors can be pinned")
            return sim.pin(tensor)

        def is_pinned(tensor: torch.Tensor, device: Any = None) -> bool:
            return type(tensor) is not SimTensor and sim._pinned_block(tensor) is not None

        self._patch(torch.Tensor, "pin_memory", pin_memory)
        self._patch(torch.Tensor, "is_pinned", is_pinned)
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)

            def read(tensor: torch.Tensor, *args: Any, _original: Any = original, _name: str = name,
                     **kwargs: Any) -> Any:
                if sim._pinned and type(tensor) is not SimTensor:
                    sim._host_read(tensor, _name)
                return _original(tensor, *args, **kwargs)

            read.__name__ = name
            self._patch(torch.Tensor, name, read)

    # ---- pinned host memory and non-blocking device-to-host copies --------------------------------------------

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.pin_memory()``: a copy in pinned host memory the sim knows (same sizes and strides), or ``tensor``
        itself where it is pinned already (as torch's)."""
        if self._pinned_block(tensor) is not None:
            return tensor
        out = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)
        out.copy_(tensor)
        self._register_pinned(out)
        return out

    def _register_pinned(self, tensor: torch.Tensor) -> _PinnedBlock | None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0:  # nothing allocated (no elements): nothing to pin
            return None
        block = _PinnedBlock(next(self._pinned_numbers) << 32,
                             f"pinned host {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}")
        with self.lock:
            self._pinned[ptr] = block
            if self.hb is not None:
                self.hb.allocated(block.key, block.label, self._this_host(self._this_process()).name)
        weakref.finalize(storage, self._pinned.pop, ptr, None)  # torch keeps one Python storage per storage
        return block

    def _pinned_block(self, tensor: torch.Tensor) -> _PinnedBlock | None:
        if not self._pinned or type(tensor) is SimTensor:
            return None
        try:
            if tensor.device.type != "cpu":
                return None
            return self._pinned.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
            return None

    def _d2h_async(self, dst: torch.Tensor, src: SimTensor, block: _PinnedBlock) -> torch.Tensor:
        """A non-blocking device-to-host copy into pinned memory, as CUDA's: enqueued on the current stream, the host
        returns at once, and ``dst`` holds the sim's poison (``POISON_BYTE``) until the copy runs, so a reader that did
        not wait for it reads garbage; ``_host_read`` reports such a read."""
        stream = self._this_process().current_stream(src._sim_storage.device)
        self._count("copy (device to host, non-blocking)")
        if dst.numel():
            flat = torch.full((dst.numel() * dst.element_size(),), POISON_BYTE, dtype=torch.uint8)
            dst.copy_(flat.view(dst.dtype).view(dst.shape))
        lo, hi = _byte_range(dst)
        inner = src._inner
        op = self._launch(stream, "copy_ (device to host)", lambda: dst.copy_(inner),
                          [(src, False), ((block.key, lo, hi), True)])
        with self.lock:
            block.pending = [p for p in block.pending if not p[0].done] + [(op, lo, hi)]
        return dst

    def _host_read(self, tensor: torch.Tensor, what: str) -> None:
        """The host reads ``tensor``'s values: if it is pinned memory, a copy into it the host has not waited for is a
        happens-before race (``hb``), and one that has not even run yet is counted (``counters["host read of a
        pending copy"]``) and kept in ``early_reads``."""
        block = self._pinned_block(tensor)
        if block is None:
            return
        lo, hi = _byte_range(tensor)
        process = getattr(self._tls, "process", None)
        if process is None and len(self._processes) <= 1:
            process = self.process(0)
        with self.lock:
            block.pending = [p for p in block.pending if not p[0].done]
            late = [op for op, a, b in block.pending if a < hi and lo < b]
            if late:
                where = hb_cuda.site(2)
                self.early_reads.append(f"the host read {block.label}, bytes [{lo}, {hi}), by {what}() at {where} "
                                        f"before {late[0].describe()} had run: it read the sim's poison "
                                        f"({POISON_BYTE:#04x} bytes) where a GPU's host reads stale memory")
                if process is not None:
                    process.counters["host read of a pending copy"] += 1
            if self.hb is not None and process is not None:
                host = self._this_host(process).name
                self.hb.host_tick(host)
                self.hb.touch(block.key, lo, hi, False, host, f"host {what}()", hb_cuda.site(2))

    # ---- streams and events -----------------------------------------------------------------------------------

    def new_stream(self, device: Any = None, priority: int = 0) -> SimStream:
        """``torch.cuda.Stream()``: the next stream of the process's pool for that device and priority, round-robin
        (torch's ``getStreamFromPool``: ``stream_pool`` streams each, shared by every user of the process, so two
        ``Stream()`` calls may return the same stream)."""
        process = self._this_process()
        self._count("Stream")
        index = self._device_index(device)
        key = (process.rank, index, priority)
        with self.lock:
            pool = self._pools.setdefault(key, [])
            turn = self._pool_next[key] % self.stream_pool
            self._pool_next[key] += 1
            if turn == len(pool):
                pool.append(SimStream(self, process, index, priority))
            return pool[turn]

    # ---- CUDA contexts and object lifetimes (issue 46, findings 1 and 2) ------------------------------------------

    def _context(self, what: str, device: int | None = None) -> None:
        """A CUDA runtime call by this thread, in the primary context of ``device`` (the device a torch guard sets) or,
        unguarded, of the thread's current device: the first such call makes that context (CUDA's lazy init), about
        half a GiB of the device's memory per process. One off the rank's own device is ``foreign_contexts``."""
        process = getattr(self._tls, "process", None)
        if process is None:
            return  # a stream's worker (the device itself), or a thread bound to no rank
        if device is None:
            device = self._this_host(process).device
        made = process.contexts.get(device)
        if made is None:
            made = process.contexts[device] = {}
        name = threading.current_thread().name
        if name not in made:
            made[name] = what

    @property
    def foreign_contexts(self) -> list[str]:
        """Every CUDA context a rank's thread made on a device other than the rank's own, named: what a thread that
        never set its device does on a GPU (a context on GPU 0 from every rank)."""
        return [f"rank {p.rank} (own device cuda:{p.own_device}): a context on cuda:{device} made by thread "
                f"{thread!r} in {what}"
                for p in list(self._processes.values()) for device, made in sorted(p.contexts.items())
                if device != p.own_device for thread, what in made.items()]

    def check_contexts(self) -> None:
        """AssertionError naming every context off a rank's own device (``strict_contexts``: at the end of every
        ``with Sim()``)."""
        foreign = self.foreign_contexts
        if foreign:
            raise AssertionError("CUDA contexts off a rank's own device: " + "; ".join(foreign[:8])
                                 + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""))

    def _destroyed(self, event: SimEvent) -> None:
        """A CUDA event's destruction, on the calling thread (``SimEvent.__del__``)."""
        self._life(f"destroyed {event.name}", event.rank)

    def _life(self, what: str, rank: int | None) -> None:
        self.lifecycle.append((next(self._lifecycle_seq), what, threading.current_thread().name, rank))

    def destroyed_before_aborts(self, thread_prefix: str) -> list[str]:
        """Events destroyed on a thread whose name starts with ``thread_prefix`` while one of that rank's NCCL aborts
        had not returned yet, or before its first abort started (issue 46, finding 2: a watchdog must not destroy
        CUDA objects before its aborts have returned)."""
        out = []
        by_rank: dict[int | None, list[tuple[int, str, str]]] = collections.defaultdict(list)
        for seq, what, thread, rank in self.lifecycle:
            by_rank[rank].append((seq, what, thread))
        for rank, items in by_rank.items():
            returns = [seq for seq, what, _ in items if what.startswith("abort returned")]
            last_return = max(returns) if returns else None
            for seq, what, thread in items:
                if what.startswith("destroyed") and thread.startswith(thread_prefix) and (
                        last_return is None or seq < last_return):
                    out.append(f"rank {rank}: {what} on thread {thread!r} before its aborts returned")
        return out

    def new_event(self, enable_timing: bool = False) -> SimEvent:
        self._count("Event")
        return SimEvent(self, enable_timing)

    def name_stream(self, stream: SimStream, name: str) -> None:
        """Call ``stream`` ``name`` in reports (and in the happens-before checker); ``name#2`` where taken."""
        with self.lock:
            taken = {s.name for s in self._streams.values() if s is not stream}
            base, n = name, 1
            while name in taken:
                n += 1
                name = f"{base}#{n}"
            if self.hb is not None:
                self.hb.rename(stream.name, name)
            stream.name = name

    def kernel(self, seconds: float = 0.0, name: str = "compute", stream: SimStream | None = None,
               reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = (),
               fn: Callable[[], Any] | None = None) -> Op:
        """A synthetic kernel of ``seconds`` (virtual) on ``stream`` (the current one), reading and writing the given
        device tensors (for the happens-before checker), running ``fn`` when it runs."""
        stream = stream if stream is not None else self._this_process().current_stream()
        op = Op(stream, "kernel", name, fn, duration=seconds)
        accesses = [(t, False) for t in reads] + [(t, True) for t in writes]
        self._enqueue(op, accesses=accesses)
        return op

    def fail_device(self, rank: int, what: str = "an illegal memory access was encountered") -> None:
        """A sticky CUDA error in ``rank``'s process (a kernel that faulted): from now on every query, synchronize and
        device-to-host copy of that process raises, on any of its threads, as CUDA's runtime does."""
        process = self.process(rank)
        with self.lock:
            process.error = process.error or RuntimeError(f"CUDA error: {what}")
            self.changed()

    def stall(self, stream: SimStream | None = None, name: str = "a stalled kernel") -> threading.Event:
        """A kernel on ``stream`` (the current one) that runs until the returned event is set (or the sim stops): a
        GPU kernel that never completes."""
        release = threading.Event()
        stream = stream if stream is not None else self._this_process().current_stream()
        op = Op(stream, "stall", name)
        op.nccl = release
        self._enqueue(op)
        return release

    # ---- the queue ----------------------------------------------------------------------------------------------

    def _count(self, kind: str, n: int = 1) -> None:
        process = getattr(self._tls, "process", None) or self._processes.get(0)
        if process is not None:
            process.counters[kind] += n

    @property
    def counters(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for process in list(self._processes.values()):
            total.update(process.counters)
        return total

    def _enqueue(self, op: Op, accesses: Sequence[tuple[Any, bool]] = (), hb_join: dict[str, int] | None = None,
                 site: str | None = None) -> Op:
        """Append ``op`` to its stream (blocking while the stream's launch queue is full), record its accesses."""
        stream = op.stream
        sim = self
        self._context(op.name, stream.device_index)  # a launch runs under a guard on its stream's device
        host = self._this_process() if getattr(self._tls, "process", None) is not None else stream.process
        if self.stopped:
            raise SimStopped("the sim was stopped")
        if len(stream.queue) >= self.launch_bound:
            self._host_wait(lambda: len(stream.queue) < sim.launch_bound, [stream],
                            f"a launch onto {stream.name}, whose launch queue is full ({self.launch_bound} pending "
                            f"operations)")
        with self.lock:
            stream.enqueued += 1
            op.seq = stream.enqueued
            op.not_before = self._this_host(host).host_time
            if op.kind in ("kernel", "nccl", "stall"):
                stream.launches += 1
                host.counters["launch"] += 1
            hb = self.hb
            if hb is not None:
                hb.enqueue(stream.name, self._this_host(host).name)
                hb.join_into(stream.name, hb_join)
                if accesses:
                    where = site or hb_cuda.site(3)
                    for tensor, write in accesses:
                        self._hb_touch(tensor, write, stream.name, op.name, where)
                op.hb_clock = hb.snapshot(stream.name)
            stream.queue.append(op)
            stream.tail = op
            if stream._worker is None:
                stream._worker = threading.Thread(target=self._work, args=(stream,), daemon=True,
                                                  name=f"sim-worker {stream.name}")
                stream._worker._sim_unbound = True  # type: ignore[attr-defined]
                stream._worker.start()
            elif stream._idle:
                stream._idle = False
                stream._work_ready.changed()
        return op

    def _hb_touch(self, tensor: Any, write: bool, thread: str, op: str, site: str) -> None:
        if isinstance(tensor, tuple):  # (address, lo, hi): an NCCL buffer
            addr, lo, hi = tensor
        else:
            if tensor.numel() == 0:
                return
            addr = tensor._sim_storage.addr
            size = tensor.element_size()
            extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
            lo = tensor.storage_offset() * size
            hi = lo + extent * size
        self.hb.touch(addr, lo, hi, write, thread, op, site)

    def _work(self, stream: SimStream) -> None:
        """A stream's worker: runs its FIFO in order, each op after what it waits for."""
        with contextlib.suppress(SimStopped), self.lock:
            while True:
                if not stream.queue:
                    stream._idle = True
                    self._wait_locked(lambda: bool(stream.queue), [stream._work_ready], None)
                    stream._idle = False
                op = stream.queue[0]
                deps = op.deps
                if deps:
                    self._wait_locked(lambda deps=deps: all(d.done for d in deps), list({d.stream for d in deps}),
                                      None)
                op.start = max(stream.clock, op.not_before, *(d.end for d in deps))
                op.end = op.start + op.duration
                if op.kind == "nccl":
                    self.nccl.run_kernel(op)  # spins (waits) here until it completes or exits
                elif op.kind == "stall":
                    release = op.nccl
                    self._wait_locked(release.is_set, [stream], None, poll=0.05)
                elif op.fn is not None:
                    self.lock.release()
                    try:
                        op.fn()
                    except BaseException as error:  # noqa: BLE001 - a failed kernel: sticky on its process
                        op.failed = error
                        op.process.error = op.process.error or error
                    finally:
                        self.lock.acquire()
                stream.clock = max(stream.clock, op.end)
                op.done = True
                stream.queue.popleft()
                stream.completed += 1
                op.fn = None
                stream.changed()

    def _wait_locked(self, pred: Callable[[], bool], on: Sequence[_Watched], bound_s: float | None,
                     where: str = "", poll: float | None = None) -> None:
        """Wait (holding ``self.lock``) until ``pred()``; ``SimHang`` after ``bound_s`` (None: no bound, for the
        workers); ``SimStopped`` once the sim stops."""
        if pred():
            return
        cond = getattr(self._tls, "cond", None)
        if cond is None:
            cond = self._tls.cond = threading.Condition(self.lock)
        watched = [*on, self]
        for w in watched:
            w.watchers.add(cond)
        try:
            limit = None if bound_s is None else time.monotonic() + bound_s
            while not pred():
                if self.stopped:
                    raise SimStopped(f"the sim was stopped while waiting for {where or 'work'}")
                timeout = poll
                if limit is not None:
                    remaining = limit - time.monotonic()
                    if remaining <= 0:
                        text = (f"SimHang: {self._who()} was blocked for {bound_s:g} s in {where} (on a GPU it would "
                                f"never return). {self.state()}")
                        self.hangs.append(text)
                        raise SimHang(text)
                    timeout = remaining if timeout is None else min(timeout, remaining)
                cond.wait(timeout)
        finally:
            for w in watched:
                w.watchers.discard(cond)

    def _host_wait(self, pred: Callable[[], bool], on: Sequence[_Watched], where: str) -> None:
        with self.lock:
            self._wait_locked(pred, on, self.hang_bound_s, where)

    def _host_joined(self, process: SimProcess, stream: str | None, until: float,
                     clock: dict[str, int] | None = None) -> None:
        """``process``'s host waited for ``stream`` (everything on it so far) or for what ``clock`` covers."""
        with self.lock:
            host = self._this_host(process)
            host.host_time = max(host.host_time, until)
            if self.hb is not None:
                self.hb.host_joins(host.name, self.hb.clocks.get(stream) if stream is not None else clock)

    def _who(self) -> str:
        process = getattr(self._tls, "process", None)
        name = threading.current_thread().name
        return f"the host of rank {process.rank} (thread {name!r})" if process is not None else f"thread {name!r}"

    def state(self) -> str:
        """What every stream's head waits for (the SimHang message's diagnosis)."""
        lines = []
        for stream in list(self._streams.values()):
            if not stream.queue:
                continue
            head = stream.queue[0]
            lines.append(f"{stream.name}: {len(stream.queue)} pending, head {head.name} {self._waits_for(head)}")
        nccl = self.nccl.state()
        return ("Stream heads: " + "; ".join(lines) if lines else "Every stream is drained.") + (
            f" {nccl}" if nccl else "")

    def _waits_for(self, op: Op) -> str:
        pending = [d for d in op.deps if not d.done]
        if pending:
            d = pending[0]
            return f"waits for {d.describe()}, behind {d.stream.queue[0].describe() if d.stream.queue else '?'}"
        if op.kind == "nccl":
            return self.nccl.waiting_for(op)
        if op.kind == "stall":
            return "(a stalled kernel: never completes)"
        return "is running"

    # ---- memory -------------------------------------------------------------------------------------------------

    def _device_index(self, device: Any) -> int:
        if device is None:
            return self._this_process().device
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                raise SimError(f"not a CUDA device: {device}")
            index = self._this_process().device if device.index is None else device.index
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (the sim has {self.device_count})")
        return index

    def _allocate_address(self, storage: SimStorage) -> int:
        with self.lock:
            addr = self._next_address
            self._next_address += max(ADDRESS_ALIGNMENT, -(-storage.nbytes // ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT)
            bisect.insort(self._addresses, addr)
            self._by_address[addr] = weakref.ref(storage)
            self._allocated[storage.device] += storage.nbytes
            if self.hb is not None:
                self.hb.allocated(addr, storage.label, storage.alloc_stream.name)  # the hb key: addresses are unique
            return addr

    def _freed(self, addr: int, nbytes: int, device: int, process: SimProcess, alloc_stream: str,
               recorded: set[SimStream]) -> None:
        with self.lock:
            self._by_address.pop(addr, None)
            i = bisect.bisect_left(self._addresses, addr)
            if i < len(self._addresses) and self._addresses[i] == addr:
                del self._addresses[i]
            self._allocated[device] -= nbytes
            if self.hb is not None and not self.stopped:
                self.hb.freed(addr, process.host, tuple(s.name for s in recorded))

    def resolve(self, ptr: int, nbytes: int, device: int) -> tuple[SimStorage, int]:
        """The allocation holding ``[ptr, ptr + nbytes)`` and the offset of ``ptr`` in it; SimError where CUDA would
        fault (no allocation, out of bounds, another device)."""
        with self.lock:
            i = bisect.bisect_right(self._addresses, ptr) - 1
            ref = self._by_address.get(self._addresses[i]) if i >= 0 else None
            storage = ref() if ref is not None else None
            if storage is None or ptr + nbytes > storage.addr + storage.nbytes:
                raise SimError(f"illegal memory access: {nbytes} bytes at {ptr:#x} lie in no live allocation")
            if storage.device != device:
                raise SimError(f"pointer {ptr:#x} is on cuda:{storage.device}, the call runs on cuda:{device}")
            return storage, ptr - storage.addr

    def wrap(self, inner: torch.Tensor, storage: SimStorage) -> SimTensor:
        return SimTensor(inner, storage)

    def empty(self, size: Sequence[int], stride: Sequence[int] | None, dtype: torch.dtype, device: int,
              label: str | None = None) -> SimTensor:
        """A new device allocation (no kernel: ``empty`` only allocates)."""
        inner = torch.empty_strided(tuple(size), tuple(stride), dtype=dtype) if stride is not None else torch.empty(
            tuple(size), dtype=dtype)
        stream = self._this_process().current_stream(device)
        what = label or f"{str(dtype).removeprefix('torch.')}{list(size)}"
        return SimTensor(inner, SimStorage(self, stream.process, device, inner.untyped_storage(), stream, what))

    def name(self, tensor: SimTensor, label: str) -> None:
        """Call ``tensor``'s allocation ``label`` in reports."""
        tensor._sim_storage.label = label
        if self.hb is not None:
            self.hb.name(tensor._sim_storage.addr, label)

    # ---- happens-before -------------------------------------------------------------------------------------------

    @property
    def races(self) -> dict[str, int]:
        return {} if self.hb is None else self.hb.races

    def hb_report(self, limit: int = 8) -> str:
        return "" if self.hb is None else self.hb.report(limit)

    def access(self, tensor: SimTensor, write: bool, op: str, on_host: bool = False) -> None:
        """Record an access no aten op shows, on the current stream or, with ``on_host``, by the host."""
        if self.hb is None:
            return
        process = self._this_process()
        with self.lock:
            if on_host:
                host = self._this_host(process).name
                self.hb.host_tick(host)
                self._hb_touch(tensor, write, host, op, hb_cuda.site(2))
            else:
                self._enqueue(Op(process.current_stream(tensor._sim_storage.device), "kernel", op),
                              accesses=[(tensor, write)], site=hb_cuda.site(2))

    # ---- dispatch -----------------------------------------------------------------------------------------------

    _infos: dict[Any, _OpInfo] = {}

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        sims: list[SimTensor] = []
        cpus: list[torch.Tensor] = []
        uargs = _unwrap(args, sims, cpus)
        ukwargs = {k: _unwrap_one(v, sims, cpus) for k, v in kwargs.items()} if kwargs else kwargs
        if not sims:
            return func(*args, **kwargs)
        info = self._infos.get(func)
        if info is None:
            info = self._infos[func] = _OpInfo(func)
        if func in _SPECIAL:
            return _SPECIAL[func](self, func, args, kwargs, sims, cpus)
        device = sims[0]._sim_storage.device
        for t in sims:
            if t._sim_storage.device != device:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"cuda:{device} and cuda:{t._sim_storage.device}!")
        for t in cpus:
            if t.dim() != 0:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"cuda:{device} and cpu! (in {func})")
        kind = info.kind
        if kind == "view":
            out = func(*uargs, **ukwargs)
            return _rewrap(out, sims[0]._sim_storage)
        if kind == "scalar":
            if info.name in _METADATA_ONLY:
                return func(*uargs, **ukwargs)
            self._sync_current(device, f"{func} (a value for the host)")
            return func(*uargs, **ukwargs)
        if cpus:  # a 0-dim CPU tensor is a scalar argument: read at the call, as CUDA passes it by value
            uargs = tuple(a.clone() if isinstance(a, torch.Tensor) and not isinstance(a, SimTensor) and a.dim() == 0
                          and a.device.type == "cpu" else a for a in uargs)
        stream = self._this_process().current_stream(device)
        if kind == "mutate":
            written = _written(info, args, kwargs, func)
            accesses = [(t, any(t is w for w in written)) for t in sims]
            self._launch(stream, info.name, lambda: func(*uargs, **ukwargs), accesses, args)
            returns = [None if alias is None else _arg(func, args, kwargs, alias) for alias in info.returns_alias]
            if not info.returns_alias:
                return None
            return returns[0] if len(returns) == 1 else tuple(returns)
        return self._functional(func, info, args, kwargs, uargs, ukwargs, sims, stream, device)

    def _launch(self, stream: SimStream, name: str, fn: Callable[[], Any], accesses: Sequence[tuple[Any, bool]],
                args: tuple[Any, ...] = ()) -> Op:
        duration = self.op_cost(name, args) if self.op_cost is not None else 0.0
        return self._enqueue(Op(stream, "kernel", f"aten.{name}", fn, duration=duration), accesses=accesses)

    def _functional(self, func: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any],
                    uargs: tuple[Any, ...], ukwargs: dict[str, Any], sims: list[SimTensor], stream: SimStream,
                    device: int) -> Any:
        try:
            meta = func(*_to_meta(args), **{k: _to_meta_one(v) for k, v in kwargs.items()})
        except Exception:  # noqa: BLE001 - no metadata: synchronize and run it now (counted)
            self.fallbacks[info.name] += 1
            self._sync_current(device, f"{func} (no metadata: run at once)")
            out = func(*uargs, **ukwargs)
            return _rewrap_new(self, out, device, stream)
        outs: list[torch.Tensor] = []
        wrapped = _alloc_like(self, meta, device, stream, outs)
        if info.name in hb_cuda.ALLOC_ONLY:
            return wrapped
        inner_outs = [o._inner for o in outs]

        def run() -> None:
            result = func(*uargs, **ukwargs)
            flat = result if isinstance(result, list | tuple) else (result,)
            for dst, src in zip(inner_outs, [r for r in flat if isinstance(r, torch.Tensor)], strict=True):
                dst.copy_(src)

        self._launch(stream, info.name, run, [(t, False) for t in sims] + [(o, True) for o in outs], args)
        return wrapped

    def _factory(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``torch.empty(..., device="cuda")`` and the like: allocated from the call's metadata; all but ``empty*``
        fill it with a kernel on the current stream."""
        device = self._device_index(kwargs["device"])
        meta_kwargs = {**kwargs, "device": "meta"}
        meta_kwargs.pop("pin_memory", None)
        meta = func(*_to_meta(args), **meta_kwargs)
        stream = self._this_process().current_stream(device)
        outs: list[torch.Tensor] = []
        wrapped = _alloc_like(self, meta, device, stream, outs)
        name = func.__name__
        if name in hb_cuda.ALLOC_ONLY:
            return wrapped
        cpu_args = tuple(a._inner if isinstance(a, SimTensor) else a for a in args)
        cpu_kwargs = {**kwargs, "device": "cpu"}
        inner = outs[0]._inner

        def run() -> None:
            inner.copy_(func(*cpu_args, **cpu_kwargs))

        self._launch(stream, name, run, [(outs[0], True)])
        return wrapped

    def _sync_current(self, device: int, why: str) -> None:
        process = self._this_process()
        stream = process.current_stream(device)
        self._wait_for_tail(stream, f"{why}, which synchronizes {stream.name}")
        process.check_error()

    def _wait_for_tail(self, stream: SimStream, where: str) -> None:
        """The host waits for everything enqueued on ``stream`` so far (not what other threads enqueue meanwhile)."""
        tail = stream.tail
        if tail is None:
            return
        self._host_wait(lambda: tail.done, [stream], where)
        self._host_joined(self._this_process(), None, tail.end, tail.hb_clock)

    def h2d(self, src: torch.Tensor, device: int, dtype: torch.dtype | None, non_blocking: bool,
            dst: SimTensor | None = None) -> SimTensor:
        """A host-to-device copy on the current stream: ``src`` is read now; a blocking copy then synchronizes."""
        snapshot = src.detach().to(dtype=dtype or src.dtype, copy=True)
        stream = self._this_process().current_stream(device)
        if dst is None:
            dst = self.empty(snapshot.shape, snapshot.stride(), snapshot.dtype, device)
        inner = dst._inner

        def run() -> None:
            inner.copy_(snapshot)

        self._launch(stream, "copy_ (host to device)", run, [(dst, True)])
        if not non_blocking:
            self._count("blocking copy")
            self._sync_current(device, f"a blocking host-to-device copy of {snapshot.numel()} elements")
        return dst


_MISSING = object()


class _PinnedBlock:
    """One pinned host storage the sim knows: its key in the happens-before checker, its label, and the non-blocking
    copies into it not yet seen done (op, first byte, end byte)."""

    __slots__ = ("key", "label", "pending")

    def __init__(self, key: int, label: str) -> None:
        self.key = key
        self.label = label
        self.pending: list[tuple[Op, int, int]] = []


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``tensor`` spans (from its first to its last element)."""
    if tensor.numel() == 0:
        return 0, 0
    size = tensor.element_size()
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    lo = tensor.storage_offset() * size
    return lo, lo + extent * size


def _factory_patch(sim: Sim, original: Callable[..., Any]) -> Callable[..., Any]:
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")) and _ACTIVE is sim:
            return sim._factory(original, args, kwargs)
        if kwargs.get("pin_memory") and _ACTIVE is sim:
            return sim.pin(original(*args, **{**kwargs, "pin_memory": False}))
        return original(*args, **kwargs)

    factory.__name__ = original.__name__
    return factory


def _h2d_patch(sim: Sim, original: Callable[..., Any]) -> Callable[..., Any]:
    def host_to_device(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if _is_cuda(device) and _ACTIVE is sim:
            cpu = original(*args, **{**kwargs, "device": "cpu"})
            return sim.h2d(cpu, sim._device_index(device), None, False)  # built on the host, then a blocking copy
        return original(*args, **kwargs)

    host_to_device.__name__ = original.__name__
    return host_to_device


def _sim() -> Sim:
    sim = _ACTIVE
    if sim is None:
        raise SimError("a simulated device tensor used while no Sim is installed")
    return sim


def _unwrap_one(value: Any, sims: list[SimTensor], cpus: list[torch.Tensor]) -> Any:
    if isinstance(value, SimTensor):
        sims.append(value)
        return value._inner
    if isinstance(value, torch.Tensor):
        cpus.append(value)
        return value
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return type(value)(_unwrap_one(v, sims, cpus) for v in value)
    return value


def _unwrap(args: tuple[Any, ...], sims: list[SimTensor], cpus: list[torch.Tensor]) -> tuple[Any, ...]:
    return tuple(_unwrap_one(a, sims, cpus) for a in args)


def _to_meta_one(value: Any) -> Any:
    if isinstance(value, SimTensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return type(value)(_to_meta_one(v) for v in value)
    return value


def _to_meta(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_to_meta_one(a) for a in args)


def _rewrap(out: Any, storage: SimStorage) -> Any:
    if isinstance(out, torch.Tensor):
        return SimTensor(out, storage)
    if isinstance(out, list | tuple):
        return type(out)(_rewrap(o, storage) for o in out)
    return out


def _rewrap_new(sim: Sim, out: Any, device: int, stream: SimStream) -> Any:
    """Results computed at once on the host (a fallback): each a new allocation."""
    if isinstance(out, torch.Tensor):
        inner = out.clone() if out._base is not None else out
        return SimTensor(inner, SimStorage(sim, stream.process, device, inner.untyped_storage(), stream,
                                           f"{str(inner.dtype).removeprefix('torch.')}{list(inner.shape)}"))
    if isinstance(out, list | tuple):
        return type(out)(_rewrap_new(sim, o, device, stream) for o in out)
    return out


def _alloc_like(sim: Sim, meta: Any, device: int, stream: SimStream, outs: list[torch.Tensor]) -> Any:
    if isinstance(meta, torch.Tensor):
        t = sim.empty(meta.shape, meta.stride(), meta.dtype, device)
        outs.append(t)
        return t
    if isinstance(meta, list | tuple):
        return type(meta)(_alloc_like(sim, m, device, stream, outs) for m in meta)
    return meta


def _arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> Any:
    name = func._schema.arguments[index].name
    return args[index] if index < len(args) else kwargs.get(name)


def _written(info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], func: Any) -> list[Any]:
    written = []
    for i in info.writes:
        value = _arg(func, args, kwargs, i)
        written.extend(value if isinstance(value, list | tuple) else [value])
    return written


# ---- ops the generic rules do not cover -----------------------------------------------------------------------


def _to_copy(sim: Sim, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], sims: list[SimTensor],
             cpus: list[torch.Tensor]) -> Any:
    src = args[0]
    target = kwargs.get("device")
    dtype = kwargs.get("dtype")
    non_blocking = bool(kwargs.get("non_blocking", False))
    if target is not None and torch.device(target).type == "cpu":  # device to host: waits for the stream
        device = src._sim_storage.device
        if non_blocking:  # torch's _to_copy: into pinned memory, asynchronous
            out = torch.empty_like(src._inner, dtype=dtype or src.dtype)
            block = sim._register_pinned(out)
            if block is not None:
                return sim._d2h_async(out, src, block)
        sim._count("copy (device to host)")
        sim._sync_current(device, f"a device-to-host copy of {src.numel()} elements")
        out = src._inner.to(dtype=dtype or src.dtype, copy=True)
        process = sim._this_process()
        if sim.hb is not None:
            with sim.lock:
                sim._hb_touch(src, False, sim._this_host(process).name, "aten._to_copy (device to host)",
                              hb_cuda.site(3))
        return out
    if not isinstance(src, SimTensor):  # host to device
        return sim.h2d(src, sim._device_index(target), dtype, non_blocking)
    device = src._sim_storage.device if target is None else sim._device_index(target)
    if device != src._sim_storage.device:
        raise SimError("device-to-device copies between simulated GPUs are not modelled")
    info = sim._infos[func]
    stream = sim._this_process().current_stream(device)
    uargs = _unwrap(args, [], [])
    ukwargs = {k: v for k, v in kwargs.items()}
    return sim._functional(func, info, args, kwargs, uargs, ukwargs, sims, stream, device)


def _copy_(sim: Sim, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], sims: list[SimTensor],
           cpus: list[torch.Tensor]) -> Any:
    dst, src = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if isinstance(dst, SimTensor) and isinstance(src, SimTensor):
        if dst._sim_storage.device != src._sim_storage.device:
            raise SimError("device-to-device copies between simulated GPUs are not modelled")
        d, s = dst._inner, src._inner
        sim._launch(sim._this_process().current_stream(dst._sim_storage.device), "copy_", lambda: d.copy_(s),
                    [(src, False), (dst, True)])
        return dst
    if isinstance(dst, SimTensor):  # host to device, into an existing tensor: the source is read now
        device = dst._sim_storage.device
        value, d = src.detach().clone(), dst._inner
        sim._launch(sim._this_process().current_stream(device), "copy_ (host to device)", lambda: d.copy_(value),
                    [(dst, True)])
        if not non_blocking and src.dim() != 0:
            sim._count("blocking copy")
            sim._sync_current(device, f"a blocking host-to-device copy of {src.numel()} elements")
        return dst
    device = src._sim_storage.device  # device to host: asynchronous into pinned memory only, as CUDA's
    block = sim._pinned_block(dst) if non_blocking else None
    if block is not None:
        return sim._d2h_async(dst, src, block)
    sim._count("copy (device to host)")
    sim._sync_current(device, f"a device-to-host copy of {src.numel()} elements")
    if sim.hb is not None:
        with sim.lock:
            sim._hb_touch(src, False, sim._this_host(sim._this_process()).name, "aten.copy_ (device to host)",
                          hb_cuda.site(3))
    return dst.copy_(src._inner)


def _refuse(sim: Sim, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], sims: list[SimTensor],
            cpus: list[torch.Tensor]) -> Any:
    raise SimError(f"{func} is not modelled on the simulated device")


_SPECIAL: dict[Any, Callable[..., Any]] = {
    torch.ops.aten._to_copy.default: _to_copy,
    torch.ops.aten.copy_.default: _copy_,
    torch.ops.aten.set_.source_Storage: _refuse,
    torch.ops.aten.set_.source_Storage_storage_offset: _refuse,
    torch.ops.aten.set_.source_Tensor: _refuse,
    torch.ops.aten.resize_.default: _refuse,
}


# ---- pytest ------------------------------------------------------------------------------------------------------


@pytest.fixture(name="sim")
def sim_fixture() -> Iterator[Sim]:
    """A ``Sim()`` installed for the test (its defaults; build your own ``with Sim(...)`` for other settings)."""
    with Sim() as installed:
        yield installed


__all__ = ["DEFAULT_HANG_BOUND_S", "DEFAULT_LAUNCH_BOUND", "Op", "Sim", "SimError", "SimEvent", "SimHang",
           "SimProcess", "SimStopped", "SimStream", "SimTensor", "sim_fixture"]
