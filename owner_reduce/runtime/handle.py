"""The DeepCompile handle for ZeRO stages 1 and 2: the object ``get_deepcompile_handle()`` returns, in Python.

Why Python: DeepCompile reaches its extension only through ``get_deepcompile_handle()``; an object with the same
methods there drives the whole stage-1/2 reduce path, so the owner path needs no C++/CUDA build. This module is
that interface and nothing more: it checks, counts and hands each call to the layer that does the work, one way:
``reduce_grad`` -> ``accumulate`` (stage 1, between micro-steps) -> ``placement`` (which bucket, which offset, when
it is complete) -> ``flush`` (the plan, the collectives, the copy-out). Semantics follow ``z1.cpp`` / ``z2.cpp`` /
``deepcompile.h``; nothing communicates while DeepCompile profiles.

At ``init`` the ranks agree, in one all_gather, on everything the flushes depend on (``agreement``): the settings (the
config's ``compile`` keys, ``planning.settings``, and the files they name, the flushes' deadline among them), bucket
size, owner map, and the facts of the topology that the cost model uses to choose each flush's algorithm (ranks per
node, GPU generation). The node and rail communicators are made there where a two-level flush can run (``levels``).
Rank 0 then logs the init line and the settings line. The measured guard and the state a checkpoint keeps are
``guard``'s; the schedule lines ``schedule_lines``'.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from ..errors import OwnerReduceMismatchError
from ..planning.collectives import WORLD
from ..planning.connections import KINDS_BY_COMM, NATIVE_KINDS
from ..planning.flags import REDUCE_PROBE
from ..planning.flush_choice import AUTO, FlushCost
from ..planning.monitor import due, monitor_events
from ..planning.nodes import NodeLayout
from ..planning.owner_map import OwnerMap, Placement
from ..planning.rank_inputs import RankInputs
from ..planning.settings import OwnerReduceSettings, key_name
from ..planning.two_level import two_level_of
from . import deadline as deadlines
from . import stall_report
from .accumulate import Accumulator
from .agreement import agree
from .buckets import DoubleBufferedBuckets
from .comm import ReduceComm
from .deadline import add_note
from .exposure import ExposureProbe, OwnerPathModel
from .flush import Flusher, Levels, Param
from .guard import MeasuredGuard
from .levels import close_levels, connect_handoffs, make_levels
from .monitor import FlushHooks, MonitorSink, MonitorStep
from .placement import GradPlacer
from .run_setup import settings_line_of
from .schedule import Schedule
from .schedule_lines import GraphNumbers, schedule_line
from .stats import FlushRecord, RuntimeStats, emit, emit_detail, say_if_hidden
from .trial_clock import StreamClock, TrialClock

__all__ = ["FlushRecord", "OwnerReduceMismatchError", "OwnerReduceRuntime", "RuntimeStats", "emit"]


class OwnerReduceRuntime:
    """The DeepCompile handle for ZeRO stages 1 (z1.cpp) and 2 (z2.cpp): ``init`` ... ``cleanup``.

    ``settings``: the config's ``compile`` keys (``planning.settings``), the one object that comes from the config.
    Beside them, what is not configuration: the owner map (``planning.owner_map``, from the engine's optimizer), where
    this rank's optimizer contradicts it (``map_problems``: should be empty), and what this rank read of the files the
    settings name and the problems it found there (``inputs``, ``planning.rank_inputs``): all refused at init on every
    rank together, by the agreement."""

    def __init__(self, settings: OwnerReduceSettings, owner_map: OwnerMap, comm_factory: Any, *,
                 inputs: RankInputs | None = None, map_problems: tuple[str, ...] = ()) -> None:
        self.settings = settings
        self.owner_map = owner_map
        self.inputs = inputs = inputs if inputs is not None else RankInputs()
        self.map_problems = tuple(map_problems)
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
        self._record_collectives = False  # handed to the flusher at init; tests may set it before
        self.placer: GradPlacer | None = None  # made at init (needs the bucket size and the agreed cost model)
        self._exposure: ExposureProbe | None = None  # the probe's step summary, until its lines are out (``exposure``)
        self._graph_numbers = GraphNumbers()  # graph ids in the schedule lines (``schedule_lines``)
        self._update = False
        self._profiling = False
        # The measured guard, with every verdict decided, replayed or restored so far (``guard``): saved with each
        # checkpoint.
        self._guard = MeasuredGuard(self.stats, inputs.verdicts, inputs.verdicts_path, self._graph_numbers.get)
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
        return self._record_collectives

    @record_collectives.setter
    def record_collectives(self, value: bool) -> None:
        self._record_collectives = bool(value)
        if self.flusher is not None:
            self.flusher.record_collectives = self._record_collectives

    @property
    def collective_log(self) -> list[tuple[str, int | None, int, str]]:
        return self.flusher.collective_log if self.flusher is not None else []

    @property
    def flush_log(self) -> list[FlushRecord]:
        return self.flusher.flush_log if self.flusher is not None else []

    @property
    def plans_computed(self) -> int:
        return self.flusher.plans_computed if self.flusher is not None else 0

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
        settings = self.settings
        owner_path = settings.flags.reduce_to_owner
        bucket_size = int(reduce_bucket_size)
        double_buffer = bool(compile_config.double_buffer)
        group_timeout_s = deadlines.default_group_timeout_s()
        flush_deadline = deadlines.resolve(settings.timeout_s, group_timeout_s)
        init_deadline = deadlines.for_init(flush_deadline, group_timeout_s, time.monotonic())
        with deadlines.init_window(init_deadline):
            self.comm = self._comm_factory(process_group)
            try:
                agreed = agree(self.comm, settings, self.owner_map, self.inputs, self.map_problems, bucket_size,
                               self.monitor.every if self.monitor is not None else 0)
                self.hosts, self.global_ranks = list(agreed.hosts), agreed.global_ranks
                self.node_layout, self._stall_keys = agreed.node_layout, agreed.stall_keys
                cost = FlushCost(agreed.topology, force=settings.flush_algo, calibration=self.inputs.calibration)
                # ``comm`` Note (lazy connections): every kind a flush may issue, connected here, not in a flush.
                self.comm.warm_up(KINDS_BY_COMM[WORLD] if owner_path else NATIVE_KINDS, bucket_size)
                cost, self._levels = make_levels(self.comm, cost, agreed.local_facts, owner_path=owner_path,
                                                 double_buffer=double_buffer, bucket_size=bucket_size,
                                                 stats=self.stats)
                self.flusher = Flusher(self.owner_map, settings.flags, self._params, self.stats, self.comm, cost,
                                       self._levels)
                self.flusher.record_collectives = self._record_collectives
                if self._stage:
                    self.flusher.stage = self._stage
                flush_deadline = self._with_stall_report(flush_deadline)
                buckets = DoubleBufferedBuckets(bucket_size, double_buffer, self._bucket_limits)
                measuring = settings.measure and cost.force == AUTO and cost.topology is not None and owner_path
                self.placer = GradPlacer(self.owner_map, owner_path, buckets, self.flusher, self.stats, cost,
                                         self._sync_streams, self._learned,
                                         self._guard.trial_for if measuring else None)
                self.placer.clock = self._trial_clock
                self._guard.start(self.comm, self.placer, cost, measuring)
                if settings.flags.reduce_probe:
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
            self.stats.init_line = self.owner_map.init_line(sliced=owner_path)
            emit(self.stats.init_line, even_if_hidden=True)
            self.stats.settings_line = settings_line_of(self.comm, settings, self.inputs, self.node_layout,
                                                        flush_deadline, bucket_size, process_group)
            emit(self.stats.settings_line)
            if self.inputs.verdicts_path is not None:
                self._guard.say_unused(owner_path, settings.algo)
            if settings.flags.reduce_probe:
                say_if_hidden(f"{key_name(REDUCE_PROBE)}'s lines")

    def register_param(self, ds_id: int, ds_shape: Any, ds_tensor: torch.Tensor, grad_buffer: torch.Tensor,
                       offset: int) -> None:
        if ds_id not in self.owner_map:
            raise KeyError(f"owner_reduce: DeepCompile registered param {ds_id}, which the owner map lacks")
        self._params[ds_id] = Param(ds_tensor, self._checked_buffer(ds_id, grad_buffer, offset), int(offset))
        numel = 1
        for dim in ds_shape:
            numel *= int(dim)
        self._registered_elems[ds_id] = (ds_tensor.dtype, numel)
        self._elems_by_dtype = None
        self._forget_plans()

    def update_param_grad_buffer(self, ds_id: int, grad_buffer: torch.Tensor, offset: int) -> None:
        self._params[ds_id] = self._params[ds_id]._replace(grad_buffer=self._checked_buffer(ds_id, grad_buffer, offset),
                                                           offset=int(offset))
        self._forget_plans()

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
            self._guard.advance()
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
        if self.flusher is not None:
            self.flusher.stage = stage
        # A registration starts a graph: whatever was learned under its id belonged to another graph whose address
        # this one reuses (see Note (graph ids) in ``reset``), or to this one before DeepCompile compiled it again.
        self._graph_numbers.forget(graph_id)
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
        placement = self.owner_map.placement(ds_id)
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
        """Every rank, as a graph learns its schedule: the hand-offs' peers connected (``levels.connect_handoffs``).
        Rank 0, the first time a graph learns its schedule: its schedule line (``schedule_lines``), and its DEBUG
        line after it."""
        connect_handoffs(self.comm, self.flusher.levels, schedule)
        if self.comm is None or self.comm.rank != 0 or schedule.graph_id in self._graph_numbers:
            return
        number = self._graph_numbers.assign(schedule.graph_id)
        line, detail = schedule_line(number, schedule, self.flusher.cost, self.settings.algo,
                                     self._guard.plan(schedule))
        self.stats.schedule_lines.append(line)
        emit(line)
        if detail is not None:
            emit_detail(detail)

    # ---- the probe's step summary (``exposure``) -----------------------------------------------------------

    def _start_exposure(self, cost: FlushCost) -> None:
        """The probe's step summary from the first backward. Without the owner path its lines add the model's
        saving, costed with the two-level flush among the candidates where the ranks form nodes over a network (as
        the owner path would have it: ``levels.make_levels``), though no node or rail communicator exists in this
        run."""
        model = None
        if not self.settings.flags.reduce_to_owner:
            if cost.topology is not None and cost.calibration is None and cost.two_level is None:
                cost = replace(cost, two_level=two_level_of(cost.topology, cost.topology.gpus_per_node))
            model = OwnerPathModel(self.owner_map, cost).ratio
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

    # ---- the verdicts and checkpoints (``wiring.checkpoint``, ``guard``) ---------------------------------------

    def checkpoint_state(self) -> dict[str, Any] | None:
        """What ``engine.save_checkpoint`` keeps of the runtime: the verdicts, every schedule as learned and the trials
        under way (``guard.MeasuredGuard.checkpoint_state``); None before any schedule. Collective where a trial is
        under way."""
        return self._guard.checkpoint_state()

    def restore_checkpoint_state(self, data: Any, source: str = "the checkpoint") -> None:
        """``engine.load_checkpoint``: the checkpoint's verdicts, schedules and trials, for the runs that follow
        (``guard.MeasuredGuard.restore``). Collective: every rank calls it."""
        assert self.comm is not None and self.placer is not None, "owner_reduce runtime used before init()"
        self._guard.restore(data, source)

    def _forget_plans(self) -> None:
        """The flusher's cached plans, where init made one (registration and cleanup may come without it)."""
        if self.flusher is not None:
            self.flusher.forget_plans()

    def _forget_graphs(self) -> None:
        """Everything keyed by a graph id (see Note (graph ids) in ``reset``)."""
        self._graphs.clear()
        self._graph_numbers.clear()
        self._forget_plans()
        if self.placer is not None:
            self.placer.forget_schedules()

    def _release(self) -> None:
        """Drop every reference, close the communicator, hand the handle back (``on_cleanup``). ``comm.close()``
        waits within the deadline and may raise: the handle is handed back all the same, and that error is the one
        raised (see Note (cleanup always releases))."""
        comm, self.comm = self.comm, None
        self._guard.release()
        if self.stall_reporter is not None:
            self.stall_reporter.close()
        self._forget_graphs()
        self._accumulator.clear()
        self._params.clear()
        self._registered_elems.clear()
        self._elems_by_dtype = None
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

    # ---- the communicators' lifetime ---------------------------------------------------------------------

    def _with_stall_report(self, deadline: deadlines.Deadline) -> deadlines.Deadline:
        """The flushes' deadline with this runtime's stall reporter (``stall_report``) where torch's default store
        exists: the ranks and hosts of the agreement, this rank's node and rail communicators' members by role."""
        store = stall_report.default_store()
        if store is None:
            return deadline
        levels = self._levels
        members = {} if levels is None else {sub.role: sub.members for sub in levels if sub is not None}
        self.stall_reporter = stall_report.StallReporter(store, self._stall_keys, self.comm.rank, self.global_ranks,
                                                         self.hosts, members)
        return replace(deadline, stall=self.stall_reporter)

    def _close_levels(self) -> None:
        """Close the node and rail communicators (the data-parallel one stays)."""
        self._levels = None
        close_levels(self.comm)

