"""How NCCL 2.30 turns one group of collectives into kernels, works and channels: the published check's cause (b).

Why: the cost model charges a group as NCCL's tuner costs it (``collective_time.group_time_us``): each aggregate's
latency times ``numPipeOps = DIVUP(tasks, channels)`` plus its bytes at the aggregate's bandwidth, i.e. the tasks
spread evenly over the channels. The only published grouped measurement (8x A800, ~293 calls in one group) is
missed by half (``published_check``), so this module follows what NCCL's planner then does with the tasks,
to cost that candidate cause from the source rather than from a constant. Not used by the flush choice.

What it follows, all at NVIDIA/nccl v2.30.7-1:

- ``ncclPrepareTasks`` (src/enqueue.cc 363-470): the tasks of each function in ascending size (``collective_time``'s
  ``aggregates``), the functions in the order their largest task leaves the sorter, each aggregate's algorithm and
  protocol from the tuner with ``nTasksPerChannel = DIVUP(nTasksColl, nChannels)`` (enqueue.cc 430), and LL's
  traffic counted 4x (enqueue.cc 461);
- ``scheduleCollTasksToPlan`` (enqueue.cc 576-858): the tasks of one plan share a traffic budget per channel
  (``trafficPerChannel``: the plan's traffic, each task at least ``MinTrafficPerChannel`` 32 KiB, over its channels),
  and are laid on the channels in queue order by "continuous byte distribution": a task fills the current channel's
  remaining budget in cells (32 KiB of traffic each), then whole channels, then starts the next one; so every
  channel runs its own tasks one after another, and a run of small tasks shares one channel;
- the plan's budget (``ncclTestBudget``, enqueue.cc 294-300; ``ncclLaunchPrepare``, 1605-1611): 4,096 bytes of kernel
  arguments (``ncclMaxKernelArgsSize``, src/include/device.h 483-486) less the 32-byte header hold the work batches
  (16 bytes each), the works (128 bytes each, ``ncclDevWorkColl``) go to the FIFO, half of its 1 MiB per plan
  (init.cc 394-395); a batch holds up to 8 works of one function on one channel (``NCCL_MAX_DEV_WORK_BATCH_BYTES``
  1,024, device.h 389, ``ncclAddWorkBatchToPlan`` enqueue.cc 121-201); a plan that cannot take a task's batches ends
  and the next plan (another kernel launch) begins.

The channel-serial time (``channel_time_us``): each channel runs its works in order, each paying its algorithm's and
protocol's latency from NCCL's table (a work is a whole ring pass on its channel) and its bytes on that channel at the
table's bandwidth shared by the communicator's channels; the group ends with its slowest channel. Where NCCL's tuner
assumes its tasks spread evenly, this charges where they land. Pure: numbers in, microseconds out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from owner_reduce.planning.collective_time import (
    ALLREDUCE,
    KINDS,
    LL,
    PROTOCOLS,
    REDUCE,
    Topology,
    best_algo,
    sorter_bin,
    table,
    traffic_bytes,
)

MIN_TRAFFIC_PER_CHANNEL = 32 << 10  # enqueue.cc 585
WORK_BYTES = 128  # sizeof(ncclDevWorkColl), src/include/device.h 284-316
BATCH_BYTES = 16  # sizeof(ncclDevWorkBatch), device.h 392-406
ARGS_BYTES = (4 << 10) - 32  # ncclMaxKernelArgsSize less sizeof(ncclDevKernelArgs): the batches' room
FIFO_PLAN_BYTES = (1 << 20) // 2  # NCCL_WORK_FIFO_BYTES_DEFAULT / 2 per non-persistent plan
WORKS_PER_BATCH = 1024 // WORK_BYTES  # NCCL_MAX_DEV_WORK_BATCH_BYTES / sizeof(ncclDevWorkColl)


@dataclass(frozen=True)
class Task:
    """One call of the group as the planner holds it: its function, bytes (a ReduceScatter's whole input), the
    aggregate it was costed in, that aggregate's algorithm and protocol, and its traffic (LL counted 4x)."""

    kind: str
    nbytes: int
    aggregate: int
    algorithm: str
    protocol: str
    traffic: int


@dataclass(frozen=True)
class Work:
    """A task's part on one channel: the task and its bytes there."""

    task: int
    nbytes: int


@dataclass(frozen=True)
class GroupPlan:
    """A group as NCCL 2.30 plans it: its tasks in queue order, each channel's works in order, the kernel launches
    (plans) and the work batches."""

    tasks: tuple[Task, ...]
    channels: tuple[tuple[Work, ...], ...]
    plans: int
    batches: int

    @property
    def works(self) -> int:
        return sum(len(c) for c in self.channels)

    @property
    def busiest(self) -> int:
        """The most works one channel runs."""
        return max((len(c) for c in self.channels), default=0)


def plan_group(calls: Iterable[tuple[str, int]], topo: Topology) -> GroupPlan:
    """``calls`` ((kind, bytes), in issue order) planned as NCCL 2.30 plans one group (see the module docstring):
    AllReduces and Reduces (the published case's calls; a ReduceScatter's cells count per rank, not followed here)."""
    listed = [(kind, nbytes, i) for i, (kind, nbytes) in enumerate(calls) if nbytes > 0]
    if any(kind not in (ALLREDUCE, REDUCE) for kind, _, _ in listed):
        raise ValueError("owner_reduce: plan_group follows AllReduce and Reduce groups only")
    if not listed:
        return GroupPlan((), (), 0, 0)
    nc = topo.n_comm_channels
    per_channel = -(-len(listed) // nc)
    keyed = sorted(listed, key=lambda t: (sorter_bin(traffic_bytes(t[0], t[1])), -t[2]))
    first_out = {}
    for kind, _, _ in reversed(keyed):  # the sorter's dequeue order: the largest first
        first_out.setdefault(kind, len(first_out))
    tasks: list[Task] = []
    aggregate = 0
    for kind in sorted({k for k, _, _ in listed}, key=first_out.__getitem__):
        ascending = [t for t in keyed if t[0] == kind]
        i = 0
        while i < len(ascending):
            first = traffic_bytes(kind, ascending[i][1])
            j = i
            while j < len(ascending) and (j == i or traffic_bytes(kind, ascending[j][1]) < 4 * first):
                j += 1
            _, algo, proto = best_algo(kind, sum(t[1] for t in ascending[i:j]), topo, per_channel, physical=False)
            for kind_, nbytes, _ in ascending[i:j]:
                traffic = traffic_bytes(kind_, nbytes) * (4 if proto == PROTOCOLS[LL] else 1)
                tasks.append(Task(kind_, nbytes, aggregate, algo, proto, traffic))
            aggregate += 1
            i = j
    return _schedule(tasks, nc)


def _schedule(tasks: Sequence[Task], nc: int) -> GroupPlan:
    """``scheduleCollTasksToPlan``'s continuous byte distribution, plan after plan (one kind: no CollNet, and NVLS
    is not modelled here)."""
    channels: list[list[Work]] = [[] for _ in range(nc)]
    plans = batches = 0
    start = 0
    while start < len(tasks):
        plans += 1
        plan_batches, plan_bytes = 0, 0
        runs = [(-1, None, 0)] * nc  # per channel: (aggregate of its open batch, its function, works in it)
        total = sum(max(MIN_TRAFFIC_PER_CHANNEL, t.traffic) for t in tasks[start:])
        per_channel = -(-(total // nc) // 16) * 16
        channel, current = 0, 0
        index = start
        while index < len(tasks):
            task = tasks[index]
            spans, after, used = _place(task, per_channel, channel, current, nc)
            new = sum(1 for c, _ in spans if runs[c][0] != task.aggregate or runs[c][2] == WORKS_PER_BATCH)
            if plan_batches + len(spans) > ARGS_BYTES // BATCH_BYTES or plan_bytes + WORK_BYTES > FIFO_PLAN_BYTES:
                break
            for c, nbytes in spans:
                channels[c].append(Work(index, nbytes))
                if runs[c][0] != task.aggregate or runs[c][2] == WORKS_PER_BATCH:
                    runs[c] = (task.aggregate, task.kind, 1)
                else:
                    runs[c] = (task.aggregate, task.kind, runs[c][2] + 1)
            plan_batches += new
            plan_bytes += WORK_BYTES
            channel, current = after, used
            index += 1
        batches += plan_batches
        start = index
    return GroupPlan(tuple(tasks), tuple(tuple(c) for c in channels), plans, batches)


def _cells(task: Task) -> tuple[int, int]:
    """(cell bytes, traffic per byte) of a task (enqueue.cc 655-660)."""
    per_byte = (2 if task.kind == ALLREDUCE else 1) * (4 if task.protocol == PROTOCOLS[LL] else 1)
    return _div_up(_div_up(MIN_TRAFFIC_PER_CHANNEL, per_byte), 16) * 16, per_byte


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _place(task: Task, per_channel: int, channel: int, current: int, nc: int
           ) -> tuple[list[tuple[int, int]], int, int]:
    """``task``'s parts as (channel, bytes), and the channel and its used traffic after it: enqueue.cc 659-755 line
    by line (the current channel's remaining budget, then whole channels, then the rest on the next; the last channel
    takes whatever is left)."""
    cell, per_byte = _cells(task)
    cells = -(-task.nbytes // cell)
    cell_traffic = cell * per_byte
    per = min(cells, -(-per_channel // cell_traffic))
    room = per_channel - current
    lo = cells if channel + 1 == nc or room < 0 else min(cells, -(-room // cell_traffic))  # size_t: no negative room
    mid, hi = (cells - lo) // per, (cells - lo) % per
    if nc < channel + (1 if lo else 0) + mid + (1 if hi else 0):
        mid = nc - channel - 2
        per = (cells - lo) // (mid + 1)
        hi = per + (cells - lo) % (mid + 1)
    if hi == 0 and mid:
        hi, mid = per, mid - 1
    if lo == 0:
        channel += 1
        if mid == 0:
            lo, hi = hi, 0
        else:
            lo, mid = per, mid - 1
    parts = ([lo] if lo else []) + [per] * mid + ([hi] if hi else [])
    sizes = [n * cell for n in parts]
    sizes[-1] -= cells * cell - task.nbytes
    spans = [(channel + k, nbytes) for k, nbytes in enumerate(sizes)]
    if hi:
        channel, current = channel + len(parts) - 1, hi * cell_traffic
    elif mid:
        channel, current = channel + len(parts), 0
    else:
        current += lo * cell_traffic
    if current >= per_channel and channel + 1 != nc:
        channel, current = channel + 1, 0
    return spans, channel, current


def channel_time_us(plan: GroupPlan, topo: Topology, per_work_us: float = 0.0) -> float:
    """The group's end when every channel runs its works one after another, each a whole pass of its algorithm and
    protocol (NCCL's table latency, plus ``per_work_us``) plus its bytes there at the table's bandwidth over the
    communicator's channels."""
    nc = topo.n_comm_channels
    tables = {kind: table(kind, topo) for kind in KINDS}
    worst = 0.0
    for works in plan.channels:
        t = 0.0
        for w in works:
            task = plan.tasks[w.task]
            lat, bw = tables[task.kind][(task.algorithm, PROTOCOLS.index(task.protocol))]
            t += lat + per_work_us + w.nbytes / (1000.0 * bw / nc)
        worst = max(worst, t)
    return worst


__all__ = ["GroupPlan", "Task", "Work", "channel_time_us", "plan_group"]
