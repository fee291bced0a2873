"""The flush: the plan for a complete bucket (cached), its collectives, the owner hand-off, and the copy-out.

Semantics follow ``z1.cpp`` / ``z2.cpp``: each flush pre-divides by the world size, SUM-reduces, and copies into the
non-empty grad buffers at their offsets (stage 2: adds after the first micro-step). Which calls run is the
cost model's choice for that flush (``planning.flush_choice``): for an owner-ordered flush the layout says it
(``planning.owner_layout``); for an arrival-order one, the plan's own calls or one AllReduce.

Note (two groups for a hand-off): a hand-off moves pieces of the ReduceScatter's output, so it must start after
the ReduceScatter has finished writing them, and its receives must not land in a buffer the ReduceScatter still
reads. NCCL may run the operations of one group concurrently; the hand-off is therefore a second group, issued
after the first on the same stream (on the GPU: stream order, torch.distributed's works being ordered on the
stream too; on gloo: the first group's works are waited).

Note (staging): a flush that left its schedule holds only some of its gradients, at the layout's offsets, a
straddler's slices in several owner regions, holes between. When the model prefers native's calls for it, the
pieces present are first copied, each gradient whole and in arrival order (each starting 16-byte aligned:
``planning.alignment``), into the bucket's staging buffer, and the AllReduces run there, one per gradient as z1.cpp
issues them: the flush then costs native's calls plus one device copy, never an AllReduce over the holes or one call
per scattered piece (issue 23 item 7).

Note (profiler ranges): every flush runs inside a ``torch.profiler.record_function`` range named ``owner_reduce
flush #<n> <algo> <bytes> B`` (the probe's flush number and ``algo=``, the bytes it reduces), and each stage of a
two-level flush has a range per level (``owner_reduce flush #<n> stage <k> node reduce_scatter <bytes> B``, ``... rail
...``), so that a flush on the cupy communicator shows as one in a torch profiler trace as torch's own collectives do;
on CUDA each is also an NVTX range (``torch.cuda.nvtx``), for Nsight, always (nothing tells a flush that Nsight
records). Nothing per gradient. With no torch profiler running and no CUDA, a flush pays one
``torch.autograd._profiler_enabled()`` call and formats no name (the host time is measured with
``scripts/benchmark_runtime.py``).

Note (flush plan cache): a graph's buckets hold the same gradients in the same order every step, so the plan and
the copy-out list are computed once per distinct bucket content and reused: for an owner-ordered flush, the
scheduled flush itself (held by the entry, so its id is never reused while cached) and how many of its gradients
are present; for an arrival-order one, (dtype, gradient ids in order) with their sizes checked. Registering or
moving a grad buffer drops the cache (the copy-out list holds views of the grad buffers).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..planning.alignment import align_elems, align_up
from ..planning.collectives import (
    ALLREDUCE,
    HANDOFF,
    NATIVE,
    NODE,
    NODE_HANDOFF,
    RAIL,
    REDUCE,
    REDUCE_SCATTER,
    WORLD,
    Collective,
    algo_of_calls,
)
from ..planning.flags import OwnerReduceFlags
from ..planning.flush_choice import FlushCost, choose_arrival
from ..planning.flush_plan import BucketEntry, FlushPlan, FlushRange, plan_flush
from ..planning.owner_layout import plan_placed
from ..planning.owner_map import OwnerMap
from ..planning.probe import PROBE_FLUSH_LIMIT, FlushReport, format_probe_line
from .comm import ReduceComm
from .stats import FlushRecord, RuntimeStats, emit

_LOG_NAMES = {REDUCE: "reduce", REDUCE_SCATTER: "reduce_scatter", ALLREDUCE: "all_reduce", HANDOFF: "handoff"}
_LEVEL_LOG_NAMES = {(NODE, REDUCE_SCATTER): "node_reduce_scatter", (NODE, REDUCE): "node_reduce",
                    (RAIL, REDUCE): "rail_reduce", (RAIL, REDUCE_SCATTER): "rail_reduce_scatter",
                    (RAIL, HANDOFF): "rail_handoff", (NODE_HANDOFF, HANDOFF): "node_handoff"}
# Per two-level stage: (its node calls' buffers, this rank's rail calls' buffers), views of the bucket.
_LevelViews = tuple[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], ...]
_FLUSH_CACHE_LIMIT = 256  # distinct bucket contents remembered; beyond it the cache starts over
_VIEWS_PER_BUCKET_LIMIT = 512  # plans whose copy-out views one bucket keeps; beyond it they start over


_profiler_enabled = torch.autograd._profiler_enabled  # a torch profiler records: Note (profiler ranges)


def _nvtx_functions() -> tuple[Callable[[str], Any], Callable[[], Any]] | tuple[None, None]:
    """torch's NVTX range push and pop, or (None, None) where this torch build has no NVTX (a CPU build, whose
    ``torch.cuda.nvtx`` functions raise): then no NVTX range is made, on any device."""
    try:
        from torch._C import _nvtx  # noqa: F401 - what torch.cuda.nvtx calls; absent from a CPU build
    except ImportError:
        return None, None
    return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop


_nvtx_push, _nvtx_pop = _nvtx_functions()


class _Range:
    """One ``record_function`` range where a torch profiler runs, and one NVTX range where ``nvtx`` (CUDA buffers and
    a torch build with NVTX), around a flush or a level of it (Note (profiler ranges)). Made only where either holds."""

    __slots__ = ("_name", "_nvtx", "_record")

    def __init__(self, name: str, cuda: bool) -> None:
        self._name = name
        self._nvtx = cuda
        self._record: Any = None

    def __enter__(self) -> None:
        if _profiler_enabled():
            self._record = torch.autograd.profiler.record_function(self._name)
            self._record.__enter__()
        if self._nvtx:
            _nvtx_push(self._name)

    def __exit__(self, *exc: object) -> None:
        """Also on an error: the range closes with the flush that raised."""
        if self._nvtx:
            _nvtx_pop()
        if self._record is not None:
            self._record.__exit__(None, None, None)


class Param(NamedTuple):
    """A parameter as DeepCompile registered it: its grad buffer (this rank's part) starts at ``offset``."""

    tensor: torch.Tensor
    grad_buffer: torch.Tensor
    offset: int


class Pending:
    """One dtype's bucket between its first gradient and its flush.

    Arrival order: ``ids``/``numels`` in bucket order (offsets follow: the bucket fills from 0). Scheduled: the
    ``scheduled`` flush's first ``count`` gradients, copied into ``views`` (the bucket's cached copy targets).
    """

    __slots__ = ("bucket", "copy", "scheduled", "views", "ids", "numels", "count")

    def __init__(self, bucket: Any, copy: Callable[[torch.Tensor, torch.Tensor], None], scheduled: Any = None,
                 views: list[Any] | None = None) -> None:
        self.bucket = bucket
        self.copy = copy
        self.scheduled = scheduled
        self.views = views
        self.ids: list[int] = []
        self.numels: list[int] = []
        self.count = 0


class Levels(NamedTuple):
    """A two-level flush's communicators (``planning.two_level``): this rank's node and rail, and its node's
    hand-off communicator (the same ranks as the node's, used only from the rail stream: ``two_level`` Note (balanced
    rails))."""

    node: ReduceComm
    rail: ReduceComm
    handoff: ReduceComm | None = None

    @property
    def local(self) -> int:
        """This rank's local rank, the rail it is on: its rank in its node communicator (nodes are consecutive)."""
        return self.node.rank


class _CopyOut(NamedTuple):
    dst: torch.Tensor  # the flat, non-empty grad buffer this rank keeps (or a segment of it)
    src_offset: int  # where its elements start in the bucket
    ds_id: int
    last: bool = True  # the buffer's last segment (stage 2: accumulation starts after the whole buffer is written)


class _P2p(NamedTuple):
    send: bool
    peer: int
    offset: int
    count: int


@dataclass(frozen=True)
class _CachedFlush:
    """A flush plan with everything derived from it, valid for exactly one bucket content."""

    source: Any  # the scheduled flush it was made for (identity), or None for arrival order
    numels: list[int]
    plan: FlushPlan
    copy_out: tuple[_CopyOut, ...]  # only the buffers this rank keeps, in bucket order
    split_sizes: list[int]  # the used bucket cut into (gap, kept) pairs and a tail: one split yields every source
    dsts: list[torch.Tensor]  # copy_out's destinations, for one _foreach_copy_
    kept: int
    calls: tuple[Collective, ...]  # the first group (everything but the hand-off)
    p2p: tuple[_P2p, ...]  # this rank's part of the hand-off round, in the layout's order
    collectives: tuple[Collective, ...]  # every call, the hand-off round included (counted as one)
    padding: tuple[FlushRange, ...]  # zero-filled before the calls
    span: int  # bucket elements the flush covers
    algo: str
    reduce_calls: int
    all_reduce_calls: int
    reduce_scatter_calls: int
    staged: tuple[tuple[int, int, int], ...] = ()  # (bucket offset, staging offset, elements): Note (staging)
    # two-level, per stage: (the node calls: one ReduceScatter or a tail's Reduces, this rank's rail's calls, its rail
    # hand-off's sends and receives: peers as rail ranks, its node hand-off's (balanced rails): peers as local ranks)
    stages: tuple[tuple[tuple[Collective, ...], tuple[Collective, ...], tuple[_P2p, ...], tuple[_P2p, ...]], ...] = ()


class Flusher:
    """Issues flushes for one runtime; the placement hands it complete buckets (``Pending``)."""

    def __init__(self, owner_map: OwnerMap, flags: OwnerReduceFlags, params: dict[int, Param], stats: RuntimeStats,
                 cost: FlushCost) -> None:
        self._owner_map = owner_map
        self._owner = flags.reduce_to_owner
        self._probe = flags.reduce_probe
        self._probe_all_ranks = flags.reduce_probe_all_ranks  # else rank 0's lines only: 20 lines, not 20 per rank
        self._params = params  # the handle's registry (read only here)
        self._stats = stats
        self.cost = cost
        self.comm: ReduceComm | None = None
        self.levels: Levels | None = None  # the node and rail communicators, where a two-level flush can run
        self.stage = 0  # 1 or 2, from the graphs' registration
        self.pre_div = True  # as the native runtime: divide by the world size, then SUM
        self.has_acc_grad: dict[int, bool] = {}  # stage 2: the grad buffer already holds this step's sum
        self.record_collectives = False  # tests and the demo: one entry per collective / per flush (grows)
        self.collective_log: list[tuple[str, int | None, int, str]] = []
        self.flush_log: list[FlushRecord] = []
        self.plans_computed = 0  # flush plans computed (not reused); tests read it
        self._cache: dict[tuple[Any, ...], _CachedFlush] = {}
        self._flush_counter = itertools.count(1)
        # The measured guard (``trial``): id(scheduled flush) -> key, for the flushes on trial; None outside trials.
        self.timed: dict[int, Any] | None = None
        self.marks: list[tuple[Any, Any, Any]] = []  # (key, start, end) per timed flush, read after the stream wait
        self.step_start: tuple[Any, Any] | None = None  # (key, start mark) of a step timed as a whole (``trial``)
        self.exposure: Any = None  # the probe's step summary (``exposure``) during its steps; None otherwise

    def forget_plans(self) -> None:
        """A grad buffer was registered or moved: the cached copy-out lists point at the old ones."""
        self._cache.clear()

    def buffers_replaced(self) -> None:
        """A bucket buffer was replaced or released: the communicator forgets its views of the old ones."""
        if self.comm is not None:
            self.comm.release_buffers()
        if self.levels is not None:
            for sub in self.levels:
                if sub is not None:
                    sub.release_buffers()

    # ---- the flush ---------------------------------------------------------------------------------------

    def flush(self, pending: Pending, streams: Any) -> None:
        comm = self.comm
        assert comm is not None, "owner_reduce runtime used before init()"
        bucket = pending.bucket
        buffer = bucket.buffer
        cached = self._scheduled(pending) if pending.scheduled is not None else self._arrival(pending, buffer.dtype)
        index = self._stats.flushes + 1
        # Note (profiler ranges): a range only where a torch profiler records or NVTX can (CUDA); else one check.
        nvtx = _nvtx_push is not None and buffer.is_cuda
        ranged = None
        if nvtx or _profiler_enabled():
            ranged = _Range(f"owner_reduce flush #{index} {cached.algo} {cached.span * buffer.element_size()} B", nvtx)
            ranged.__enter__()
        try:
            self._flush(pending, streams, cached, index, buffer, ranged is not None)
        finally:
            if ranged is not None:
                ranged.__exit__()

    def _flush(self, pending: Pending, streams: Any, cached: _CachedFlush, index: int, buffer: torch.Tensor,
               ranged: bool) -> None:
        comm = self.comm
        bucket = pending.bucket
        timed = self.timed
        key = None
        if timed is not None and pending.scheduled is not None and pending.count == len(pending.scheduled.ids):
            key = timed.get(id(pending.scheduled))
        probe = self.exposure
        if cached.stages:
            end = self._flush_two_level(cached, bucket, streams, index, key, probe, ranged)
        else:
            with streams.reducing():
                start = streams.mark() if key is not None else None
                if probe is not None:
                    probe.flush_started(streams)
                if cached.staged:
                    buffer = self._staged(cached, bucket)
                sources, _, pads = self._views(cached, bucket, buffer)
                self._prepare(cached, buffer, pads)
                if cached.calls:
                    self._world_calls(comm, cached, buffer, index)
                if cached.p2p:
                    with comm.group(flush=index):  # after the first group: see Note (two groups for a hand-off)
                        self._p2p(comm, cached.p2p, buffer)
                self._copy_out(cached, sources)
                self._marked(key, start, streams)
                end = (streams.bucket_released(bucket, timing=True) if probe is not None
                       else streams.bucket_released(bucket))
        if probe is not None:  # the free event, a timing event meanwhile, is the flush's end mark (``exposure``)
            probe.flush_ended(end, pending, cached)
        self._count(cached, buffer, pending.scheduled is not None)

    def _flush_two_level(self, cached: _CachedFlush, bucket: Any, streams: Any, index: int, key: Any,
                         probe: Any = None, ranged: bool = False) -> Any:
        """Padding, pre-division and the node steps on the node stream, the rail steps, the data-parallel calls, the
        copy-out and the bucket's free event on the rail stream (``streams`` Note (two levels)): the next flush's node
        step waits for none of this flush's rail step. Returns the free event (the probe's end mark), where asked."""
        buffer = bucket.buffer
        with streams.levels():
            start = streams.mark(NODE) if key is not None else None
            if probe is not None:
                probe.flush_started(streams, NODE)
            sources, views, pads = self._views(cached, bucket, buffer)
            self._prepare(cached, buffer, pads)
            self._two_level(cached, views, streams, index, buffer, ranged)
            with streams.level(RAIL):
                if cached.calls:
                    self._world_calls(self.comm, cached, buffer, index)
                self._copy_out(cached, sources)
                self._marked(key, start, streams, RAIL)
                if probe is None:
                    streams.bucket_released(bucket, RAIL)
                    return None
                return streams.bucket_released(bucket, RAIL, timing=True)

    def _prepare(self, cached: _CachedFlush, buffer: torch.Tensor, pads: list[torch.Tensor]) -> None:
        """Zero the padding (its views: one kernel for all of them, however many regions an aligned layout pads) and
        pre-divide the span the flush reduces (as the native runtime)."""
        if pads:
            torch._foreach_zero_(pads)
        if self.pre_div:
            buffer.narrow(0, 0, cached.span).div_(self.comm.world_size)

    def _marked(self, key: Any, start: Any, streams: Any, level: str | None = None) -> None:
        """A timed flush's marks (``trial`` Note (timing)); a step timed as a whole keeps its start for the end of
        backward (``step_start``)."""
        if key is None:
            return
        if key.whole_step:
            self.step_start = (key, start)
        else:
            self.marks.append((key, start, streams.mark(level)))

    @staticmethod
    def _p2p(comm: ReduceComm, ops: Sequence[_P2p], buffer: torch.Tensor) -> None:
        for op in ops:
            piece = buffer.narrow(0, op.offset, op.count)
            if op.send:
                comm.send(piece, op.peer)
            else:
                comm.recv(piece, op.peer)

    @staticmethod
    def _world_calls(comm: ReduceComm, cached: _CachedFlush, buffer: torch.Tensor, index: int) -> None:
        """The flush's calls on the data-parallel communicator, in one group."""
        with comm.group(flush=index):
            for c in cached.calls:
                segment = buffer.narrow(0, c.offset, c.count)
                if c.kind == REDUCE_SCATTER:
                    comm.reduce_scatter(segment, c.per_rank)
                elif c.kind == REDUCE:
                    comm.reduce(segment, c.root)
                else:
                    comm.all_reduce(segment)

    def _two_level(self, cached: _CachedFlush, views: _LevelViews, streams: Any, index: int,
                   buffer: torch.Tensor, ranged: bool = False) -> None:
        """Each stage: the node ReduceScatter or the tail's node Reduces (node stream), then this rank's rail step (rail
        stream, after that stage's node step): its Reduces, or its ReduceScatter and then its hand-off round (a
        second group: Note (two groups for a hand-off)); see ``streams`` Note (two levels). Each stage's calls on one
        communicator are one group."""
        levels = self.levels
        assert levels is not None, "a two-level flush without node and rail communicators"
        node, rail = levels.node, levels.rail
        for k, ((node_calls, rail_calls, handoff, parts), (node_views, rail_views)) in enumerate(
                zip(cached.stages, views, strict=True)):
            with (self._level_range(index, k, NODE, node_calls, buffer) if ranged else nullcontext()), \
                    streams.level(NODE), node.group(flush=index):
                for c, view in zip(node_calls, node_views, strict=True):
                    if c.kind == REDUCE_SCATTER:
                        node.reduce_scatter(view, c.per_rank)
                    else:
                        node.reduce(view, c.root)
            streams.node_stage_done()
            if rail_calls:
                with (self._level_range(index, k, RAIL, rail_calls, buffer) if ranged else nullcontext()), \
                        streams.level(RAIL):
                    with rail.group(flush=index):
                        for c, view in zip(rail_calls, rail_views, strict=True):
                            if c.kind == REDUCE_SCATTER:
                                rail.reduce_scatter(view, c.per_rank)
                            else:
                                rail.reduce(view, c.root)
                    if handoff:
                        with rail.group(flush=index):
                            self._p2p(rail, handoff, buffer)
            if parts:
                self._node_handoff(streams, parts, buffer, index)

    @staticmethod
    def _level_range(index: int, stage: int, level: str, calls: Sequence[Collective], buffer: torch.Tensor
                     ) -> AbstractContextManager[None]:
        """A two-level stage's range on one level (Note (profiler ranges)): its calls' kinds and bytes."""
        kinds = "+".join(dict.fromkeys(_LOG_NAMES[c.kind] for c in calls))
        count = sum(c.count for c in calls)
        return _Range(f"owner_reduce flush #{index} stage {stage} {level} {kinds} {count * buffer.element_size()} B",
                      buffer.is_cuda and _nvtx_push is not None)

    def _node_handoff(self, streams: Any, parts: Sequence[_P2p], buffer: torch.Tensor, index: int) -> None:
        """A balanced layout's hand-off round inside the node (``two_level`` Note (balanced rails)): on the rail
        stream, after the stage's rail step that reduced the parts it sends (stream order), on the node hand-off
        communicator, which the node stream never uses (``streams`` Note (node hand-off))."""
        handoff = self.levels.handoff if self.levels is not None else None
        assert handoff is not None, "a balanced two-level flush without its node hand-off communicator"
        with streams.level(RAIL), handoff.group(flush=index):
            self._p2p(handoff, parts, buffer)

    def _staged(self, cached: _CachedFlush, bucket: Any) -> torch.Tensor:
        """Copy the pieces present into the bucket's staging buffer (see Note (staging)); return that buffer."""
        staging, new = bucket.staging_for(cached.span)
        if new:
            self.buffers_replaced()
        buffer = bucket.buffer
        for src, dst, count in cached.staged:
            staging.narrow(0, dst, count).copy_(buffer.narrow(0, src, count))
        self._stats.staged_flushes += 1
        return staging

    @staticmethod
    def _views(cached: _CachedFlush, bucket: Any, buffer: torch.Tensor
               ) -> tuple[Sequence[torch.Tensor], _LevelViews, list[torch.Tensor]]:
        """The views of ``buffer`` (the bucket's, or its staging buffer) that ``cached`` reads or writes: its
        copy-out's sources, (two-level) every stage's call buffers and its padding, made once per (bucket buffer,
        plan) and kept with the bucket (``ReduceBucket.views``, which holds the plan too, so its id is not reused
        meanwhile): a two-level flush of 32 stages would otherwise make a view per call, an aligned layout one per
        padded region."""
        if not cached.copy_out and not cached.stages and not cached.padding:
            return (), (), []
        entry = bucket.views.get(id(cached))
        if entry is not None and entry[0] is cached:
            return entry[1]
        if len(bucket.views) >= _VIEWS_PER_BUCKET_LIMIT:  # contents that keep changing: start over
            bucket.views.clear()
        used = buffer.narrow(0, 0, cached.span)
        sources = used.split_with_sizes(cached.split_sizes)[1::2] if cached.copy_out else ()
        levels = tuple((tuple(used.narrow(0, c.offset, c.count) for c in node),
                        tuple(used.narrow(0, c.offset, c.count) for c in rail)) for node, rail, _, _ in cached.stages)
        pads = [buffer.narrow(0, pad.offset, pad.count) for pad in cached.padding]
        views = (sources, levels, pads)
        bucket.views[id(cached)] = (cached, views)
        return views

    def _copy_out(self, cached: _CachedFlush, sources: Sequence[torch.Tensor]) -> None:
        """Copy what this rank keeps into its grad buffers (stage 2: add into them after the first micro-step)."""
        if not cached.copy_out:
            return
        if self.stage != 2:
            torch._foreach_copy_(cached.dsts, sources)
            return
        has_acc = self.has_acc_grad
        for (dst, _, ds_id, last), reduced in zip(cached.copy_out, sources, strict=True):
            if has_acc.get(ds_id, False):
                dst.add_(reduced)
            else:
                dst.copy_(reduced)
                if last:  # a buffer in segments: every segment of this flush overwrites
                    has_acc[ds_id] = True

    # ---- plans (cached) ----------------------------------------------------------------------------------

    def _scheduled(self, pending: Pending) -> _CachedFlush:
        """An owner-ordered bucket: the layout's calls when complete, else (it left its schedule) the pieces
        present, each reduced where the layout put it, or one AllReduce, as the model chooses."""
        flush = pending.scheduled
        present = pending.count
        key = ("owner-ordered", id(flush), present)
        cached = self._cache.get(key)
        if cached is not None and cached.source is flush:
            return cached
        layout = flush.layout
        grads = layout.grads[:present]
        span, staged = layout.total, ()
        locate = {g.param_id: g.segments for g in grads}
        if present == len(flush.ids):
            plan, collectives, padding, transfers = layout.plan, layout.collectives, layout.padding, layout.transfers
        else:
            # Native's layout of what is present: each gradient whole, in arrival order, starting 16-byte aligned.
            packed, at, align = [], 0, align_elems(pending.bucket.buffer.element_size())
            for g in grads:
                if g.numel:
                    packed.append(FlushRange(at, g.numel, None))
                at = align_up(at + g.numel, align)
            choice = choose_arrival(plan_placed(grads, self._owner_map, self._owner),
                                    self.cost.for_dtype_bytes(pending.bucket.buffer.element_size()), packed)
            plan, collectives, padding, transfers = choice.plan, choice.collectives, (), ()
            if choice.choice == NATIVE:
                span, at, moves = at, 0, []
                for g in grads:
                    moves += [(p.bucket_offset, at + p.src_offset, p.length) for p in g.pieces]
                    locate[g.param_id] = lambda offset, numel, at=at: [(at + offset, numel)]
                    at = align_up(at + g.numel, align)
                staged = tuple(moves)
        copy_out = self._copy_outs((g.param_id, locate[g.param_id]) for g in grads)
        cached = self._make(flush, list(flush.numels[:present]), plan, copy_out, collectives, padding, transfers,
                            span, staged)
        self._remember(key, cached)
        return cached

    def _arrival(self, pending: Pending, dtype: torch.dtype) -> _CachedFlush:
        """An arrival-order bucket: the plan for this content, reused when the content is the one it was made for."""
        key = (dtype, *pending.ids)
        cached = self._cache.get(key)
        if cached is not None and cached.numels == pending.numels:
            return cached
        entries, offset = [], 0
        for ds_id, numel in zip(pending.ids, pending.numels, strict=True):
            entries.append(BucketEntry(ds_id, offset, numel))
            offset += numel
        # Looked up in this module at call time: the harness's fault injection replaces plan_flush here.
        choice = choose_arrival(plan_flush(entries, self._owner_map, self._owner),
                                self.cost.for_dtype_bytes(pending.bucket.buffer.element_size()),
                                [FlushRange(e.offset, e.numel, None) for e in entries if e.numel])
        copy_out = self._copy_outs((e.param_id, lambda at, numel, e=e: [(e.offset + at, numel)]) for e in entries)
        cached = self._make(None, list(pending.numels), choice.plan, copy_out, choice.collectives, (), (), offset)
        self._remember(key, cached)
        return cached

    def _copy_outs(self, where: Iterable[tuple[int, Callable[[int, int], list[tuple[int, int]]]]]) -> list[_CopyOut]:
        """The grad buffers this rank keeps among ``(param_id, locate)``, where ``locate(offset, numel)`` lists the
        (bucket offset, elements) segments of the gradient's elements ``[offset, +numel)``. A non-empty buffer lies in
        what reached this rank (checked at registration)."""
        copy_out = []
        for param_id, locate in where:
            param = self._params[param_id]
            dst = param.grad_buffer.view(-1)
            if not dst.numel():
                continue
            segments = locate(param.offset, dst.numel())
            at = 0
            for i, (offset, count) in enumerate(segments):
                piece = dst if len(segments) == 1 else dst.narrow(0, at, count)
                copy_out.append(_CopyOut(piece, offset, param_id, i == len(segments) - 1))
                at += count
        return copy_out

    def _make(self, source: Any, numels: list[int], plan: FlushPlan, copy_out: list[_CopyOut],
              collectives: tuple[Collective, ...], padding: tuple[FlushRange, ...], transfers: tuple[Any, ...],
              span: int, staged: tuple[tuple[int, int, int], ...] = ()) -> _CachedFlush:
        self.plans_computed += 1
        rank = self.comm.rank if self.comm is not None else 0
        copy_out.sort(key=lambda c: c.src_offset)
        split_sizes, cursor = [], 0
        for c in copy_out:
            split_sizes += [c.src_offset - cursor, c.dst.numel()]
            cursor = c.src_offset + c.dst.numel()
        split_sizes.append(span - cursor)
        p2p = tuple(_P2p(t.src == rank, t.dst if t.src == rank else t.src, t.offset, t.count)
                    for t in transfers if t.comm == WORLD and rank in (t.src, t.dst))
        stages: list[tuple[list[Collective], list[Collective], list[_P2p], list[_P2p]]] = []
        if any(c.comm != WORLD for c in collectives):
            local = self.levels.local if self.levels is not None else -1
            per_node = self.levels.node.world_size if self.levels is not None else 1
            stages = [([], [], [], []) for _ in range(1 + max(c.stage for c in collectives if c.comm == NODE))]
            for c in collectives:
                if c.comm == NODE:
                    stages[c.stage][0].append(c)
                elif c.comm == RAIL and c.rail == local and c.kind != HANDOFF:
                    stages[c.stage][1].append(c)
            for t in transfers:  # the hand-offs: this rank's sends and receives, peers as rail ranks (nodes) on a
                if rank in (t.src, t.dst) and t.comm in (RAIL, NODE_HANDOFF):  # rail, as local ranks in a node
                    peer = t.dst if t.src == rank else t.src
                    rail_side = t.comm == RAIL
                    stages[t.stage][2 if rail_side else 3].append(
                        _P2p(t.src == rank, peer // per_node if rail_side else peer % per_node, t.offset, t.count))
            # What this rank issues: its node's calls, its rail's, and the data-parallel communicator's.
            collectives = tuple(c for c in collectives if c.comm != RAIL or c.rail == local)
        kinds = [c.kind for c in collectives if c.comm == WORLD]
        return _CachedFlush(source=source, numels=numels, plan=plan, copy_out=tuple(copy_out), split_sizes=split_sizes,
                            dsts=[c.dst for c in copy_out], kept=sum(c.dst.numel() for c in copy_out),
                            calls=tuple(c for c in collectives if c.kind != HANDOFF and c.comm == WORLD), p2p=p2p,
                            collectives=collectives, padding=padding, span=span, algo=algo_of_calls(collectives),
                            reduce_calls=kinds.count(REDUCE), all_reduce_calls=kinds.count(ALLREDUCE),
                            reduce_scatter_calls=kinds.count(REDUCE_SCATTER), staged=staged,
                            stages=tuple((tuple(node), tuple(rail), tuple(handoff), tuple(parts))
                                         for node, rail, handoff, parts in stages))

    def _remember(self, key: tuple[Any, ...], cached: _CachedFlush) -> None:
        if len(self._cache) >= _FLUSH_CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = cached

    # ---- counting and the probe --------------------------------------------------------------------------

    def _count(self, cached: _CachedFlush, buffer: torch.Tensor, scheduled: bool) -> None:
        s = self._stats
        comm = self.comm
        plan = cached.plan
        s.flushes += 1
        s.scheduled_flushes += scheduled
        s.collectives += len(cached.collectives)
        s.reduce_calls += cached.reduce_calls
        s.all_reduce_calls += cached.all_reduce_calls
        s.reduce_scatter_calls += cached.reduce_scatter_calls
        if cached.stages:
            s.two_level_flushes += 1
            s.two_level_stages += len(cached.stages)
            s.node_calls += sum(len(node) for node, _, _, _ in cached.stages)
            s.rail_calls += sum(len(rail) for _, rail, _, _ in cached.stages)
            s.rail_handoffs += sum(bool(handoff) for _, _, handoff, _ in cached.stages)
            s.node_handoffs += sum(bool(parts) for _, _, _, parts in cached.stages)
            sends = sum(op.send for _, _, _, parts in cached.stages for op in parts)
            s.node_handoff_sends += sends
            s.node_handoff_recvs += sum(len(parts) for _, _, _, parts in cached.stages) - sends
        if cached.p2p:
            s.handoff_rounds += 1
            sends = sum(op.send for op in cached.p2p)
            s.sends += sends
            s.recvs += len(cached.p2p) - sends
        s.reduced_elems += plan.reduced_elems
        s.owner_elems += plan.owner_elems
        s.kept_elems += cached.kept
        dtype = str(buffer.dtype).removeprefix("torch.")
        if self.record_collectives:
            for c in cached.collectives:
                name = _LOG_NAMES[c.kind] if c.comm == WORLD else _LEVEL_LOG_NAMES[c.comm, c.kind]
                self.collective_log.append((name, c.root, c.count, str(buffer.dtype)))
            self.flush_log.append(FlushRecord(dtype, buffer.element_size(), plan.reduced_elems,
                                              plan.received_elems(comm.rank), cached.kept, plan.owner_elems,
                                              len(cached.collectives), cached.algo))
        index = next(self._flush_counter)
        if self._probe and index <= PROBE_FLUSH_LIMIT and (self._probe_all_ranks or comm.rank == 0):
            line = format_probe_line(FlushReport(rank=comm.rank, flush_index=index, dtype=dtype, plan=plan,
                                                 kept_elems=cached.kept, pre_div=self.pre_div,
                                                 calls=len(cached.collectives), algo=cached.algo))
            s.probe_lines.append(line)
            emit(line)
