"""The Python reduce runtime for ZeRO stages 1 and 2 that stands where DeepCompile's native extension stands.

Why Python: DeepCompile reaches its extension only through ``get_deepcompile_handle()``; an object with the
same methods there drives the whole stage-1/2 reduce path, so the owner path needs no C++/CUDA build.
Semantics follow ``z1.cpp`` / ``deepcompile.h``: gradients accumulate across micro-steps until the
accumulation boundary, then go into per-dtype double-buffered buckets; a bucket flushes when the next
gradient would overflow it and at ``end_backward``; each flush pre-divides by the world size, SUM-reduces,
and copies into the non-empty grad buffers at their offsets. Nothing communicates while DeepCompile profiles.

Streams: see ``streams`` (CPU: synchronous; CUDA: copy stream, reduce stream and events as in z1.cpp).

Note (accumulation buffer): between micro-steps the native runtime keeps the graph's own gradient tensor and
adds into it; here the first gradient is cloned, so a compiler that recycles the graph's buffers cannot
corrupt the running sum.
"""

from __future__ import annotations

import itertools
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..planning.flags import OwnerReduceFlags, describe_flag_disagreement, pack_flags
from ..planning.flush_plan import ALL, BucketEntry, FlushPlan, plan_flush
from ..planning.owner_map import OwnerMap, Placement
from ..planning.probe import PROBE_FLUSH_LIMIT, FlushReport, format_probe_line
from .buckets import DoubleBufferedBuckets
from .comm import ReduceComm
from .streams import CudaStreams, HostStreams, make_streams

_AGREEMENT_PROTOCOL = 1


def emit(line: str) -> None:
    """Print a line the user asked for: through DeepSpeed's logger when it shows INFO (its default level is
    WARNING), otherwise on stdout, as DeepCompile prints its own reports.

    Note (whole lines): every rank writes to the same terminal or pipe; ``print`` writes the text and the newline
    separately, so another rank's line could land in between. The line goes out in one write with its newline
    (the logger's handler does the same), after anything this process had buffered.
    """
    import logging

    from deepspeed.utils import logger

    if logger.isEnabledFor(logging.INFO):
        logger.info(line)
    else:
        stream = sys.stdout
        stream.flush()
        stream.write(line + "\n")
        stream.flush()


class OwnerReduceMismatchError(RuntimeError):
    """Ranks disagree on flags, bucket size or owner map; raised on every rank before any training collective."""


@dataclass(frozen=True)
class RuntimeSettings:
    flags: OwnerReduceFlags
    owner_map: OwnerMap
    map_problems: tuple[str, ...] = ()  # where this rank's optimizer contradicts the map (should be empty)


@dataclass
class RuntimeStats:
    """Counters that prove the runtime ran (tests and benchmarks read them)."""

    reduce_grad_calls: int = 0
    profiling_calls: int = 0
    accumulated_calls: int = 0
    flushes: int = 0
    collectives: int = 0
    reduce_calls: int = 0
    all_reduce_calls: int = 0
    reduced_elems: int = 0
    owner_elems: int = 0
    kept_elems: int = 0
    end_backward_calls: int = 0
    init_line: str | None = None  # what rank 0 printed at init
    probe_lines: list[str] = field(default_factory=list)


class FlushRecord(NamedTuple):
    """What one flush did on this rank (recorded only with ``record_collectives``)."""

    dtype: str
    element_size: int
    reduced_elems: int
    received_elems: int
    kept_elems: int
    owner_elems: int
    calls: int


class _Param(NamedTuple):
    tensor: torch.Tensor
    grad_buffer: torch.Tensor
    offset: int


class _Task(NamedTuple):
    ds_id: int
    offset: int
    numel: int
    copy_event: Any  # CUDA: the copy stream's event for this task's copy into the bucket; CPU: None


