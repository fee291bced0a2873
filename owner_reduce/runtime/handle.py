"""The DeepCompile handle for ZeRO stages 1 and 2: the object ``get_deepcompile_handle()`` returns, in Python.

Why Python: DeepCompile reaches its extension only through ``get_deepcompile_handle()``; an object with the same
methods there drives the whole stage-1/2 reduce path, so the owner path needs no C++/CUDA build. This module is
that interface and nothing more: it checks, counts and hands each call to the layer that does the work, one way:
``reduce_grad`` -> ``accumulate`` (stage 1, between micro-steps) -> ``placement`` (which bucket, which offset, when
it is complete) -> ``flush`` (the plan, the collectives, the copy-out). Semantics follow ``z1.cpp`` / ``z2.cpp`` /
``deepcompile.h``; nothing communicates while DeepCompile profiles.

At ``init`` the ranks agree, in one all_gather, on everything the flushes depend on: the settings (the config's
``compile`` keys, ``planning.settings``, and the files they name, the flushes' deadline among them), bucket size, owner
map, and the facts of the topology that the cost model uses to choose each flush's algorithm (ranks per node, GPU
generation). Rank 0 then logs the init line and the settings line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..planning.calibration import Calibration, format_fits
from ..planning.collectives import NATIVE, NODE, RAIL, TWO_LEVEL, WORLD
from ..planning.connections import KINDS_BY_COMM, NATIVE_KINDS, handoff_peers
from ..planning.flags import REDUCE_PROBE, OwnerReduceFlags, describe_flag_disagreement, pack_flags
from ..planning.flush_choice import AUTO, FlushCost, agreed_topology
from ..planning.measured import (
    STEP,
    TRIAL_ROUNDS,
    format_measured_detail,
    format_measured_line,
    slowest_progress,
    verdicts,
)
from ..planning.monitor import due, monitor_events
from ..planning.nodes import HOST_INTS, NodeLayout, node_layout, pack_host, unpack_host
from ..planning.owner_map import OwnerMap, Placement
from ..planning.settings import (
    ALGO,
    ALGO_VALUES,
    CALIBRATION,
    MODEL,
    TIMEOUT,
    VERDICTS,
    OwnerReduceSettings,
    RunSetup,
    key_name,
    nccl_mismatch,
    settings_line,
    transport_text,
)
from ..planning.step_plan import FlushTimes, native_step_us
from ..planning.two_level import TwoLevel, two_level_of
from ..planning.verdict_book import (
    ScheduleVerdicts,
    TrialProgress,
    VerdictBook,
    checkpoint_payload,
    parse_checkpoint_payload,
    payload_digest,
    write_verdicts,
)
from ..planning.wording import by_reason, by_value, count_noun, ranks_phrase
from . import deadline as deadlines
from . import stall_report
from .accumulate import Accumulator
from .buckets import DoubleBufferedBuckets
from .comm import ReduceComm
from .deadline import add_note
from .errors import OwnerReduceMismatchError
from .exposure import ExposureProbe, OwnerPathModel
from .flush import Flusher, Levels, Param
from .monitor import FlushHooks, MonitorSink, MonitorStep
from .placement import GradPlacer
from .schedule import Schedule
from .stats import FlushRecord, RuntimeStats, emit, emit_detail, say_if_hidden
from .topology import (
    host_digest,
    host_name,
    launcher_ranks_per_node,
    local_rank,
    nvlinks,
    slurm_ranks_on_node,
    sm_major,
)
from .trial import Trial, key_of, trial_flushes
from .trial_clock import StreamClock, TrialClock

NODE_HANDOFF_ROLE = "node hand-off"  # the communicator's name in messages (``comm`` ``role``)

__all__ = ["FlushRecord", "OwnerReduceMismatchError", "OwnerReduceRuntime", "RuntimeSettings", "RuntimeStats",
           "emit"]

_AGREEMENT_PROTOCOL = 8
_HOST_AT = 21  # the agreement row's first integer of the host name (``planning.nodes.pack_host``); ``_check_agreement``
_PROBLEM_TEXT_LIMIT = 600  # bytes of a rank's reasons that reach the other ranks (``_gather_texts``)
SCHEDULE_PREFIX = "[dc-schedule][r0]"  # rank 0's line when a graph's owner-ordered schedule is learned


@dataclass(frozen=True)
class RuntimeSettings:
    flags: OwnerReduceFlags
    owner_map: OwnerMap
    map_problems: tuple[str, ...] = ()  # where this rank's optimizer contradicts the map (should be empty)
    # compile.reduce_to_owner_algo (``planning.settings``): flush_algo a forced candidate or the cost model's choice
    # (auto), measure the measured guard (``planning.measured``): "auto" is (auto, True), "model" (auto, False)
    flush_algo: str = AUTO
    measure: bool = True
    # compile.reduce_to_owner_calibration's file: measured call times in place of NCCL's tables
    calibration: Calibration | None = None
    verdicts: VerdictBook | None = None  # compile.reduce_to_owner_verdicts's file, replayed (``planning.verdict_book``)
    verdicts_path: str | None = None  # compile.reduce_to_owner_verdicts: replayed, or written where it does not exist
    # (key or variable, reason) for every input this rank could not use (``planning.rank_inputs``): refused at init on
    # every rank together, by the agreement
    env_problems: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None  # compile.reduce_to_owner_timeout_s (None: the default group's timeout; agreed)

    @property
    def algo(self) -> str:
        """The value of ``compile.reduce_to_owner_algo`` these settings mean."""
        return self.flush_algo if self.flush_algo != AUTO else AUTO if self.measure else MODEL


class OwnerReduceRuntime:
    """The DeepCompile handle for ZeRO stages 1 (z1.cpp) and 2 (z2.cpp): ``init`` ... ``cleanup``."""

    def __init__(self, settings: RuntimeSettings, comm_factory: Any) -> None:
        self.settings = settings
        self._comm_factory = comm_factory
        self.comm: ReduceComm | None = None
        self.stats = RuntimeStats()
        self._params: dict[int, Param] = {}
        self._graphs: dict[int, tuple[int, ...]] = {}
        self._stage = 0  # 1 or 2, from register_graph_z1 / register_graph_z2
        self._registered_elems: dict[int, tuple[torch.dtype, int]] = {}  # ds_id -> (dtype, numel): bucket sizes
        self._elems_by_dtype: dict[torch.dtype, int] | None = None  # summed from _registered_elems when needed
        self._accumulator = Accumulator(self.stats)
        self.flusher: Flusher | None = None  # made at init, with the communicators and the agreed cost model
        self._levels: Levels | None = None  # the node and rail communicators, where a two-level flush can run
        self.placer: GradPlacer | None = None  # made at init (needs the bucket size and the agreed cost model)
        self._exposure: ExposureProbe | None = None  # the probe's step summary, until its lines are out (``exposure``)
        self._learned_graphs: dict[int, int] = {}  # graph_id -> its number in the schedule lines (1, 2, ...)
        self._graph_numbers = 0  # schedule lines printed since the last reset (numbers are never reused before it)
        self._update = False
        self._profiling = False
        self._measuring = False  # the measured guard runs (agreed at init; see ``_trial_for``)
        # Every verdict decided, replayed or restored so far (``planning.verdict_book``): saved with each checkpoint.
        self._book: VerdictBook | None = settings.verdicts
        replayed = settings.verdicts.schedules if settings.verdicts is not None else ()
        # schedule key -> where its verdicts came from (the replay line)
        self._book_sources = {s.key: f"{key_name(VERDICTS)}={settings.verdicts_path}" for s in replayed}
        # schedule key -> a checkpoint's trial under way, until its schedule is learned (``trial`` Note (resumed
        # trials))
        self._resumed_trials: dict[str, tuple[TrialProgress, str]] = {}
        self._trial_clock: TrialClock = StreamClock()  # the measured guard's samples (``trial_clock``)
        self.on_cleanup: Any = None  # set by activation: hands get_deepcompile_handle() back
        # From init's agreement, by data-parallel rank: each rank's host and global rank, and the nodes they form.
        self.hosts: list[str] = []
        self.global_ranks: list[int] = []
        self.node_layout: NodeLayout | None = None
        # DeepSpeed's monitor (``monitor``), set by activation where the config enables one; its step being measured.
        self.monitor: MonitorSink | None = None
        self._monitor_step: MonitorStep | None = None
        self._stall_keys = ""  # the stall report's keys in the store, agreed at init
        self.stall_reporter: stall_report.StallReporter | None = None  # where torch's default store exists

    # ---- what tests, the demo and the benchmark read -----------------------------------------------------

    @property
    def record_collectives(self) -> bool:
        return self.flusher.record_collectives

    @record_collectives.setter
    def record_collectives(self, value: bool) -> None:
        self.flusher.record_collectives = bool(value)

    @property
    def collective_log(self) -> list[tuple[str, int | None, int, str]]:
        return self.flusher.collective_log

    @property
    def flush_log(self) -> list[FlushRecord]:
        return self.flusher.flush_log

    @property
    def plans_computed(self) -> int:
        return self.flusher.plans_computed

    @property
    def trial_clock(self) -> TrialClock:
        """Where the measured guard's samples come from (``trial_clock``): the streams' clock; tests set fixed ones."""
        return self._trial_clock

    @trial_clock.setter
    def trial_clock(self, clock: TrialClock) -> None:
        self._trial_clock = clock
        if self.placer is not None:
            self.placer.clock = clock

    # ---- the handle surface DeepCompile's stage-1/2 path calls -------------------------------------------

    def init(self, process_group: Any, compile_config: Any, reduce_bucket_size: int) -> None:
        """Make the communicator, agree with every rank, make the node and rail communicators where a two-level flush
        can run: all of it under init's one deadline (``deadline`` Note (one deadline for init)); the flushes' deadline
        from then on."""
        group_timeout_s = deadlines.default_group_timeout_s()
        flush_deadline = deadlines.resolve(self.settings.timeout_s, group_timeout_s)
        init_deadline = deadlines.for_init(flush_deadline, group_timeout_s, time.monotonic())
        with deadlines.init_window(init_deadline):
            self.comm = self._comm_factory(process_group)
            try:
                cost, facts = self._check_agreement(int(reduce_bucket_size))
                # ``comm`` Note (lazy connections): every kind a flush may issue, connected here, not in a flush.
                self.comm.warm_up(KINDS_BY_COMM[WORLD] if self.settings.flags.reduce_to_owner else NATIVE_KINDS,
                                  int(reduce_bucket_size))
                cost = self._make_levels(cost, facts, bool(compile_config.double_buffer), int(reduce_bucket_size))
                self.flusher = Flusher(self.settings.owner_map, self.settings.flags, self._params, self.stats,
                                       self.comm, cost, self._levels)
                flush_deadline = self._with_stall_report(flush_deadline)
                buckets = DoubleBufferedBuckets(int(reduce_bucket_size), bool(compile_config.double_buffer),
                                                self._bucket_limits)
                self._measuring = (self.settings.measure and cost.force == AUTO and cost.topology is not None
                                   and self.settings.flags.reduce_to_owner)
                self.placer = GradPlacer(self.settings.owner_map, self.settings.flags.reduce_to_owner, buckets,
                                         self.flusher, self.stats, cost, self._sync_streams, self._learned,
                                         self._trial_for if self._measuring else None)
                self.placer.clock = self._trial_clock
                if self.settings.flags.reduce_probe:
                    self._start_exposure(cost)
            except BaseException as error:
                # DeepSpeed calls cleanup() only after a successful init: release the communicators here; a failure
                # doing so is a note on the error that stopped init.
                try:
                    try:
                        self._close_levels()
                    finally:
                        self.comm.close()
                except BaseException as close_error:
                    add_note(error, "releasing the communicators afterwards failed too", close_error)
                self.comm = None
                raise
        if self.comm.deadline is init_deadline:  # made inside the window (a test may hand in its own communicator)
            self.comm.set_deadline(flush_deadline)
        if self.comm.rank == 0:
            self.stats.init_line = self.settings.owner_map.init_line(sliced=self.settings.flags.reduce_to_owner)
            emit(self.stats.init_line, even_if_hidden=True)
            self.stats.settings_line = self._settings_line(flush_deadline, int(reduce_bucket_size), process_group)
            emit(self.stats.settings_line)
            if self.settings.verdicts_path is not None:
                self._say_verdicts()
            if self.settings.flags.reduce_probe:
                say_if_hidden(f"{key_name(REDUCE_PROBE)}'s lines")

    def register_param(self, ds_id: int, ds_shape: Any, ds_tensor: torch.Tensor, grad_buffer: torch.Tensor,
                       offset: int) -> None:
        if ds_id not in self.settings.owner_map:
            raise KeyError(f"owner_reduce: DeepCompile registered param {ds_id}, which the owner map lacks")
        self._params[ds_id] = Param(ds_tensor, self._checked_buffer(ds_id, grad_buffer, offset), int(offset))
        numel = 1
        for dim in ds_shape:
            numel *= int(dim)
        self._registered_elems[ds_id] = (ds_tensor.dtype, numel)
        self._elems_by_dtype = None
        self.flusher.forget_plans()

    def update_param_grad_buffer(self, ds_id: int, grad_buffer: torch.Tensor, offset: int) -> None:
        self._params[ds_id] = self._params[ds_id]._replace(grad_buffer=self._checked_buffer(ds_id, grad_buffer, offset),
                                                           offset=int(offset))
        self.flusher.forget_plans()

    def register_graph_z1(self, graph_id: int, ds_ids: Any) -> None:
        self._register_graph(1, graph_id, ds_ids)

    def register_graph_z2(self, graph_id: int, ds_ids: Any) -> None:
        self._register_graph(2, graph_id, ds_ids)

    def start_backward(self, update: bool) -> None:
        self._update = bool(update)
        monitor = self.monitor
        if monitor is not None:  # ``monitor``: this step's reduction is measured for DeepSpeed's monitor, or not
            measured = MonitorStep(self.comm.rank) if update and due(monitor.steps_done(), monitor.every) else None
            if measured is not None or self._monitor_step is not None:  # (one left by a backward DeepCompile profiled)
                self._monitor_step = measured
                self._set_flush_hooks()

    def enable_profiling(self, enable: bool) -> None:
        self._profiling = bool(enable)

    def is_profiling(self) -> bool:
        return self._profiling

    def clear_all_gathered_params(self) -> None:
        """ZeRO-3 state; stages 1 and 2 have none."""

    def reset(self) -> None:
        """DeepCompile recompiles (``launch_compile_passes``: the next step of its compile schedule).

        Note (graph ids): DeepCompile names a graph ``id(gm.graph)``, a memory address: it differs from rank to rank,
        and a graph compiled after the reset may get an old graph's address on one rank and a fresh one on another.
        Anything learned under a graph id (the owner-ordered schedules, the schedule lines' numbering, the flush plans
        made for them) is therefore forgotten here, on every rank alike, so that every rank starts over and learns its
        schedules from the same arrival-order backward; otherwise a rank whose new graph reused an address would follow
        the old graph's schedule while another records in arrival order: other collectives, or the same collectives
        over differently laid out buckets. Registering a graph forgets its id's schedule and number
        (``_register_graph``); cached plans are keyed by the schedule objects they were made for, never by a graph id.
        Buckets and accumulation are kept, as the native runtime keeps its buckets: they are not per graph.
        """
        self.stats.resets += 1
        self._forget_graphs()

    def cleanup(self) -> None:
        """Wait for the reduce stream (bounded), then release everything and hand DeepCompile's handle back.

        Note (cleanup always releases): DeepSpeed calls this once (``engine.destroy()``); whatever fails here, the
        release still runs to its end, ``on_cleanup`` included, so that a later engine in this process can start,
        and the first error (the bounded wait's, typically) is the one raised; a later one is a note on it.
        """
        try:
            self._sync_streams("cleanup")  # nothing in flight may still read the buckets or the communicator
        except BaseException as error:
            try:
                self._release()
            except Exception as release_error:  # noqa: BLE001 - the wait's error is the one to report
                add_note(error, "releasing the runtime failed too", release_error)
            raise
        self._release()

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
        if grad.requires_grad:
            grad = grad.detach()
        if self._stage != 2:  # z2.cpp reduces every micro-step; the grad buffers accumulate the reduced sums
            grad = self._accumulator.take(ds_id, grad, self._update)
            if grad is None:
                return
        placer = self.placer
        assert placer is not None, "owner_reduce runtime used before init()"
        placer.add(ds_id, grad, graph_id)

    def end_backward(self, graph_id: int, release_reduce_buckets: bool) -> None:
        if self._profiling:
            return
        self.stats.end_backward_calls += 1
        placer = self.placer
        assert placer is not None, "owner_reduce runtime used before init()"
        probe = self._exposure
        recording = probe is not None and probe.recording
        measured, self._monitor_step = self._monitor_step, None  # DeepSpeed's monitor's step (``monitor``)
        if recording:
            probe.backward_ending(placer.streams, placer.has_pending)  # the compute mark: before anything is flushed
        if measured is not None:
            measured.backward_ending(placer.streams)
        placer.end_backward()
        if recording:
            probe.backward_ended(placer.streams, placer.last_backward)
        if measured is not None:
            measured.backward_ended(placer.streams)
        if recording or measured is not None:
            self._set_flush_hooks()
        self._sync_streams("end_backward")  # the optimizer reads the grad buffers next
        if placer.trials_running:
            self._advance_trials()
        if probe is not None:
            self._exposure_after_wait(probe)
        if measured is not None:
            self._monitor_after_wait(measured)
        if self._stage == 2 and self._update:
            # z2.cpp: this graph's parameters start the next step by overwriting (other graphs clear theirs).
            for ds_id in self._graphs.get(graph_id, ()):
                self.flusher.has_acc_grad.pop(ds_id, None)
        if release_reduce_buckets:
            # As deepcompile.cpp's end_backward: the buckets are shared by all graphs and released once the last
            # backward graph flushed (reduce_buckets->clear()); the next flush allocates them again.
            placer.release_buckets()

    # ---- registration ------------------------------------------------------------------------------------

    def _register_graph(self, stage: int, graph_id: int, ds_ids: Any) -> None:
        if self._stage not in (0, stage):
            raise RuntimeError(f"owner_reduce: graph {graph_id} registered for ZeRO stage {stage}, "
                               f"earlier graphs for stage {self._stage}")
        self._stage = stage
        self.flusher.stage = stage
        # A registration starts a graph: whatever was learned under its id belonged to another graph whose address
        # this one reuses (see Note (graph ids) in ``reset``), or to this one before DeepCompile compiled it again.
        self._learned_graphs.pop(graph_id, None)
        if self.placer is not None:
            self.placer.forget_schedules(graph_id)
        self._graphs[graph_id] = tuple(int(i) for i in ds_ids)

    def _bucket_limits(self, dtype: torch.dtype) -> int | None:
        """Elements of all registered gradients of ``dtype`` (None if none): no bucket needs to be larger."""
        if self._elems_by_dtype is None:  # summed once per registration change, not at every bucket allocation
            totals: dict[torch.dtype, int] = {}
            for d, n in self._registered_elems.values():
                totals[d] = totals.get(d, 0) + n
            self._elems_by_dtype = totals
        return self._elems_by_dtype.get(dtype) or None

    def _checked_buffer(self, ds_id: int, grad_buffer: torch.Tensor, offset: int) -> torch.Tensor:
        # As the native registry: a registered buffer starts at zero. A buffer for elements that reduce to
        # another rank is refused here, before any collective of the step has started.
        if grad_buffer.numel():
            self._check_received(ds_id, int(offset), grad_buffer.numel())
            grad_buffer.zero_()
        return grad_buffer

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

    # ---- streams, schedules, lifetime --------------------------------------------------------------------

    def _sync_streams(self, call: str) -> None:
        """Wait for the reduce stream, bounded by the communicator's deadline (see ``comm.wait_until``)."""
        streams = self.placer.streams if self.placer is not None else None
        if streams is not None:
            comm = self.comm
            streams.synchronize(None if comm is None else lambda done: comm.wait_until(done, call))

    def _learned(self, schedule: Schedule) -> None:
        """Rank 0, the first time a graph learns its schedule: what each flush will run, and what the cost model
        says it saves against the native runtime's one AllReduce per gradient, in about 30 words; e.g.
        ``[dc-schedule][r0] graph #1: 3 flushes per backward: reduce_scatter+handoff x2, allreduce x1; modelled 0.41x
        native (1.234 vs 3.010 ms); measuring 2 flushes against native's calls over the next 6 steps``; what the model
        was (NCCL's tables of a named topology, or a calibration) in a DEBUG line after it. Graphs are numbered in
        the order they first learn a schedule, from 1 again after a reset."""
        self._connect_handoffs(schedule)
        if self.comm is None or self.comm.rank != 0 or schedule.graph_id in self._learned_graphs:
            return
        self._graph_numbers += 1
        number = self._learned_graphs[schedule.graph_id] = self._graph_numbers
        cost = self.flusher.cost
        flushes = [f for per_dtype in schedule.flushes.values() for f in per_dtype]
        choices: dict[str, int] = {}
        for f in flushes:
            algo = f.layout.algo
            choices[algo] = choices.get(algo, 0) + 1
        line = (f"{SCHEDULE_PREFIX} graph #{number}: {count_noun(len(flushes), 'flush', 'flushes')} per backward: "
                + ", ".join(f"{a} x{n}" for a, n in choices.items()))
        detail = None
        if cost.topology is not None:
            chosen = schedule.modelled_us or sum(f.layout.modelled_us for f in flushes)
            native = native_step_us([FlushTimes(world_us=device, issue_us=(host,)) for device, host in (
                cost.for_dtype_bytes(f.dtype.itemsize).native_parts(f.numels) for f in flushes)])
            ratio = chosen / native if native else 1.0
            calibrated = isinstance(cost.calibration, Calibration)
            basis = (f"call times of calibration {cost.calibration.digest()}" if calibrated
                     else f"alpha-beta model of {cost.topology.name}")
            line += f"; modelled {ratio:.2f}x native ({chosen / 1000:.3f} vs {native / 1000:.3f} ms)"
            # What the settings line says already (the calibration, a forced algorithm), and the model's name: DEBUG.
            detail = (f"{SCHEDULE_PREFIX} graph #{number}: modelled on the {basis}, "
                      f"{key_name(ALGO)}={self.settings.algo}; native is one AllReduce per gradient in one group")
            trial = sum(f.layout.choice != NATIVE for f in flushes)
            known = self._known_verdicts(schedule)
            saved = self._resumed_trials.get(key_of(schedule, self.comm.world_size)) if trial else None
            remaining = count_noun(2 * TRIAL_ROUNDS - (saved[0].steps if saved is not None else 0), "step", "steps")
            if schedule.overlapped:
                line += "; flushes overlap"
            if self._measuring and trial and known is not None and saved is not None:
                line += (f"; the resumed trial's last {remaining}, then the verdicts replayed from "
                         f"{self._book_sources.get(known.key)}")
            elif self._measuring and trial and known is not None:
                line += f"; verdicts replayed from {self._book_sources.get(known.key)} (no trial)"
            elif self._measuring and trial and saved is not None:
                what = "the step" if schedule.overlapped else count_noun(trial, "flush", "flushes")
                line += f"; measuring {what} against native's calls, {remaining} left (resumed trial)"
            elif self._measuring and trial and schedule.overlapped:
                line += f"; measuring the step against native's calls over the next {2 * TRIAL_ROUNDS} steps"
            elif self._measuring and trial:
                line += (f"; measuring {count_noun(trial, 'flush', 'flushes')} against native's calls over the next "
                         f"{2 * TRIAL_ROUNDS} steps")
        self.stats.schedule_lines.append(line)
        emit(line)
        if detail is not None:
            emit_detail(detail)

    def _connect_handoffs(self, schedule: Schedule) -> None:
        """Every rank, as it learns a schedule: the hand-offs' peers connected before its first flush (``comm`` Note
        (lazy connections)); the peers' own ranks learn the same schedule at the same point of the same step."""
        comm, levels = self.comm, self.flusher.levels
        if comm is None or not comm.connects_lazily:
            return
        transfers = [t for flushes in schedule.flushes.values() for f in flushes for t in f.layout.transfers]
        per_node = levels.node.world_size if levels is not None else 1
        for peers in handoff_peers(transfers, comm.rank, per_node):
            target = comm if peers.comm == WORLD else levels.rail if peers.comm == RAIL else levels.handoff
            target.connect_peers(peers.sends, peers.recvs)

    # ---- the probe's step summary (``exposure``) -----------------------------------------------------------

    def _start_exposure(self, cost: FlushCost) -> None:
        """The probe's step summary from the first backward. Without the owner path its lines add the model's
        saving, costed with the two-level flush among the candidates where the ranks form nodes over a network (as
        the owner path would have it: ``_make_levels``), though no node or rail communicator exists in this run."""
        model = None
        if not self.settings.flags.reduce_to_owner:
            if cost.topology is not None and cost.calibration is None and cost.two_level is None:
                cost = replace(cost, two_level=two_level_of(cost.topology, cost.topology.gpus_per_node))
            model = OwnerPathModel(self.settings.owner_map, cost).ratio
        self._exposure = ExposureProbe(model)
        self._set_flush_hooks()

    def _exposure_after_wait(self, probe: ExposureProbe) -> None:
        """After ``end_backward``'s wait: read the step before (``exposure`` Note (no host wait)); once the probe's
        steps are read, every rank's rows in one gather (Note (one gather)) and rank 0's lines."""
        probe.after_wait()
        if not probe.done:
            return
        self._exposure = None
        self._set_flush_hooks()
        rows = self.comm.all_gather_ints(probe.row())
        self.stats.exposure_samples = list(probe.samples)
        if self.comm.rank == 0:
            for line in probe.lines(rows):
                self.stats.exposure_lines.append(line)
                emit(line)

    def _set_flush_hooks(self) -> None:
        """The flusher's hooks (``flush_started`` / ``flush_ended``): the probe's while it records, the monitor's step
        while one is measured, both, or None (the flush's one check)."""
        probe = self._exposure if self._exposure is not None and self._exposure.recording else None
        measured = self._monitor_step
        self.flusher.exposure = (FlushHooks(probe, measured) if probe is not None and measured is not None
                                 else probe if probe is not None else measured)

    # ---- DeepSpeed's monitor (``monitor``) ----------------------------------------------------------------------

    def _monitor_after_wait(self, measured: MonitorStep) -> None:
        """After ``end_backward``'s wait on a measured step: every rank's row in one gather (``monitor`` Note (one
        exchange, none in between)), and rank 0 writes the min / median / max events to DeepSpeed's monitor."""
        rows = self.comm.all_gather_ints(measured.row())
        self.stats.monitor_steps += 1
        if self.comm.rank == 0:
            events = monitor_events(rows, self.monitor.x())
            self.stats.monitor_events += len(events)
            self.monitor.write(events)

    # ---- the measured guard ------------------------------------------------------------------------------

    def _trial_for(self, schedule: Schedule) -> Trial | Schedule:
        """A freshly learned schedule's trial (``trial``): its model-chosen flushes against native's calls; or, where
        the book holds this schedule's verdicts (a checkpoint's, a verdict file's, an earlier trial's in this run), the
        schedule of their winners at once, every rank alike (``planning.verdict_book``)."""
        cost = self.flusher.cost

        def native_us(flush: Any) -> float:
            return cost.for_dtype_bytes(flush.dtype.itemsize).native_us(flush.numels)

        trial = Trial(schedule, self.placer.native_layout, native_us, world_size=self.comm.world_size)
        known = self._known_verdicts(schedule)
        if known is None:
            self._resume_trial(trial)
            return trial
        if trial.key in self._resumed_trials and self._resume_trial(trial):
            # Saved during this trial, decided since (a verdict file the saving run wrote after its save): the trial's
            # remaining steps run as the saving run ran them, then the known winners (``trial`` Note (resumed trials)).
            trial.known = known
            return trial
        winners, report = trial.winners(known.verdicts)
        self.stats.trials_replayed += 1
        self.stats.measured_overruled += sum(f.verdict.native_wins for f in report)
        if self.comm.rank == 0:
            self._measured_line(schedule.graph_id, report, known.rounds, source=self._book_sources.get(trial.key))
        return winners

    def _resume_trial(self, trial: Trial) -> bool:
        """A checkpoint's trial of this schedule goes on from where it was saved (``trial`` Note (resumed trials)),
        every rank alike (every rank restored the same state and learned the same schedule); whether it does."""
        saved = self._resumed_trials.pop(trial.key, None)
        if saved is None or not trial.needed:
            return False
        progress, source = saved
        why = trial.resume(progress)
        if why is None:
            self.stats.trials_resumed += 1
            return True
        if self.comm.rank == 0:
            from deepspeed.utils import logger

            logger.warning(f"owner_reduce: not resuming the measured guard's trial saved in {source}: {why}; this "
                           f"schedule is measured from its first trial step")
        return False

    def _known_verdicts(self, schedule: Schedule) -> ScheduleVerdicts | None:
        """The book's verdicts of ``schedule`` where they match its trial flushes (``verdict_book`` Note (key)), or
        None: it is measured."""
        if self._book is None:
            return None
        flushes = trial_flushes(schedule)
        known = self._book.find(key_of(schedule, self.comm.world_size)) if flushes else None
        return known if known is not None and known.matches(flushes) else None

    def _advance_trials(self) -> None:
        """After ``end_backward``'s wait: the timed flushes' times go to their trials; a trial with every sample
        gathers every rank's samples in one collective (bounded by the deadline, as every call of the communicator)
        and every rank installs the same winners, and keeps them in the book (``planning.verdict_book``)."""
        placer = self.placer
        placer.take_marks()
        for graph_id, trial in placer.finished_trials():
            if trial.known is not None:  # a resumed trial whose verdicts a file holds: those, as the saving run's
                schedule, report = trial.winners(trial.known.verdicts)
                placer.install(graph_id, schedule)
                self.stats.trials_replayed += 1
                self.stats.measured_overruled += sum(f.verdict.native_wins for f in report)
                if self.comm.rank == 0:
                    self._measured_line(graph_id, report, trial.known.rounds,
                                        source=self._book_sources.get(trial.key))
                continue
            rows = self.comm.all_gather_ints(trial.row())
            schedule, report = trial.winners(verdicts(rows))
            placer.install(graph_id, schedule)
            self.stats.trials_decided += 1
            self.stats.measured_overruled += sum(f.verdict.native_wins for f in report)
            book = self._book or VerdictBook(self.comm.world_size)
            self._book = book.with_schedule(ScheduleVerdicts(trial.key, trial.rounds, report))
            self._book_sources[trial.key] = "an earlier trial of this run"
            if self.comm.rank == 0:
                written = self._write_verdicts()
                self._measured_line(graph_id, report, trial.rounds, written=written)
                if written is None:
                    self._say_close(graph_id, report)

    def _say_close(self, graph_id: int, report: Any) -> None:
        """Rank 0, once per decided schedule: the flushes whose verdict another run could take otherwise
        (``measured.is_close``), and how to pin the verdicts. Not where this run wrote them to a verdict file."""
        close = [f for f in report if f.verdict.close]
        if not close:
            return
        from deepspeed.utils import logger

        number = self._learned_graphs.get(graph_id)
        names = ", ".join("the step's reduction" if f.algo == STEP else f"flush {f.number} ({f.algo})"
                          for f in close)
        # Why "within the noise": the verdict would flip where native's slowest step crosses the model's fastest,
        # and these lie no further from that than one variant's steps varied (``measured.is_close``).
        line = (f"owner_reduce: graph {f'#{number}' if number else graph_id}: the measured guard's verdict on {names} "
                f"was within the noise, so another run may decide otherwise and differ in the last bits; set "
                f"{key_name(VERDICTS)} to pin the verdicts")
        self.stats.close_lines.append(line)
        logger.warning(line)

    def _measured_line(self, graph_id: int, report: Any, rounds: int, source: str | None = None,
                       written: str | None = None) -> None:
        number = self._learned_graphs.get(graph_id)
        graph = f"#{number}" if number else str(graph_id)
        line = format_measured_line(SCHEDULE_PREFIX, graph, report, source=source)
        if written is not None:
            line += f"; verdicts written to {written}"  # the next run with this config replays them
        self.stats.measured_lines.append(line)
        emit(line)
        emit_detail(format_measured_detail(SCHEDULE_PREFIX, graph, report, rounds))

    def _write_verdicts(self) -> str | None:
        """Rank 0, after a trial: the book to ``compile.reduce_to_owner_verdicts``'s file when this run writes it (it
        did not exist at init); the path written, or None. A failure to write is said, never raised: training is not at
        fault, only the pinning is lost."""
        path = self.settings.verdicts_path
        if path is None or self.settings.verdicts is not None or self._book is None:
            return None
        try:
            write_verdicts(path, self._book)
        except OSError as error:
            from deepspeed.utils import logger

            logger.warning(f"owner_reduce: {key_name(VERDICTS)}={path!r}: writing the verdicts failed ({error}); this "
                           f"run's verdicts are not pinned")
            return None
        return path

    def _say_verdicts(self) -> None:
        """Rank 0 at init, where ``compile.reduce_to_owner_verdicts`` is set but the measured guard does not run for a
        reason the config could not show (one rank: nothing to measure): that it has no effect. (Replayed or written:
        the settings line says which; the owner path off or another algorithm than auto: warned at config time.)"""
        settings = self.settings
        if not self._measuring and settings.flags.reduce_to_owner and settings.algo == AUTO:
            from deepspeed.utils import logger

            logger.warning(f"owner_reduce: {key_name(VERDICTS)} has no effect: the measured guard does not run with "
                           f"{count_noun(self.comm.world_size, 'rank')}")

    def _settings_line(self, deadline: Any, bucket_size: int, process_group: Any) -> str:
        """The settings line (``planning.settings.settings_line``) of what this runtime runs with and on; where cupy's
        NCCL and torch's differ in major.minor, a warning before it (``planning.settings.nccl_mismatch``)."""
        import owner_reduce

        comm = self.comm
        cupy_nccl = torch_nccl = None
        backend = None
        if comm.name == "cupy-nccl":
            from .nccl_comm import nccl_version

            cupy_nccl = nccl_version()
        elif comm.name == "torch.distributed":
            backend = _backend_of(process_group)
        if torch.cuda.is_available():
            try:
                torch_nccl = tuple(torch.cuda.nccl.version())
            except (AttributeError, RuntimeError):  # a torch built without NCCL
                torch_nccl = None
        mismatch = nccl_mismatch(cupy_nccl, torch_nccl)
        if mismatch is not None:
            from deepspeed.utils import logger

            logger.warning(mismatch)
        layout = self.node_layout
        setup = RunSetup(transport=transport_text(comm.name, backend, cupy_nccl, torch_nccl),
                         world_size=comm.world_size,
                         nodes=layout.describe() if layout is not None else "nodes unknown",
                         bucket_elems=bucket_size, version=owner_reduce.__version__)
        s = self.settings
        if s.verdicts_path is None:
            verdicts = "none"
        elif s.verdicts is not None:
            verdicts = f"replay {s.verdicts.digest()} ({count_noun(len(s.verdicts.schedules), 'schedule')})"
        else:
            verdicts = f"write {s.verdicts_path}"
        return settings_line(OwnerReduceSettings(flags=s.flags, algo=s.algo),
                             calibration_digest=s.calibration.digest() if s.calibration is not None else None,
                             verdicts=verdicts, timeout_s=deadline.seconds, timeout_source=deadline.short_source,
                             setup=setup)

    # ---- the verdicts and checkpoints (``wiring.checkpoint``) ------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any] | None:
        """What ``engine.save_checkpoint`` keeps of the runtime (``wiring.checkpoint``): the verdicts and every schedule
        as learned (``placement`` Note (resumed schedules)); None before any schedule."""
        recordings = self.placer.recordings() if self.placer is not None else []
        if not recordings and (self._book is None or not self._book.schedules):
            return None
        named = [[(str(d).removeprefix("torch."), ids, numels) for d, ids, numels in r] for r in recordings]
        return checkpoint_payload(self._book, named, self._trials_under_way())

    def _trials_under_way(self) -> list[TrialProgress]:
        """Every trial under way, with every rank's samples so far (``trial`` Note (resumed trials)), plus a
        checkpoint's trials not resumed yet, in key order. Collective where a trial is under way (identical on every
        rank; ``save_checkpoint`` is called on every rank): two gathers bounded by the deadline, between steps, so no
        sample spans them."""
        trials = self.placer.running_trials() if self.placer is not None else []
        progress = [progress for progress, _ in self._resumed_trials.values()]
        if not trials:
            return sorted(progress, key=lambda p: p.key)
        row: list[int] = []
        for trial in trials:
            part = trial.progress_row()
            row += [len(part), *part]
        # Two gathers: the rows' lengths first (the gather of the rows needs one length on every rank), so that ranks
        # at different points of their trials (which the invariants exclude) refuse together instead of hanging.
        shapes = [tuple(r) for r in self.comm.all_gather_ints([len(trials), len(row)])]
        if len(set(shapes)) > 1:
            raise OwnerReduceMismatchError(
                f"owner_reduce on rank {self.comm.rank}: save_checkpoint: the ranks are at different points of the "
                f"measured guard's trials: "
                + by_value(shapes, lambda s: f"{count_noun(s[0], 'trial')} in a row of {s[1]} integers"))
        rows = self.comm.all_gather_ints(row)
        at = 0
        for trial in trials:
            width = rows[0][at]
            progress.append(trial.progress(slowest_progress([r[at + 1:at + 1 + width] for r in rows])))
            at += 1 + width
        return sorted(progress, key=lambda p: p.key)

    def restore_checkpoint_state(self, data: Any, source: str = "the checkpoint") -> None:
        """``engine.load_checkpoint``: the checkpoint's verdicts join the book (theirs win) and its schedules wait for
        their graphs' first backward, so the resumed run follows the same flushes with the same winners as the run
        that saved it, from its first step. Collective: every rank calls it (``load_checkpoint`` is), and the ranks
        agree on what they read, within the deadline; what every rank finds unusable is said once and dropped."""
        assert self.comm is not None and self.placer is not None, "owner_reduce runtime used before init()"
        try:
            # Looked up in this module at call time: the harness's fault injection replaces it here.
            book, recordings, trials = parse_checkpoint_payload(data, source)
            if book is not None:
                book.check_world_size(self.comm.world_size)
            dtypes = [[(getattr(torch, d), ids, numels) for d, ids, numels in r] for r in recordings]
            if any(not isinstance(d, torch.dtype) for r in dtypes for d, _, _ in r):
                raise ValueError(f"owner_reduce: {source}: a schedule names a dtype torch does not have")
        except (ValueError, AttributeError) as error:
            usable, reason = False, str(error).removeprefix("owner_reduce: ")
        else:
            usable, reason = True, None
        digest = int(payload_digest(data), 16) if usable else 0
        values = [row[0] for row in self.comm.all_gather_ints([digest])]
        if len(set(values)) > 1:
            raise OwnerReduceMismatchError(
                f"owner_reduce on rank {self.comm.rank}: the ranks read different owner_reduce state from {source}: "
                + by_value(values, lambda v: f"{v:012x}" if v else "unusable")
                + (f" (this rank: {reason})" if reason else ""))
        if not usable:
            if self.comm.rank == 0:
                from deepspeed.utils import logger

                logger.warning(f"owner_reduce: not resuming the verdicts and schedules of {source}: {reason}; they are "
                               f"learned and measured again")
            return
        if book is not None:
            self._book = book if self._book is None else self._book.merged(book)
            self._book_sources.update((s.key, source) for s in book.schedules)
        self.placer.restore_recordings(dtypes)
        self._resumed_trials = {t.key: (t, source) for t in trials}
        if self.comm.rank == 0:
            verdicts = count_noun(len(book.schedules), "schedule's verdicts", "schedules' verdicts") if book else \
                "no verdicts"
            under_way = "".join(f", the measured guard's trial of schedule {t.key} after {t.steps} of its "
                                f"{2 * t.rounds} steps" for t in trials)
            emit(f"owner_reduce: restored from {source}: {count_noun(len(recordings), 'schedule', 'schedules')} as "
                 f"learned and {verdicts}{under_way}: the resumed run follows them from its first backward")

    def _forget_graphs(self) -> None:
        """Everything keyed by a graph id (see Note (graph ids) in ``reset``)."""
        self._graphs.clear()
        self._learned_graphs.clear()
        self._graph_numbers = 0
        self.flusher.forget_plans()
        if self.placer is not None:
            self.placer.forget_schedules()

    def _release(self) -> None:
        """Drop every reference, close the communicator, hand the handle back (``on_cleanup``). ``comm.close()``
        waits within the deadline and may raise: the handle is handed back all the same, and that error is the one
        raised (see Note (cleanup always releases))."""
        comm, self.comm = self.comm, None
        if self.stall_reporter is not None:
            self.stall_reporter.close()
        self._forget_graphs()
        self._accumulator.clear()
        self._params.clear()
        self._registered_elems.clear()
        self._elems_by_dtype = None
        self.flusher.forget_plans()
        if self.placer is not None:
            self.placer.clear()
        self._profiling = False
        try:
            try:
                self._close_levels()
            finally:
                if comm is not None:
                    comm.close()
        except BaseException as error:
            try:
                self._hand_back()
            except Exception as hand_back_error:  # noqa: BLE001 - the close's error is the one to report
                add_note(error, "handing DeepCompile's handle back failed too", hand_back_error)
            raise
        self._hand_back()

    def _hand_back(self) -> None:
        if self.on_cleanup is not None:
            self.on_cleanup()

    # ---- agreement across ranks --------------------------------------------------------------------------

    def _check_agreement(self, bucket_size: int) -> tuple[FlushCost, list[tuple[int, int]]]:
        """One all_gather of 29 integers (the facts below, this rank's host name among them: ``planning.nodes``), and
        a second one of every rank's reasons where any rank has one; every rank raises on any mismatch or reason, so no
        rank is left hanging. Returns the flush cost model every rank derives from the same gathered facts, and keeps
        every rank's host and global rank (``hosts``, ``global_ranks``: the stall report names them) and the nodes
        they form (``node_layout``: the hosts decide; a variable that disagrees is a warning on rank 0).

        Note (every rank refuses together): whatever this rank could not use (a file its config names that it cannot
        read, one of another world size, ``NCCL_COMM_BLOCKING`` other than 1: ``planning.rank_inputs``) is not raised
        here but gathered: every rank then raises the same ``OwnerReduceMismatchError`` naming each failing rank, its
        key or variable and its reason, within init's deadline (the gathers are the communicator's, bounded), instead
        of one rank raising alone while the others wait for it. Ranks in messages are folded and capped
        (``planning.wording``)."""
        settings = self.settings
        flags = settings.flags
        calibration = settings.calibration
        verdict_file = settings.verdicts
        reasons = [reason for _, reason in settings.env_problems]
        for key, checked in ((CALIBRATION, calibration), (VERDICTS, verdict_file)):
            try:
                if checked is not None:
                    checked.check_world_size(self.comm.world_size)
            except ValueError as error:
                reasons.append(f"{key_name(key)}: {str(error).removeprefix('owner_reduce: ')}")
        reason_bytes = "; ".join(reasons).encode()[:_PROBLEM_TEXT_LIMIT]
        verdict_state = (int(verdict_file.digest(), 16) if verdict_file is not None
                         else -1 if settings.verdicts_path is not None else 0)
        timeout_ms = round(settings.timeout_s * 1000) if settings.timeout_s is not None else 0
        launcher_var, launcher_count = launcher_ranks_per_node()
        slurm_var, slurm_count = slurm_ranks_on_node()
        host = host_name()
        # 0 protocol, 1 flags, 2 bucket, 3 map digest, 4 algo, 5 map problems, 6 the launcher's ranks per node, 7 sm,
        # 8 deadline (ms), 9 calibration, 10 local rank, 11 host digest, 12 nvlinks, 13 verdicts, 14 reasons' length,
        # 15 the launcher's variable, 16 SLURM's variable, 17 SLURM's tasks on this node, 18 global rank, 19 DeepSpeed's
        # monitor's steps between writes (0: none), 20 this process's runtime number (rank 0's names the stall report's
        # keys: ``stall_report``), 21- host name
        mine = [_AGREEMENT_PROTOCOL, pack_flags(flags), bucket_size,
                int(settings.owner_map.digest()[:15], 16), ALGO_VALUES.index(settings.algo),
                len(settings.map_problems), launcher_count, sm_major(), timeout_ms,
                int(calibration.digest(), 16) if calibration is not None else 0, local_rank(), host_digest(host),
                nvlinks(), verdict_state, len(reason_bytes), launcher_var, slurm_var, slurm_count,
                self.comm.global_rank, self.monitor.every if self.monitor is not None else 0,
                stall_report.next_sequence(), *pack_host(host)]
        assert len(mine) == _HOST_AT + HOST_INTS
        rows = self.comm.all_gather_ints(mine)
        if len({row[0] for row in rows}) > 1 or len({len(row) for row in rows}) > 1:
            raise OwnerReduceMismatchError(f"owner_reduce on rank {self.comm.rank}: refusing to start: ranks run "
                                           f"different owner_reduce versions (agreement protocols "
                                           f"{sorted({row[0] for row in rows})})")
        texts = self._gather_texts(reason_bytes, [row[14] for row in rows])
        problems = by_reason(texts)

        def column(i: int) -> list[int]:
            return [row[i] for row in rows]

        def differs(i: int) -> bool:
            return len(set(column(i))) > 1

        problems += describe_flag_disagreement(column(1))
        if differs(1) and not describe_flag_disagreement(column(1)):  # an unknown flag bit
            problems.append(f"flags differ across ranks: {by_value(column(1))}")
        if differs(2):
            problems.append(f"reduce_bucket_size differs across ranks: {by_value(column(2))}")
        if differs(3):
            problems.append(f"the owner map differs across ranks: {by_value(column(3), lambda d: f'{d:015x}')}")
        if differs(4):
            problems.append(f"{key_name(ALGO)} differs across ranks: "
                            + by_value(column(4), lambda v: ALGO_VALUES[v] if 0 <= v < len(ALGO_VALUES) else str(v)))
        if differs(8):
            problems.append(f"{key_name(TIMEOUT)} differs across ranks: "
                            + by_value(column(8), lambda ms: f"{ms / 1000:g} s" if ms else "unset"))
        if differs(9):
            problems.append(f"{key_name(CALIBRATION)} names different calibrations across ranks: "
                            + by_value(column(9), lambda d: f"{d:012x}" if d else "none"))
        if differs(13):
            problems.append(f"{key_name(VERDICTS)} differs across ranks: " + by_value(column(13), _verdict_state))
        if differs(19):
            problems.append("DeepSpeed's monitor (steps_per_print with a monitor enabled) differs across ranks: "
                            + by_value(column(19), lambda n: f"every {n} steps" if n else "off"))
        bad_ranks = [r for r, row in enumerate(rows) if row[5]]
        if bad_ranks:
            problems.append(f"the owner map contradicts the optimizer on {ranks_phrase(bad_ranks)}"
                            + (f": {list(settings.map_problems)[:3]}" if settings.map_problems else ""))
        if problems:
            raise OwnerReduceMismatchError(f"owner_reduce on rank {self.comm.rank}: refusing to start: "
                                           + "; ".join(problems))
        self.hosts = [unpack_host(row[_HOST_AT:_HOST_AT + HOST_INTS]) for row in rows]
        self.global_ranks = column(18)
        self._stall_keys = f"{stall_report.KEY_PREFIX}/{rows[0][18]}/{rows[0][20]}"  # this runtime's, every rank alike
        layout = self.node_layout = node_layout(self.hosts, list(zip(column(15), column(6), strict=True)),
                                                list(zip(column(16), column(17), strict=True)))
        if self.comm.rank == 0 and layout.warnings:
            from deepspeed.utils import logger

            for warning in layout.warnings:
                logger.warning(warning)
        topology = agreed_topology(self.comm.world_size, [layout.ranks_per_node], column(7), column(12))
        if calibration is not None and topology is not None and self.comm.rank == 0:
            lines = format_fits(calibration)
            emit(lines[0])
            for line in lines[1:]:
                emit_detail(line)
        facts = [(row[10], row[11]) for row in rows]
        return FlushCost(topology, force=settings.flush_algo, calibration=calibration), facts

    def _gather_texts(self, mine: bytes, lengths: list[int]) -> list[str]:
        """Every rank's text (its reasons), gathered only where some rank has one: every rank knows ``lengths`` from
        the agreement's row, so every rank takes the same branch. As integers (the communicator gathers those)."""
        width = max(lengths)
        if width == 0:
            return [""] * len(lengths)
        rows = self.comm.all_gather_ints(list(mine.ljust(width, b"\0")))
        return [bytes(row[:n]).decode(errors="replace") for row, n in zip(rows, lengths, strict=True)]

    # ---- the two-level flush's communicators -------------------------------------------------------------

    def _make_levels(self, cost: FlushCost, facts: list[tuple[int, int]], double_buffer: bool,
                     bucket_size: int) -> FlushCost:
        """The node and rail communicators (``planning.two_level``), made once here on every rank alike, where a
        two-level flush can run: the owner path on, the algorithm ``auto`` (without a calibration) or ``two_level``,
        ranks in whole nodes of more than one rank on more than one node, and in launcher order (global rank = node x
        ranks per node + local rank, each node on one host). Otherwise two-level stays off; when it was asked for
        (``two_level``) or the order is not the launcher's, rank 0 says why, once. Every input is the same on every
        rank (the agreement's rows), so every rank takes the same branch."""
        force = cost.force
        if cost.topology is None or not self.settings.flags.reduce_to_owner or force not in (AUTO, TWO_LEVEL):
            return cost
        if cost.calibration is not None and force != TWO_LEVEL:
            # Not a candidate (``FlushCost``: a calibration times the data-parallel communicator only): no
            # communicator that no flush can use (their creations, their device memory).
            if self.comm.rank == 0:
                emit(f"owner_reduce: the two-level flush is not a candidate under {key_name(CALIBRATION)} (a "
                     f"calibration times the data-parallel communicator only; {key_name(ALGO)} \"two_level\" forces "
                     f"it): no node or rail communicator made")
            return cost
        per_node = cost.topology.gpus_per_node
        levels = two_level_of(cost.topology, per_node)
        if levels is None:
            why = (f"{self.comm.world_size} ranks in nodes of {per_node} are not two or more whole nodes of two or "
                   f"more ranks")
        else:
            why = _order_problem(levels, facts)
        if why is not None:
            from deepspeed.utils import logger

            if force == TWO_LEVEL and self.comm.rank == 0:
                logger.warning(f"owner_reduce: {key_name(ALGO)} \"two_level\" cannot take effect: {why}; each flush "
                               f"takes the cost model's choice among the other algorithms")
            elif levels is not None and self.comm.rank == 0:
                logger.warning(f"owner_reduce: the two-level flush is off: {why}")
            return cost
        started = time.monotonic()
        before = _nccl_memory_mark()
        node = self.comm.split(levels.node_groups(), NODE)  # a failure later in init closes it (_close_levels)
        rail = self.comm.split(levels.rail_groups(), RAIL)
        handoff = self.comm.split(levels.node_groups(), NODE_HANDOFF_ROLE)  # two_level Note (balanced rails)
        self._levels = Levels(node, rail, handoff)
        node.warm_up(KINDS_BY_COMM[NODE], bucket_size)  # their connections and memory now: the figure below holds them
        rail.warm_up(KINDS_BY_COMM[RAIL], bucket_size)
        seconds = time.monotonic() - started
        used = _nccl_memory_since(before)
        memory = "" if used is None else f", {used / 2**20:.0f} MiB of device memory"  # None: no CUDA device
        if not double_buffer:
            buffering = "flushes run in turn on 1 bucket per dtype (double_buffer false)"
        elif before is None:  # no CUDA streams (gloo on CPU): nothing overlaps
            buffering = "flushes run in turn over 2 buckets per dtype (double_buffer true; no CUDA streams here)"
        else:
            buffering = "flushes may overlap over 2 buckets per dtype (double_buffer true)"
        # Under 30 words for rank 0's INFO line; which communicators of what size, and the overlap, at DEBUG.
        line = (f"owner_reduce: two-level flush ready: {levels.nodes} nodes x {per_node} ranks ({self.comm.name}), "
                f"made in {seconds:.2f} s{memory}; {buffering}")
        detail = (f"owner_reduce: two-level flush: {levels.nodes} node communicators of {per_node} ranks, {per_node} "
                  f"rail communicators of {levels.nodes} ranks and {levels.nodes} node hand-off communicators of "
                  f"{per_node} ranks (balanced rails); with double_buffer true the node stage of one flush runs under "
                  f"the rail stage of the one before")
        self.stats.two_level_line = line
        if self.comm.rank == 0:
            emit(line)
            emit_detail(detail)
        return replace(cost, two_level=levels)

    def _with_stall_report(self, deadline: deadlines.Deadline) -> deadlines.Deadline:
        """The flushes' deadline with this runtime's stall reporter (``stall_report``) where torch's default store
        exists: the ranks and hosts of the agreement, this rank's node and rail communicators' members by role."""
        store = stall_report.default_store()
        if store is None:
            return deadline
        levels = self.flusher.levels
        members = {} if levels is None else {sub.role: sub.members for sub in levels if sub is not None}
        self.stall_reporter = stall_report.StallReporter(store, self._stall_keys, self.comm.rank, self.global_ranks,
                                                         self.hosts, members)
        return replace(deadline, stall=self.stall_reporter)

    def _close_levels(self) -> None:
        """Close the node and rail communicators (the data-parallel one stays)."""
        self._levels = None
        if self.comm is not None:
            self.comm.close_subs()


def _order_problem(levels: TwoLevel, facts: list[tuple[int, int]]) -> str | None:
    """Why the ranks are not in launcher order for ``levels`` given every rank's (local rank, host digest), or None."""
    per_node = levels.ranks_per_node
    wrong = [r for r, (local, _) in enumerate(facts) if local != r % per_node]
    if wrong:
        shown = ", ".join(f"rank {r} has local rank {facts[r][0]}" for r in wrong[:4])
        return (f"ranks are not in launcher order (rank = node x {per_node} + local rank): {shown}"
                + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""))
    split = [m for m, members in enumerate(levels.node_groups()) if len({facts[r][1] for r in members}) > 1]
    if split:
        return (f"the ranks of node {split[0]} ({', '.join(map(str, levels.node_groups()[split[0]]))}) run on "
                f"different hosts")
    return None


