"""torch.distributed as ``TorchDistComm`` uses it, with no process group: the one stand-in for the layer under the torch
communicator. (``tests.support.fakes`` stands in for the runtime's communicator seam above it, ``tests.support.sim`` for
CUDA and cupy's NCCL under ``CupyNcclComm``; the simulator models cupy's NCCL, not torch's process group, hence this.)

``FakeTdist`` is one process's view: its rank ``rank`` of ``WORLD`` (a ``FakeGroup`` of global ranks ``ranks``) and
the groups it makes. Every call records itself on its group (``ops``) and in ``works``, and returns a work that
completes as the test says: on a CPU tensor a ``HostWork`` (gloo: the host waits in ``wait(timeout)``), on a CUDA
tensor (``DeviceBuf``: what the communicator reads of one, without a GPU) a ``DeviceWork`` (ProcessGroupNCCL: ordered
on the current stream by ``block_current_stream()``, then polled). ``SimTdist`` runs the calls that move data on the
simulated device's streams, as ProcessGroupNCCL runs them.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting for peer"


class HostWork:
    """A gloo work: ``wait(timeout)`` records its timeout and returns, or raises ``raises``, or gloo's timeout when the
    work never completes."""

    def __init__(self, completed: bool = True, raises: str | None = None) -> None:
        self.completed, self.raises = completed, raises
        self.timeouts: list[Any] = []

    def wait(self, timeout: Any) -> bool:
        self.timeouts.append(timeout)
        if self.raises:
            raise RuntimeError(self.raises)
        if not self.completed:
            raise RuntimeError(GLOO_TIMEOUT)
        return True

    def is_completed(self) -> bool:
        return self.completed


class DeviceWork:
    """A ProcessGroupNCCL work: ``wait(timeout)`` would block the host until the collective ends (recorded, then the
    collective is taken to have stalled); ``block_current_stream()`` returns at once; ``error`` is its failure."""

    def __init__(self, completed: bool, error: BaseException | None = None) -> None:
        self.completed, self.error = completed, error
        self.host_waits: list[Any] = []
        self.stream_waits = 0

    def wait(self, timeout: Any = None) -> bool:
        self.host_waits.append(timeout)
        if not self.completed:
            raise RuntimeError("Operation timed out!")
        return True

    def block_current_stream(self) -> None:
        self.stream_waits += 1

    def is_completed(self) -> bool:
        return self.completed or self.error is not None

    def exception(self) -> BaseException | None:
        return self.error


class DeviceBuf:
    """A CUDA tensor as TorchDistComm sees one (it only reads these), without a GPU."""

    is_cuda = True
    dtype = torch.float32

    def __init__(self, numel: int) -> None:
        self._numel = numel

    def numel(self) -> int:
        return self._numel

    def narrow(self, dim: int, start: int, length: int) -> DeviceBuf:
        return DeviceBuf(length)


class FakeGroup:
    """A process group: its global ranks, every operation issued on it (``name(count=N)``, in order), whether it was
    made with local synchronization, and its aborts (``aborted`` is set at the first)."""

    def __init__(self, ranks: Iterable[int] = (0, 1), local: bool = False) -> None:
        self.ranks = list(ranks)
        self.local = local
        self.ops: list[str] = []
        self.aborts = 0
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()


class FakeTdist:
    """The part of ``torch.distributed`` TorchDistComm uses: this process is rank ``rank`` of ``WORLD`` over global
    ranks ``ranks``, on ``backend``; every call's work completes when ``complete`` says (when it is made).
    ``coalesce``: NCCL's ``batch_isend_irecv`` returns one work for the whole round. A group of ``None`` is ``WORLD``,
    as in torch."""

    ReduceOp = types.SimpleNamespace(SUM="sum")
    isend = "isend"
    irecv = "irecv"

    def __init__(self, ranks: Iterable[int] = (0, 1), rank: int = 0, backend: str = "nccl", complete: bool = True,
                 coalesce: bool = False) -> None:
        self.world = FakeGroup(ranks)
        self.group = types.SimpleNamespace(WORLD=self.world)
        self.rank, self.backend = rank, backend
        self.complete, self.coalesce = complete, coalesce
        self.works: list[Any] = []
        self.made: list[FakeGroup] = []

    def _group(self, group: FakeGroup | None) -> FakeGroup:
        return self.world if group is None else group

    def get_rank(self, group: FakeGroup | None = None) -> int:
        return self._group(group).ranks.index(self.world.ranks[self.rank])

    def get_world_size(self, group: FakeGroup | None = None) -> int:
        return len(self._group(group).ranks)

    def get_global_rank(self, group: FakeGroup | None, rank: int) -> int:
        return self._group(group).ranks[rank]

    def get_backend(self, group: FakeGroup | None = None) -> str:
        return self.backend

    def new_group(self, ranks: Iterable[int], timeout: Any = None,
                  use_local_synchronization: bool = False) -> FakeGroup:
        self.made.append(FakeGroup(ranks, local=use_local_synchronization))
        return self.made[-1]

    def _work(self, buf: Any, group: FakeGroup | None, name: str, count: int | None = None) -> Any:
        self._group(group).ops.append(f"{name}(count={buf.numel() if count is None else count})")
        work = DeviceWork(self.complete) if buf.is_cuda else HostWork(completed=self.complete)
        self.works.append(work)
        return work

    def reduce(self, buf: Any, dst: int, op: Any, group: FakeGroup | None, async_op: bool) -> Any:
        return self._work(buf, group, "reduce")

    def all_reduce(self, buf: Any, op: Any, group: FakeGroup | None, async_op: bool) -> Any:
        return self._work(buf, group, "all_reduce")

    def reduce_scatter_tensor(self, out: Any, buf: Any, op: Any, group: FakeGroup | None, async_op: bool) -> Any:
        return self._work(buf, group, "reduce_scatter_tensor")

    def P2POp(self, fn: Any, buf: Any, peer: int, group: FakeGroup | None) -> Any:  # noqa: N802 - torch's name
        return types.SimpleNamespace(fn=fn, buf=buf, peer=peer, group=group)

    def batch_isend_irecv(self, ops: list[Any]) -> list[Any]:
        if self.coalesce:
            return [self._work(ops[0].buf, ops[0].group, "batch_isend_irecv", sum(op.buf.numel() for op in ops))]
        return [self._work(op.buf, op.group, "batch_isend_irecv") for op in ops]


class StreamWork:
    """A ProcessGroupNCCL work on the simulated device: an event recorded after the collective on its stream."""

    def __init__(self, done: Any) -> None:
        self.done = done

    def block_current_stream(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)

    def is_completed(self) -> bool:
        return bool(self.done.query())

    def exception(self) -> BaseException | None:
        return None


class SimTdist(FakeTdist):
    """``FakeTdist`` on the simulated device (made while a ``Sim`` is installed), for the calls that move data, as
    ProcessGroupNCCL runs them: the collective on an internal stream that first waits for the current one, the data of
    the other ranks (``rows``, by rank) written by that stream's kernel, the work's ``block_current_stream`` ordering
    the current stream after it."""

    def __init__(self, sim: Any, rank: int, rows: list[list[int]]) -> None:
        super().__init__(ranks=range(len(rows)), rank=rank)
        self.sim, self.rows = sim, rows
        self.stream = torch.cuda.Stream()

    def _issue(self, name: str, reads: list[Any], writes: list[Any], run: Callable[[], None]) -> StreamWork:
        self.stream.wait_stream(torch.cuda.current_stream())
        self.sim.kernel(0.0, name=name, stream=self.stream, reads=reads, writes=writes, fn=run)
        done = torch.cuda.Event()
        done.record(self.stream)
        return StreamWork(done)

    def all_gather(self, gathered: list[Any], local: Any, group: Any = None, async_op: bool = False) -> StreamWork:
        values = [torch.tensor(row, dtype=torch.int64) for row in self.rows]

        def run() -> None:
            for r, out in enumerate(gathered):
                out._inner.copy_(local._inner if r == self.rank else values[r])

        return self._issue("nccl all_gather (torch)", [local], list(gathered), run)

    def broadcast(self, tensor: Any, src: int, group: Any = None, async_op: bool = False) -> StreamWork:
        value = torch.tensor(self.rows[src], dtype=tensor.dtype)

        def run() -> None:
            if self.rank != src:
                tensor._inner.copy_(value)

        return self._issue("nccl broadcast (torch)", [tensor], [tensor], run)
