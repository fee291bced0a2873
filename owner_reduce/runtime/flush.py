"""The flush: the plan for a complete bucket (cached), its streams, padding and pre-division, and the copy-out.

Semantics follow ``z1.cpp`` / ``z2.cpp``: each flush pre-divides by the world size, SUM-reduces, and copies into the
non-empty grad buffers at their offsets (stage 2: adds after the first micro-step). Which calls run is the
cost model's choice for that flush (``planning.flush_choice``): for an owner-ordered flush the layout says it
(``planning.owner_layout``); for an arrival-order one, the plan's own calls or one AllReduce. Each plan is compiled
once into this rank's program (``planning.program``), which the executor issues (``runtime.executor``).

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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..planning.alignment import align_elems, align_up
from ..planning.calls import LOG_NAMES, NATIVE, NODE, RAIL, WORLD, Level
from ..planning.collectives import Collective, Transfer
from ..planning.flags import OwnerReduceFlags
from ..planning.flush_choice import FlushCost, choose_arrival
from ..planning.flush_plan import BucketEntry, FlushPlan, FlushRange, plan_flush
from ..planning.owner_layout import plan_placed
from ..planning.owner_map import OwnerMap
from ..planning.probe import PROBE_FLUSH_LIMIT, FlushReport, format_probe_line
from ..planning.program import FlushProgram, LevelRanks, StagingMove, compile_program, copy_segments
from .comm import ReduceComm
from .executor import Executor, Levels
from .stats import FlushRecord, RuntimeStats, emit

__all__ = ["Flusher", "Levels", "Param", "Pending"]

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


class _CopyOut(NamedTuple):
    dst: torch.Tensor  # the flat, non-empty grad buffer this rank keeps (or a segment of it)
    src_offset: int  # where its elements start in the bucket
    ds_id: int
    last: bool = True  # the buffer's last segment (stage 2: accumulation starts after the whole buffer is written)


@dataclass(frozen=True)
class _CachedFlush:
    """A flush plan with everything derived from it, valid for exactly one bucket content: this rank's program
    (``planning.program``) and the grad buffers its copy-out writes."""

    source: Any  # the scheduled flush it was made for (identity), or None for arrival order
    numels: list[int]
    plan: FlushPlan
    program: FlushProgram
    copy_out: tuple[_CopyOut, ...]  # only the buffers this rank keeps, in bucket order (the program's copy_out)
    dsts: list[torch.Tensor]  # copy_out's destinations, for one _foreach_copy_

    @property
    def collectives(self) -> tuple[Collective, ...]:
        """Every call this rank issues, the hand-off rounds as their markers (the probe's hooks read them)."""
        return self.program.collectives

    @property
    def span(self) -> int:
        return self.program.span

    @property
    def algo(self) -> str:
        return self.program.algo

    @property
    def kept(self) -> int:
        return self.program.kept


class Flusher:
    """Issues flushes for one runtime; the placement hands it complete buckets (``Pending``). Made at init, with its
    collaborators: the data-parallel communicator, the node and rail communicators where a two-level flush can run
    (``levels``) and the agreed cost model, which it never replaces. The runtime switches the rest: the ZeRO stage
    (``stage``), the probe's and the monitor's hooks (``exposure``), the measured guard's timing (``timed``) and the
    collective log (``record_collectives``)."""

    def __init__(self, owner_map: OwnerMap, flags: OwnerReduceFlags, params: dict[int, Param], stats: RuntimeStats,
                 comm: ReduceComm, cost: FlushCost, levels: Levels | None = None) -> None:
        self._owner_map = owner_map
        self._owner = flags.reduce_to_owner
        self._probe = flags.reduce_probe
        self._probe_all_ranks = flags.reduce_probe_all_ranks  # else rank 0's lines only: 20 lines, not 20 per rank
        self._params = params  # the handle's registry (read only here)
        self._stats = stats
        self._comm = comm
        self._cost = cost
        self._levels = levels
        self._executor = Executor(comm, levels)
        self._level_ranks = LevelRanks(levels.local, levels.node.world_size) if levels is not None else None
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

    @property
    def comm(self) -> ReduceComm:
        return self._comm

    @property
    def levels(self) -> Levels | None:
        """The node and rail communicators, where a two-level flush can run."""
        return self._levels

    @property
    def cost(self) -> FlushCost:
        return self._cost

    def forget_plans(self) -> None:
        """A grad buffer was registered or moved: the cached copy-out lists point at the old ones."""
        self._cache.clear()

    def buffers_replaced(self) -> None:
        """A bucket buffer was replaced or released: the communicator forgets its views of the old ones."""
        self._comm.release_buffers()
        if self._levels is not None:
            for sub in self._levels:
                if sub is not None:
                    sub.release_buffers()

    # ---- the flush ---------------------------------------------------------------------------------------

    def flush(self, pending: Pending, streams: Any) -> None:
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
        """A one-level flush on the reduce stream (its staging, padding and pre-division, its program's groups, the
        copy-out and the bucket's free event), or a two-level one (``_flush_two_level``)."""
        bucket = pending.bucket
        timed = self.timed
        key = None
        if timed is not None and pending.scheduled is not None and pending.count == len(pending.scheduled.ids):
            key = timed.get(id(pending.scheduled))
        probe = self.exposure
        program = cached.program
        if program.two_level:
            end = self._flush_two_level(cached, bucket, streams, index, key, probe, ranged)
        else:
            with streams.reducing():
                start = streams.mark() if key is not None else None
                if probe is not None:
                    probe.flush_started(streams)
                if program.staged:
                    buffer = self._staged(cached, bucket)
                sources, bound, pads = self._views(cached, bucket, buffer)
                self._prepare(cached, buffer, pads)
                self._executor.run(program, bound, streams, index)  # Note (two groups for a hand-off)
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
            sources, bound, pads = self._views(cached, bucket, buffer)
            self._prepare(cached, buffer, pads)
            self._executor.run(cached.program, bound, streams, index,
                               self._level_range(index, buffer) if ranged else None)
            with streams.level(RAIL):
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
            buffer.narrow(0, 0, cached.span).div_(self._comm.world_size)

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
    def _level_range(index: int, buffer: torch.Tensor) -> Callable[[int, Level, Sequence[Collective]],
                                                                    AbstractContextManager[None]]:
        """A two-level stage's range on one level (Note (profiler ranges)): its calls' kinds and bytes."""
        nvtx = buffer.is_cuda and _nvtx_push is not None
        size = buffer.element_size()

        def level_range(stage: int, level: Level, calls: Sequence[Collective]) -> AbstractContextManager[None]:
            kinds = "+".join(dict.fromkeys(LOG_NAMES[WORLD, c.kind] for c in calls))
            count = sum(c.count for c in calls)
            return _Range(f"owner_reduce flush #{index} stage {stage} {level} {kinds} {count * size} B", nvtx)
        return level_range

    def _staged(self, cached: _CachedFlush, bucket: Any) -> torch.Tensor:
        """Copy the pieces present into the bucket's staging buffer (see Note (staging)); return that buffer."""
        staging, new = bucket.staging_for(cached.span)
        if new:
            self.buffers_replaced()
        buffer = bucket.buffer
        for src, dst, count in cached.program.staged:
            staging.narrow(0, dst, count).copy_(buffer.narrow(0, src, count))
        self._stats.staged_flushes += 1
        return staging

    def _views(self, cached: _CachedFlush, bucket: Any, buffer: torch.Tensor
               ) -> tuple[Sequence[torch.Tensor], tuple[Any, ...], list[torch.Tensor]]:
        """What ``cached`` reads and writes in ``buffer`` (the bucket's, or its staging buffer): its copy-out's
        sources, its program bound to the buffer (``Executor.bind``: every call's view) and its padding, made once per
        (bucket buffer, plan) and kept with the bucket (``ReduceBucket.views``, which holds the plan too, so its id is
        not reused meanwhile): a flush would otherwise make a view per call, an aligned layout one per padded
        region."""
        program = cached.program
        if not cached.copy_out and not program.steps and not program.padding:
            return (), (), []
        entry = bucket.views.get(id(cached))
        if entry is not None and entry[0] is cached:
            return entry[1]
        if len(bucket.views) >= _VIEWS_PER_BUCKET_LIMIT:  # contents that keep changing: start over
            bucket.views.clear()
        used = buffer.narrow(0, 0, program.span)
        sources = used.split_with_sizes(list(program.split_sizes))[1::2] if cached.copy_out else ()
        bound = self._executor.bind(program, buffer)
        pads = [buffer.narrow(0, pad.offset, pad.count) for pad in program.padding]
        views = (sources, bound, pads)
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
                                    self._cost.for_dtype_bytes(pending.bucket.buffer.element_size()), packed)
            plan, collectives, padding, transfers = choice.plan, choice.collectives, (), ()
            if choice.choice == NATIVE:
                span, at, moves = at, 0, []
                for g in grads:
                    moves += [StagingMove(p.bucket_offset, at + p.src_offset, p.length) for p in g.pieces]
                    locate[g.param_id] = lambda offset, numel, at=at: [(at + offset, numel)]
                    at = align_up(at + g.numel, align)
                staged = tuple(moves)
        cached = self._make(flush, list(flush.numels[:present]), plan,
                            [(g.param_id, locate[g.param_id]) for g in grads], collectives, padding, transfers, span,
                            staged)
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
                                self._cost.for_dtype_bytes(pending.bucket.buffer.element_size()),
                                [FlushRange(e.offset, e.numel, None) for e in entries if e.numel])
        where = [(e.param_id, lambda at, numel, e=e: [(e.offset + at, numel)]) for e in entries]
        cached = self._make(None, list(pending.numels), choice.plan, where, choice.collectives, (), (), offset)
        self._remember(key, cached)
        return cached

    def _make(self, source: Any, numels: list[int], plan: FlushPlan,
              where: Sequence[tuple[int, Callable[[int, int], list[tuple[int, int]]]]],
              collectives: Sequence[Collective], padding: Sequence[FlushRange], transfers: Sequence[Transfer],
              span: int, staged: Sequence[StagingMove] = ()) -> _CachedFlush:
        """The plan's program for this rank (``planning.program``) and its copy-out into the grad buffers this rank
        keeps among ``where`` ((param_id, locate), ``locate(offset, numel)`` the (bucket offset, elements) segments
        of the gradient's elements ``[offset, +numel)``). A non-empty buffer lies in what reached this rank (checked
        at registration)."""
        self.plans_computed += 1
        kept = {}
        for param_id, _ in where:
            param = self._params[param_id]
            numel = param.grad_buffer.numel()
            if numel:
                kept[param_id] = (param.offset, numel)
        program = compile_program(collectives, transfers, self._comm.rank, padding=padding, span=span,
                                  levels=self._level_ranks, staged=staged, copy_out=copy_segments(where, kept))
        copy_out = []
        for segment in program.copy_out:
            dst = self._params[segment.param_id].grad_buffer.view(-1)
            copy_out.append(_CopyOut(dst if segment.whole else dst.narrow(0, segment.at, segment.count),
                                     segment.src_offset, segment.param_id, segment.last))
        return _CachedFlush(source=source, numels=numels, plan=plan, program=program, copy_out=tuple(copy_out),
                            dsts=[c.dst for c in copy_out])

    def _remember(self, key: tuple[Any, ...], cached: _CachedFlush) -> None:
        if len(self._cache) >= _FLUSH_CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = cached

    # ---- counting and the probe --------------------------------------------------------------------------

    def _count(self, cached: _CachedFlush, buffer: torch.Tensor, scheduled: bool) -> None:
        s = self._stats
        comm = self._comm
        plan = cached.plan
        program = cached.program
        n = program.counts
        s.flushes += 1
        s.scheduled_flushes += scheduled
        s.collectives += n.collectives
        s.reduce_calls += n.reduce_calls
        s.all_reduce_calls += n.all_reduce_calls
        s.reduce_scatter_calls += n.reduce_scatter_calls
        if n.two_level_stages:
            s.two_level_flushes += 1
            s.two_level_stages += n.two_level_stages
            s.node_calls += n.node_calls
            s.rail_calls += n.rail_calls
            s.rail_handoffs += n.rail_handoffs
            s.node_handoffs += n.node_handoffs
            s.node_handoff_sends += n.node_handoff_sends
            s.node_handoff_recvs += n.node_handoff_recvs
        if n.handoff_rounds:
            s.handoff_rounds += n.handoff_rounds
            s.sends += n.sends
            s.recvs += n.recvs
        s.reduced_elems += plan.reduced_elems
        s.owner_elems += plan.owner_elems
        s.kept_elems += program.kept
        dtype = str(buffer.dtype).removeprefix("torch.")
        if self.record_collectives:
            full = str(buffer.dtype)
            self.collective_log += [(name, root, count, full) for name, root, count in program.log]
            self.flush_log.append(FlushRecord(dtype, buffer.element_size(), plan.reduced_elems,
                                              plan.received_elems(comm.rank), program.kept, plan.owner_elems,
                                              n.collectives, program.algo))
        index = next(self._flush_counter)
        if self._probe and index <= PROBE_FLUSH_LIMIT and (self._probe_all_ranks or comm.rank == 0):
            line = format_probe_line(FlushReport(rank=comm.rank, flush_index=index, dtype=dtype, plan=plan,
                                                 kept_elems=program.kept, pre_div=self.pre_div,
                                                 calls=n.collectives, algo=program.algo))
            s.probe_lines.append(line)
            emit(line)
