"""What a call costs the host: the time to issue a flush's calls, before NCCL launches their kernels.

Why: NCCL launches a group's kernels only at ``ncclGroupEnd``, after every call of the group has been enqueued
(src/group.cc 598-760 ``groupLaunch``: ``ncclPrepareTasks`` for every task, then ``doLaunches``; NVIDIA/nccl
v2.30.7-1), so a group's device work cannot start before the host has issued all of it. Each call costs the host
twice: the caller's own issue (the owner runtime's Python: a view of the bucket, the communicator's checks and its
cupy call; native DeepCompile's C++ loop, z1.cpp 57-68 / z2.cpp 50-61) and NCCL's enqueue (``ncclEnqueueCheck`` ->
``taskAppend`` -> ``collTaskAppend``, src/enqueue.cc 3124-3172, 3014-3122, 2690-2752: argument checks, a task from a
memory pool, the size sorter). Each group costs the caller's group bracket and NCCL's group end (``ncclPrepareTasks``'
aggregation and algorithm choice, ``scheduleCollTasksToPlan``, the work upload, ``cuLaunchKernelEx``: enqueue.cc
363-470, 576-858, 1248-1370, 1753-1851). The cost model charges them where the host is on the critical path
(``step_plan``): a flush's device work starts at the later of its stream being free and its own issue being done,
so a flush alone pays issue + device time and a flush queued behind a long one hides its issue under it.

The constants and their sources (``DEFAULT``):

- the owner runtime, per call 2.5 us, per group 3.9 us, per two-level stage 0 us beyond its groups and calls:
  measured by ``scripts/benchmark_runtime.py`` (its issue-time fit: the flush's issue path of that day, which made
  each call's view per flush; ``runtime.executor`` now binds them once per plan; on the runtime's cupy communicator
  with NCCL's calls replaced by no-ops, groups of 1, 2, 4,
  8 and 16 calls and flushes of 1-16 stages, 2,000 interleaved rounds, least squares: 2.46 us per call, 3.91 us per
  group, a stage 11.14 us for its two groups and two calls, i.e. nothing beyond them; 2026-12-03, this package's
  2-core CPU host at load average 5.6). It is the Python part only, on a CPU, without CUDA's stream and event calls:
  a lower bound for a GPU host, whose cupy calls also enter NCCL;
- NCCL's enqueue per call and its group end per group: 0 us. The source lines above say what runs, not how long it
  takes, and no published measurement isolates either (NVIDIA/nccl issue 725 reports 980 grouped ReduceScatters
  about 72x slower than one concatenated call, host and device together, in units it does not give). No number, so
  none is charged: the lower bound; ``scripts/calibrate.py`` measures a cluster's per-call and per-group cost through
  the runtime's own communicator, NCCL included (``planning.calibration``);
- native DeepCompile's own loop per gradient: 0 us. The loop's body is two accessor calls around ``ncclAllReduce``
  (z1.cpp 58-67), nothing a microsecond resolves; its NCCL enqueue is the item above.

So by default native's flushes cost the host nothing and the owner runtime's cost its Python: the model charges the
owner path, never native, for what is not measured (as it assumes NVLS for native: ``flush_choice.agreed_topology``).
Identical on every rank: constants, or a calibration the ranks agreed on by digest. Pure: numbers in, microseconds
out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostCost:
    """Host microseconds per call, per group and per two-level stage, split by who spends them (the module's
    docstring gives each default's source). ``source``: where the numbers come from, for the log and the sizing."""

    owner_call_us: float = 2.5  # the owner runtime's Python issue per call (scripts/benchmark_runtime.py)
    owner_group_us: float = 3.9  # its group bracket per group (same)
    owner_stage_us: float = 0.0  # a two-level stage beyond its groups and calls (same: none measured)
    nccl_call_us: float = 0.0  # NCCL's enqueue per call (ncclEnqueueCheck -> taskAppend): no number, lower bound
    nccl_group_us: float = 0.0  # NCCL's group end per group (planning, upload, kernel launch): no number, lower bound
    native_call_us: float = 0.0  # native DeepCompile's loop per gradient (z1.cpp 58-67): below resolution
    source: str = "defaults"

    def __post_init__(self) -> None:
        for name in ("owner_call_us", "owner_group_us", "owner_stage_us", "nccl_call_us", "nccl_group_us",
                     "native_call_us"):
            value = getattr(self, name)
            if not value >= 0.0 or value == float("inf"):
                raise ValueError(f"owner_reduce: host cost {name} must be a finite number >= 0, got {value!r}")

    @property
    def call_us(self) -> float:
        """One call issued by the owner runtime: its Python and NCCL's enqueue."""
        return self.owner_call_us + self.nccl_call_us

    @property
    def group_us(self) -> float:
        """One group issued by the owner runtime: its bracket and NCCL's group end (the launch)."""
        return self.owner_group_us + self.nccl_group_us

    def issue_us(self, calls: int, groups: int = 1, stages: int = 0) -> float:
        """Host time for the owner runtime to issue ``calls`` calls in ``groups`` groups (and ``stages`` two-level
        stages); nothing for no calls."""
        if calls <= 0:
            return 0.0
        return calls * self.call_us + groups * self.group_us + stages * self.owner_stage_us

    def native_issue_us(self, calls: int) -> float:
        """Host time for native DeepCompile to issue ``calls`` AllReduces in its one group per flush."""
        if calls <= 0:
            return 0.0
        return calls * (self.native_call_us + self.nccl_call_us) + self.nccl_group_us

    def describe(self) -> str:
        """One line for logs and reports."""
        return (f"host cost ({self.source}): owner runtime {self.call_us:g} us per call, {self.group_us:g} us per "
                f"group, {self.owner_stage_us:g} us per two-level stage; native "
                f"{self.native_call_us + self.nccl_call_us:g} us per call, {self.nccl_group_us:g} us per group")


DEFAULT = HostCost()
NONE = HostCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, source="none")  # the model without host cost (the negative controls)