class OwnerReduceRuntime:
    """The DeepCompile handle for ZeRO stages 1 (z1.cpp) and 2 (z2.cpp): ``init`` ... ``cleanup``."""

    def __init__(self, settings: RuntimeSettings, comm_factory: Any) -> None:
        self.settings = settings
        self._comm_factory = comm_factory
        self.comm: ReduceComm | None = None
        self.stats = RuntimeStats()
        self.record_collectives = False  # tests and the demo: one entry per collective / per flush (grows)
        self.collective_log: list[tuple[str, int | None, int, str]] = []
        self.flush_log: list[FlushRecord] = []
        self._params: dict[int, _Param] = {}
        self._graphs: dict[int, tuple[int, ...]] = {}
        self._stage = 0  # 1 or 2, from register_graph_z1 / register_graph_z2
        self._has_acc_grad: dict[int, bool] = {}  # stage 2: the grad buffer already holds this step's sum
        self._buckets: DoubleBufferedBuckets | None = None
        self._streams: HostStreams | CudaStreams | None = None  # chosen from the first gradient's device
        self._pending: dict[torch.dtype, list[_Task]] = defaultdict(list)
        self._accumulated: dict[int, torch.Tensor] = {}
        self._update = False
        self._profiling = False
        self._pre_div = True  # as the native runtime: divide by the world size, then SUM
        self._flush_counter = itertools.count(1)
        self.on_cleanup: Any = None  # set by activation: hands get_deepcompile_handle() back

    # ---- the handle surface DeepCompile's stage-1 path calls -------------------------------------------

    def init(self, process_group: Any, compile_config: Any, reduce_bucket_size: int) -> None:
        self.comm = self._comm_factory(process_group)
        try:
            self._buckets = DoubleBufferedBuckets(int(reduce_bucket_size), bool(compile_config.double_buffer))
            self._check_agreement(int(reduce_bucket_size))
        except BaseException:
            # DeepSpeed calls cleanup() only after a successful init: release the communicator here.
            self.comm.close()
            self.comm = None
            raise
        if self.comm.rank == 0:
            self.stats.init_line = self.settings.owner_map.init_line(sliced=self.settings.flags.reduce_to_owner)
            emit(self.stats.init_line)

    def register_param(self, ds_id: int, ds_shape: Any, ds_tensor: torch.Tensor, grad_buffer: torch.Tensor,
                       offset: int) -> None:
        if ds_id not in self.settings.owner_map:
            raise KeyError(f"owner_reduce: DeepCompile registered param {ds_id}, which the owner map lacks")
        self._params[ds_id] = _Param(ds_tensor, self._checked_buffer(ds_id, grad_buffer, offset), int(offset))

    def update_param_grad_buffer(self, ds_id: int, grad_buffer: torch.Tensor, offset: int) -> None:
        self._params[ds_id] = self._params[ds_id]._replace(grad_buffer=self._checked_buffer(ds_id, grad_buffer, offset),
                                                           offset=int(offset))

    def _checked_buffer(self, ds_id: int, grad_buffer: torch.Tensor, offset: int) -> torch.Tensor:
        # As the native registry: a registered buffer starts at zero. A buffer for elements that reduce to
        # another rank is refused here, before any collective of the step has started.
        if grad_buffer.numel():
            self._check_received(ds_id, int(offset), grad_buffer.numel())
            grad_buffer.zero_()
        return grad_buffer

    def register_graph_z1(self, graph_id: int, ds_ids: Any) -> None:
        self._register_graph(1, graph_id, ds_ids)

    def register_graph_z2(self, graph_id: int, ds_ids: Any) -> None:
        self._register_graph(2, graph_id, ds_ids)

    def _register_graph(self, stage: int, graph_id: int, ds_ids: Any) -> None:
        if self._stage not in (0, stage):
            raise RuntimeError(f"owner_reduce: graph {graph_id} registered for ZeRO stage {stage}, "
                               f"earlier graphs for stage {self._stage}")
        self._stage = stage
        self._graphs[graph_id] = tuple(int(i) for i in ds_ids)

    def start_backward(self, update: bool) -> None:
        self._update = bool(update)

    def enable_profiling(self, enable: bool) -> None:
        self._profiling = bool(enable)

    def is_profiling(self) -> bool:
        return self._profiling

    def clear_all_gathered_params(self) -> None:
        """ZeRO-3 state; stage 1 has none."""

    def reset(self) -> None:
        self._graphs.clear()

    def cleanup(self) -> None:
        try:
            self._sync_streams("cleanup")  # nothing in flight may still read the buckets or the communicator
        finally:
            self._release()

    def _release(self) -> None:
        self.reset()
        self._pending.clear()
        self._accumulated.clear()
        self._params.clear()
        if self._buckets is not None:
            self._buckets.clear()
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self._profiling = False
        if self.on_cleanup is not None:
            self.on_cleanup()

    def __getattr__(self, name: str) -> Any:
        # Called only for names not defined above: a handle method this runtime does not provide.
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"owner_reduce's runtime has no DeepCompile handle method '{name}' "
                             "(it replaces the native runtime for ZeRO stages 1 and 2 only)")

    # ---- the two graph ops -------------------------------------------------------------------------------

    def reduce_grad(self, grad: torch.Tensor, graph_id: int, ds_id: int) -> None:
        if self._profiling:
            self.stats.profiling_calls += 1
            return
        if graph_id not in self._graphs:
            raise KeyError(f"owner_reduce: reduce_grad for graph {graph_id}, which was never registered")
        self.stats.reduce_grad_calls += 1
        grad = grad.detach()
        if self._stage == 2:
            # z2.cpp: every micro-step reduces; the grad buffers accumulate the reduced sums (see _copy_out).
            self._enqueue(ds_id, grad)
            return
        running = self._accumulated.pop(ds_id, None)
        if running is not None:
            running.add_(grad)
            grad = running
        if not self._update:
            self._accumulated[ds_id] = grad if running is not None else grad.clone()
            self.stats.accumulated_calls += 1
            return
        self._enqueue(ds_id, grad)

    def end_backward(self, graph_id: int, release_reduce_buckets: bool) -> None:
        if self._profiling:
            return
        self.stats.end_backward_calls += 1
        for dtype in list(self._pending):
            self._flush(dtype)
        self._sync_streams("end_backward")  # the optimizer reads the grad buffers next
        if self._stage == 2 and self._update:
            # z2.cpp: this graph's parameters start the next step by overwriting (other graphs clear theirs).
            for ds_id in self._graphs.get(graph_id, ()):
                self._has_acc_grad.pop(ds_id, None)
        if release_reduce_buckets and self._buckets is not None:
            self._buckets.clear()

    def _sync_streams(self, call: str) -> None:
        """Wait for the reduce stream, bounded by the communicator's deadline (see ``comm.wait_until``)."""
        if self._streams is not None:
            comm = self.comm
            self._streams.synchronize(None if comm is None else lambda done: comm.wait_until(done, call))

    # ---- buckets and the flush ---------------------------------------------------------------------------

    def _enqueue(self, ds_id: int, grad: torch.Tensor) -> None:
        assert self._buckets is not None, "owner_reduce runtime used before init()"
        if self._streams is None:
            self._streams = make_streams(grad.device)
        numel = grad.numel()
        bucket = self._buckets.get(grad.dtype, grad.device)
        if bucket.should_flush(numel):
            self._flush(grad.dtype)
            bucket = self._buckets.get(grad.dtype, grad.device)
        if numel > bucket.size:
            self._sync_streams("bucket growth")  # the buffer being replaced may still be read by a flush in flight
            bucket.reserve(numel)
        start, view = bucket.allocate(numel)
        event = self._streams.copy_into_bucket(bucket, view, grad)
        self._pending[grad.dtype].append(_Task(ds_id, start, numel, event))

    def _flush(self, dtype: torch.dtype) -> None:
        tasks = self._pending.pop(dtype, None)
        if not tasks:
            return
        assert self.comm is not None and self._buckets is not None
        comm = self.comm
        bucket = self._buckets.current(dtype)
        owner_map = self.settings.owner_map
        plan = plan_flush([BucketEntry(t.ds_id, t.offset, t.numel) for t in tasks], owner_map,
                          self.settings.flags.reduce_to_owner)
        streams = self._streams
        assert streams is not None
        try:
            with streams.reducing([t.copy_event for t in tasks]):
                used = bucket.buffer.narrow(0, 0, bucket.offset)
                if self._pre_div:
                    used.div_(comm.world_size)
                with comm.group(flush=self.stats.flushes + 1):
                    for r in plan.ranges:
                        segment = bucket.buffer.narrow(0, r.offset, r.count)
                        if r.root is ALL:
                            comm.all_reduce(segment)
                        else:
                            comm.reduce(segment, r.root)
                        if self.record_collectives:
                            self.collective_log.append(("all_reduce" if r.root is ALL else "reduce", r.root,
                                                        r.count, str(dtype)))
                kept = self._copy_out(tasks, bucket.buffer)
                streams.bucket_released(bucket)
        finally:
            self._buckets.swap(dtype)  # even after an error: the next flush must not find a half-used bucket
        self._count(plan, kept, dtype)
        if self.record_collectives:
            self.flush_log.append(FlushRecord(str(dtype).removeprefix("torch."), bucket.buffer.element_size(),
                                              plan.reduced_elems, plan.received_elems(comm.rank), kept,
                                              plan.owner_elems, len(plan.ranges)))

    def _copy_out(self, tasks: list[_Task], buffer: torch.Tensor) -> int:
        kept = 0
        for t in tasks:
            param = self._params[t.ds_id]
            grad_buf = param.grad_buffer.view(-1)
            if grad_buf.numel() == 0:
                continue  # checked at registration: a non-empty buffer lies in what reached this rank
            reduced = buffer.narrow(0, t.offset + param.offset, grad_buf.numel())
            if self._stage == 2 and self._has_acc_grad.get(t.ds_id, False):
                grad_buf.add_(reduced)
            else:
                grad_buf.copy_(reduced)
            self._has_acc_grad[t.ds_id] = True
            kept += grad_buf.numel()
        return kept

    def _check_received(self, ds_id: int, offset: int, numel: int) -> None:
        """A grad buffer must lie in what reached this rank; otherwise the optimizer would get garbage."""
        if not self.settings.flags.reduce_to_owner:
            return
        placement = self.settings.owner_map.placement(ds_id)
        if placement.placement is not Placement.ONE_OWNER and not placement.sliced:
            return  # AllReduced: every rank received everything
        rank = self.comm.rank
        if any(s.owner == rank and s.offset <= offset and offset + numel <= s.offset + s.length
               for s in placement.slices):
            return
        owners = ", ".join(f"[{s.offset}, +{s.length}) -> rank {s.owner}" for s in placement.slices)
        raise RuntimeError(f"owner_reduce: rank {rank} holds a grad buffer for elements [{offset}, +{numel}) of "
                           f"param {ds_id}, which reduce elsewhere ({owners}); the owner map and DeepCompile disagree")

    def _count(self, plan: FlushPlan, kept: int, dtype: torch.dtype) -> None:
        s = self.stats
        s.flushes += 1
        s.collectives += len(plan.ranges)
        s.reduce_calls += sum(1 for r in plan.ranges if r.root is not ALL)
        s.all_reduce_calls += sum(1 for r in plan.ranges if r.root is ALL)
        s.reduced_elems += plan.reduced_elems
        s.owner_elems += plan.owner_elems
        s.kept_elems += kept
        index = next(self._flush_counter)
        if self.settings.flags.reduce_probe and index <= PROBE_FLUSH_LIMIT:
            line = format_probe_line(FlushReport(rank=self.comm.rank, flush_index=index,
                                                 dtype=str(dtype).removeprefix("torch."), plan=plan, kept_elems=kept,
                                                 pre_div=self._pre_div, calls=len(plan.ranges)))
            s.probe_lines.append(line)
            emit(line)

    # ---- agreement across ranks --------------------------------------------------------------------------

    def _check_agreement(self, bucket_size: int) -> None:
        """One all_gather of five integers; every rank raises on any mismatch, so no rank is left hanging."""
        flags = self.settings.flags
        mine = [_AGREEMENT_PROTOCOL, pack_flags(flags), bucket_size,
                int(self.settings.owner_map.digest()[:15], 16), len(self.settings.map_problems)]
        rows = self.comm.all_gather_ints(mine)
        names = ("protocol", "flags", "reduce_bucket_size", "owner map digest", "map problems")
        problems = []
        for i, name in enumerate(names[:4]):
            values = [row[i] for row in rows]
            if name == "flags" and describe_flag_disagreement(values):
                problems += describe_flag_disagreement(values)
            elif len(set(values)) > 1:
                problems.append(f"{name} differs across ranks: {values}")
        bad_ranks = [r for r, row in enumerate(rows) if row[4]]
        if bad_ranks:
            problems.append(f"the owner map contradicts the optimizer on rank{'s' if len(bad_ranks) > 1 else ''} "
                            f"{', '.join(map(str, bad_ranks))}"
                            + (f": {list(self.settings.map_problems)[:3]}" if self.settings.map_problems else ""))
        if problems:
            raise OwnerReduceMismatchError(f"owner_reduce on rank {self.comm.rank}: refusing to start: "
                                           + "; ".join(problems))