def _backend_of(process_group: Any) -> str | None:
    """The backend of the data-parallel group (``gloo``, ``nccl``), or None where torch.distributed has none."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return str(dist.get_backend(process_group))
    except (RuntimeError, ValueError):
        return None


def _nccl_memory_mark() -> tuple[int, int] | None:
    """(the current CUDA device's free memory, what torch's caching allocator has reserved), or None without CUDA: what
    ``_nccl_memory_since`` counts from. No device synchronization: ``ncclCommInitRank`` and a connection setup allocate
    before they return, and a wait on the device here would be the one wait of init without the deadline."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0]), int(torch.cuda.memory_reserved())

def _nccl_memory_since(before: tuple[int, int] | None) -> int | None:
    """The device memory taken since ``before`` outside torch's caching allocator: NCCL's communicators and their
    connections (the warm-up's buffer, reserved by torch and kept for the buckets, is not theirs)."""
    after = _nccl_memory_mark()
    if before is None or after is None:
        return None
    return max(0, (before[0] - after[0]) - (after[1] - before[1]))


def _verdict_state(state: int) -> str:
    """An agreement row's ``compile.reduce_to_owner_verdicts``: unset, a file to write, or the digest of the file
    replayed."""
    return "unset" if state == 0 else "a file to write" if state == -1 else f"verdicts {state:012x}"
