"""Benchmark of the Python runtime on CPU: host cost per reduce_grad and per flush, memory per step, step time.

Prints, from one run, every measure with its repeats interleaved (so load swings hit all sides alike):
- host time of ``owner_reduce::reduce_grad`` through the op with the real runtime behind it (copy into the
  bucket, no flush), of an empty op of the same kind as ours (``torch.library.Library`` DEF + impl), and of an
  empty ``torch.library.custom_op`` (the custom_op floor), medians;
- host time of one flush (plan, pre-division, collectives of a no-op communicator, copy-out) at 148 and 1000
  gradients, ws 4, rank 0, the runtime driven in-process as DeepCompile drives it;
- bytes the runtime allocates per steady-state step (a dispatch mode counts every new tensor storage), with
  gradient accumulation 1 and 2, with the buckets kept and with ``release_reduce_buckets`` (the native runtime
  then frees its buckets too; the CUDA caching allocator serves them again, the CPU allocator does not);
- host time of one group of the cupy NCCL communicator (``CupyNcclComm``: its guard, calls and in-flight event) on
  no-op NCCL calls and CPU buffers, as a flush issues it (4 Reduces), 32 groups per step then the step's wait;
- the runtime's issue time fitted per call, per group and per two-level stage (``_host_issue_fit``: the flush's own
  issue path on that communicator, groups of 1, 2, 4, 8, 16 calls and flushes of as many stages, interleaved), the
  numbers ``planning/host_cost.py``'s defaults quote;
- median step time of DeepCompile + owner_reduce (AllReduce path and owner path) vs plain ZeRO-1 on
  --world-size gloo ranks, runs interleaved over --repeats rounds, as ratios.
CPU numbers say what the Python runtime costs on the host; collective speed here is gloo's, not NCCL's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: owner_reduce, harness/, research/


def _empty_ops() -> tuple[Any, Any]:
    """An empty op of each kind with reduce_grad's schema: Library DEF + impl, and custom_op."""
    import torch

    lib = torch.library.Library("owner_reduce_bench", "DEF")
    lib.define("empty_def(Tensor grad, int graph_id, int ds_id) -> Tensor")
    lib.impl("empty_def", lambda grad, graph_id, ds_id: grad.new_empty(0), "CompositeExplicitAutograd")

    def empty_custom(grad, graph_id, ds_id):  # noqa: ANN001, ANN202 - typed by the schema below
        return grad.new_empty(0)

    torch.library.custom_op("owner_reduce_bench::empty_custom", empty_custom, mutates_args=(),
                            schema="(Tensor grad, int graph_id, int ds_id) -> Tensor")

    _empty_ops.lib = lib  # keep the library alive
    return torch.ops.owner_reduce_bench.empty_def.default, torch.ops.owner_reduce_bench.empty_custom.default


def _numels(n_params: int, base: int) -> tuple[int, ...]:
    """Gradient sizes that vary (base/2 .. 3*base/2), so partitions cut through some gradients."""
    return tuple(base // 2 + (i * 7 % 5) * base // 4 for i in range(n_params))


def _tables(numels: tuple[int, ...], world_size: int) -> Any:
    """ZeRO-1-like partition tables: the gradients laid out flat, split in ws equal partitions."""
    from owner_reduce.planning.owner_map import GroupTables

    part = -(-sum(numels) // world_size)
    partition_ids: dict[int, tuple[int, ...]] = {}
    starts: dict[int, dict[int, int]] = {p: {} for p in range(world_size)}
    lo = 0
    for pid, numel in enumerate(numels):
        hi = lo + numel
        parts = tuple(p for p in range(world_size) if p * part < hi and lo < (p + 1) * part)
        partition_ids[pid] = parts
        for p in parts:
            starts[p][pid] = max(lo, p * part) - lo
        lo = hi
    return GroupTables(group=0, param_ids=tuple(range(len(numels))), numels=numels, partition_count=world_size,
                       partition_ids=partition_ids, start_offsets=starts, same_comm_as_dp=True)


def _null_comm(rank: int, world_size: int) -> Any:
    from owner_reduce.runtime.comm import ReduceComm

    class NullComm(ReduceComm):
        """Collectives that do nothing: what is left of a flush is its host cost."""

        name = "null"

        def reduce(self, *args: Any, **kwargs: Any) -> None:
            pass

        def all_reduce(self, *args: Any, **kwargs: Any) -> None:
            pass

        def all_gather_ints(self, values: list[int]) -> list[list[int]]:
            return [list(values)] * self.world_size

    return NullComm(rank, world_size)


class _Rig:
    """Rank 0 of ``world_size``: an OwnerReduceRuntime driven in-process as DeepCompile drives it."""

    GRAPH = 7

    def __init__(self, n_params: int, numel: int = 64, world_size: int = 4, bucket: int = 500_000_000) -> None:
        import torch

        from owner_reduce.planning.flags import OwnerReduceFlags
        from owner_reduce.planning.owner_map import OwnerMap
        from owner_reduce.planning.settings import MODEL, OwnerReduceSettings
        from owner_reduce.runtime.handle import OwnerReduceRuntime

        numels = _numels(n_params, numel)
        tables = _tables(numels, world_size)
        owner_map = OwnerMap.from_group_tables([tables], world_size)
        comm = _null_comm(0, world_size)
        # The steady state: after the measured guard's trial the hot path is the one without it (nothing timed).
        self.rt = OwnerReduceRuntime(OwnerReduceSettings(OwnerReduceFlags(True, False), algo=MODEL), owner_map,
                                     lambda group: comm)
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0's init line
            self.rt.init(None, types.SimpleNamespace(double_buffer=True), bucket)
        part, lo = -(-sum(numels) // world_size), 0
        for pid, n in enumerate(numels):
            kept_lo, kept_hi = lo, min(lo + n, part)  # rank 0 keeps partition 0
            buf = torch.zeros(kept_hi - kept_lo) if kept_lo < kept_hi else torch.empty(0)
            self.rt.register_param(pid, (n,), torch.zeros(n), buf, 0)
            lo += n
        self.rt.register_graph_z1(self.GRAPH, list(range(n_params)))
        # Matrices and vectors alternate, as weights and biases do.
        self.grads = [torch.randn(n // 16, 16) if pid % 2 == 0 and n % 16 == 0 else torch.randn(n)
                      for pid, n in enumerate(numels)]
        self.grad_bytes = 4 * sum(numels)
        self.order = list(reversed(range(n_params)))  # backward order

    def micro_step(self, update: bool, release: bool, op: Any = None) -> None:
        rt = self.rt
        rt.start_backward(update)
        for pid in self.order:
            if op is None:
                rt.reduce_grad(self.grads[pid], self.GRAPH, pid)
            else:
                op(self.grads[pid], self.GRAPH, pid)
        rt.end_backward(self.GRAPH, release)

    def step(self, ga: int, release: bool) -> None:
        for i in range(ga):
            self.micro_step(i == ga - 1, release)


def _op_costs(rounds: int, calls: int) -> dict[str, float]:
    """Median µs per call: reduce_grad through the op (real runtime, no flush), empty Library op, empty custom_op."""
    import torch

    from owner_reduce.wiring import ops

    empty_def, empty_custom = _empty_ops()
    rig = _Rig(calls)
    ops.set_active_runtime(rig.rt)
    grads, graph = rig.grads, rig.GRAPH
    samples: dict[str, list[float]] = {"reduce_grad op": [], "empty Library op": [], "empty custom_op": []}
    clock = time.perf_counter_ns
    try:
        for _ in range(rounds):
            # One backward's reduce_grad calls (no flush inside: the bucket holds them all), then the empties.
            rig.rt.start_backward(True)
            for pid in rig.order:
                start = clock()
                ops.REDUCE_GRAD(grads[pid], graph, pid)
                samples["reduce_grad op"].append(clock() - start)
            rig.rt.end_backward(graph, False)
            for name, op in (("empty Library op", empty_def), ("empty custom_op", empty_custom)):
                for pid in rig.order:
                    start = clock()
                    op(grads[pid], graph, pid)
                    samples[name].append(clock() - start)
    finally:
        ops.set_active_runtime(None)
    del torch
    return {name: statistics.median(s) / 1e3 for name, s in samples.items()}


def _flush_costs(sizes: tuple[int, ...], rounds: int) -> dict[int, float]:
    """Median ms of one flush at each gradient count: the last gradient's reduce_grad plus end_backward.

    Why both: from a graph's second backward on, the owner-ordered schedule flushes a bucket as soon as its last
    gradient is placed (inside that reduce_grad); in arrival order the flush happens in end_backward.
    """
    rigs = {n: _Rig(n) for n in sizes}
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n, rig in rigs.items():
            rt = rig.rt
            rt.start_backward(True)
            *early, last = rig.order
            for pid in early:
                rt.reduce_grad(rig.grads[pid], rig.GRAPH, pid)
            start = time.perf_counter_ns()
            rt.reduce_grad(rig.grads[last], rig.GRAPH, last)
            rt.end_backward(rig.GRAPH, False)
            samples[n].append(time.perf_counter_ns() - start)
    return {n: statistics.median(s) / 1e6 for n, s in samples.items()}


def _comm_costs(rounds: int, calls: int) -> dict[str, float]:
    """Median µs per all_reduce of 64 floats on a one-rank gloo group: raw torch.distributed, deepspeed.comm,
    and the runtime's TorchDistComm inside a flush's group() (what the flush pays per collective)."""
    import deepspeed.comm as ds_dist
    import torch
    import torch.distributed as dist

    from harness.launch import free_port
    from owner_reduce.runtime.torch_comm import TorchDistComm

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    with contextlib.redirect_stdout(io.StringIO()):
        ds_dist.init_distributed(dist_backend="gloo", verbose=False)
    group = dist.new_group([0])
    comm = TorchDistComm(group)
    buf = torch.ones(64)
    samples: dict[str, list[float]] = {"torch.distributed": [], "deepspeed.comm": [], "TorchDistComm": []}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for _ in range(calls):
            start = clock()
            dist.all_reduce(buf, group=group)
            samples["torch.distributed"].append(clock() - start)
        for _ in range(calls):
            start = clock()
            ds_dist.all_reduce(buf, group=group)
            samples["deepspeed.comm"].append(clock() - start)
        with comm.group():
            for _ in range(calls):
                start = clock()
                comm.all_reduce(buf)
                samples["TorchDistComm"].append(clock() - start)
    dist.destroy_process_group()
    return {name: statistics.median(s) / 1e3 for name, s in samples.items()}


def _two_level_issue_costs(rounds: int, stage_counts: tuple[int, ...] = (1, 8, 32), rail_calls: int = 3
                           ) -> dict[int, tuple[float, float]]:
    """Median µs of host time per stage to issue a two-level flush (its program, ``planning.program``, bound to the
    bucket and run by ``runtime.executor.Executor``: the stage loop, its two groups and the views of the bucket each
    call reduces in) on no-op node and rail communicators and host streams, nodes of 8, ``rail_calls`` rail Reduces
    per stage: what the pipeline's stage count costs the host on top of NCCL's own per-call cost. Two variants,
    interleaved: the program bound once (what runs: the flusher keeps the views with the bucket), and bound afresh
    for every flush (what that saves)."""
    import torch

    from owner_reduce.planning.collectives import NODE, RAIL, REDUCE, REDUCE_SCATTER, Collective
    from owner_reduce.planning.program import LevelRanks, compile_program
    from owner_reduce.runtime.executor import Executor, Levels
    from owner_reduce.runtime.streams import HostStreams

    class NoOp:
        rank = 0

        @contextlib.contextmanager
        def group(self, flush: int | None = None) -> Any:
            yield

        def reduce(self, buf: Any, root: int) -> None:
            pass

        def reduce_scatter(self, buf: Any, per_rank: int) -> None:
            pass

    width, per_node = 1000, 8
    executor = Executor(NoOp(), Levels(NoOp(), NoOp()))
    streams = HostStreams()
    buffer = torch.zeros(max(stage_counts) * per_node * width)
    out = {}
    for stages in stage_counts:
        calls = []  # per stage the node ReduceScatter and the rail step's Reduces: no hand-off (by owner)
        for s in range(stages):
            calls.append(Collective(REDUCE_SCATTER, s * per_node * width, per_node * width, per_rank=width, comm=NODE,
                                    stage=s))
            calls += [Collective(REDUCE, s * per_node * width + 10 * i, 10, root=i, comm=RAIL, rail=0, stage=s)
                      for i in range(rail_calls)]
        program = compile_program(calls, (), 0, span=buffer.numel(), levels=LevelRanks(0, per_node))
        bound = executor.bind(program, buffer)
        samples: dict[bool, list[int]] = {True: [], False: []}
        for _ in range(rounds):
            for kept in (True, False):
                start = time.perf_counter_ns()
                executor.run(program, bound if kept else executor.bind(program, buffer), streams, 1)
                samples[kept].append(time.perf_counter_ns() - start)
        out[stages] = tuple(statistics.median(samples[kept]) / 1e3 / stages for kept in (True, False))
    return out


def _noop_cupy_comm(world_size: int = 4, package: str = "owner_reduce") -> Any:
    """The runtime's cupy NCCL communicator (``CupyNcclComm``) with NCCL's calls and CUDA's events replaced by no-ops
    (the seam the unit tests use: torch's current stream, buffers' DLPack views made on registration): what is left of
    a call or a group is the communicator's own host cost (its guard, the calls' issue path, the event recorded after
    the group and, with the flush watchdog, the thread that polls it). ``package``: where the runtime is imported from
    (a copy of another commit's, loaded under another name, compares two versions in one process)."""
    import importlib

    nccl_comm = importlib.import_module(f"{package}.runtime.nccl_comm")
    ReduceComm = importlib.import_module(f"{package}.runtime.comm").ReduceComm  # noqa: N806 - a class

    class Handle:
        def reduce(self, *args: Any) -> None:
            pass

        def allReduce(self, *args: Any) -> None:  # noqa: N802 - cupy's name
            pass

        def reduceScatter(self, *args: Any) -> None:  # noqa: N802 - cupy's name
            pass

        def check_async_error(self) -> None:
            pass

    class Event:
        def record(self, stream: Any = None) -> None:
            pass

        def query(self) -> bool:
            return True

    class Stream:
        cuda_stream = 0

    fake_nccl = types.SimpleNamespace(groupStart=lambda: None, groupEnd=lambda: None, NCCL_SUM=0)
    try:  # cupy's binding has a module of its own since issue 47; a copy of an older commit keeps it in nccl_comm
        importlib.import_module(f"{package}.runtime.nccl_binding").nccl_module = lambda: fake_nccl
    except ModuleNotFoundError:
        nccl_comm._nccl = lambda: fake_nccl
    comm = nccl_comm.CupyNcclComm.__new__(nccl_comm.CupyNcclComm)
    ReduceComm.__init__(comm, 0, world_size)
    comm.stream, comm.device, comm._calls_in_group, comm._comm, comm.aborted = None, 0, 0, Handle(), False
    comm._views, comm._group_open, comm._abort_pending = {}, False, False
    comm._issued, comm._free_events, comm._first_call, comm._sum = [], [], None, 0
    comm._make_event = Event
    comm._stream = lambda: Stream
    comm._wait_current = comm._current_waits_for = lambda stream: None

    def register(buf: Any) -> None:
        comm._views[id(buf)] = nccl_comm._BufferView(buf, None, 4096, buf.element_size(), 0, 7)

    comm.register = register
    return comm


def _cupy_group_costs(rounds: int, groups: int = 32, calls: int = 4, package: str = "owner_reduce") -> float:
    """Median µs of host time per group of ``calls`` Reduces on the no-op ``CupyNcclComm`` (``_noop_cupy_comm``),
    ``groups`` groups per step, then the step's wait forgets them. ``package``: as ``_noop_cupy_comm``'s."""
    import torch

    comm = _noop_cupy_comm(package=package)
    buf = torch.zeros(calls * 64)
    comm.register(buf)
    views = [buf[i * 64:(i + 1) * 64] for i in range(calls)]
    samples = []
    clock = time.perf_counter_ns
    for step in range(rounds):
        for g in range(groups):
            start = clock()
            with comm.group(flush=step * groups + g):
                for root, view in enumerate(views):
                    comm.reduce(view, root)
            samples.append(clock() - start)
        comm.wait_until(lambda: True, "end_backward")
    return statistics.median(samples) / 1e3


ISSUE_COUNTS = (1, 2, 4, 8, 16)  # calls per group, and stages per two-level flush, the host cost is fitted over


def _line(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(intercept, slope, largest |residual| / value) of the least-squares line through ``points`` (x, y)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    intercept = my - slope * mx
    return intercept, slope, max(abs(intercept + slope * x - y) / y for x, y in points)


def _host_issue_fit(rounds: int, counts: tuple[int, ...] = ISSUE_COUNTS) -> dict[str, Any]:
    """The owner runtime's issue time, fitted: per call and per group from one flush's group of ``n`` no-op Reduces
    (its program run by ``runtime.executor.Executor``, the path a flush issues its calls by: the communicator's call
    per Collective on the bound views of the bucket, inside ``comm.group``) on the no-op cupy communicator, for each
    ``n`` of ``counts``; per two-level stage from a flush of ``n`` stages (one node ReduceScatter and one rail Reduce
    per stage on two no-op cupy communicators), less its two groups and two calls. Repeats interleaved (the counts in
    turn, their order rotated every round), medians, least-squares lines (``planning.host_cost``'s defaults quote
    them)."""
    import torch

    from owner_reduce.planning.collectives import NODE, RAIL, REDUCE, REDUCE_SCATTER, Collective
    from owner_reduce.planning.program import LevelRanks, compile_program
    from owner_reduce.runtime.executor import Executor, Levels
    from owner_reduce.runtime.streams import HostStreams

    width, per_node, top = 64, 8, max(counts)
    comm = _noop_cupy_comm(per_node)
    buffer = torch.zeros(top * per_node * width)
    comm.register(buffer)
    node, rail = _noop_cupy_comm(per_node), _noop_cupy_comm(per_node)
    node.register(buffer)
    rail.register(buffer)
    executor = Executor(comm, Levels(node, rail))
    streams = HostStreams()
    flat, staged = {}, {}
    for n in counts:
        program = compile_program([Collective(REDUCE, i * width, width, root=i % per_node) for i in range(n)], (), 0,
                                  span=buffer.numel())
        flat[n] = (program, executor.bind(program, buffer))
        calls = [c for s in range(n) for c in (
            Collective(REDUCE_SCATTER, s * per_node * width, per_node * width, per_rank=width, comm=NODE, stage=s),
            Collective(REDUCE, s * per_node * width, width, root=s % 2, comm=RAIL, rail=0, stage=s))]
        program = compile_program(calls, (), 0, span=buffer.numel(), levels=LevelRanks(0, per_node))
        staged[n] = (program, executor.bind(program, buffer))
    samples: dict[tuple[str, int], list[int]] = {(kind, n): [] for kind in ("calls", "stages") for n in counts}
    clock = time.perf_counter_ns
    for r in range(rounds):
        order = counts[r % len(counts):] + counts[:r % len(counts)]
        for n in order:
            program, bound = flat[n]
            start = clock()
            executor.run(program, bound, streams, r)
            samples[("calls", n)].append(clock() - start)
            program, bound = staged[n]
            start = clock()
            executor.run(program, bound, streams, r)
            samples[("stages", n)].append(clock() - start)
        for c in (comm, node, rail):
            c.wait_until(lambda: True, "end_backward")
    med = {key: statistics.median(s) / 1e3 for key, s in samples.items()}
    group, call, call_fit = _line([(n, med[("calls", n)]) for n in counts])
    _, stage, stage_fit = _line([(n, med[("stages", n)]) for n in counts])
    return {"call_us": call, "group_us": group, "stage_us": max(0.0, stage - 2 * group - 2 * call),
            "stage_total_us": stage, "call_residual": call_fit, "stage_residual": stage_fit,
            "medians": {f"{kind} {n}": round(v, 3) for (kind, n), v in sorted(med.items())}}


def _allocated_bytes(fn: Any) -> int:
    """Bytes of every tensor storage created while ``fn`` runs (views and in-place results do not count)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    total = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    total[0] += t.untyped_storage().nbytes()
            return out

    with Count():
        fn()
    return total[0]


def _memory(n_params: int = 148, numel: int = 4096) -> dict[tuple[int, bool], tuple[int, int]]:
    """(GA, release) -> (bytes allocated in a steady-state step, gradient bytes)."""
    out = {}
    for ga in (1, 2):
        for release in (False, True):
            rig = _Rig(n_params, numel)
            for _ in range(3):
                rig.step(ga, release)
            out[(ga, release)] = (_allocated_bytes(lambda rig=rig, ga=ga, release=release: rig.step(ga, release)),
                                  rig.grad_bytes)
    return out


def _median_step(results: list, skip: int) -> float:
    steps = range(skip, len(results[0]["step_times"]))
    return statistics.median(max(r["step_times"][i] for r in results) for i in steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time median")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds of the three training runs")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--skip-training", action="store_true", help="host-side measures only")
    parser.add_argument("--issue-rounds", type=int, default=2000,
                        help="interleaved rounds of the issue-time fit (per call, per group, per stage)")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    torch.set_num_threads(1)
    op = _op_costs(rounds=40, calls=148)
    flush = _flush_costs((148, 1000), rounds=100)
    memory = _memory()
    comm = _comm_costs(rounds=20, calls=50)
    two_level = _two_level_issue_costs(rounds=300)
    cupy_group = _cupy_group_costs(rounds=200)
    issue = _host_issue_fit(rounds=args.issue_rounds)

    step: dict[str, list[float]] = {"plain": [], "allreduce": [], "owner": []}
    ratios: dict[str, list[float]] = {"allreduce": [], "owner": []}
    summary = None
    if not args.skip_training:
        from harness.launch import run_ranks
        from harness.toy_training import TrainSpec, train

        base = TrainSpec(model="tiny_transformer", model_kwargs=(("dim", args.dim), ("layers", args.layers)),
                         steps=args.steps, backend=args.backend, micro_batch=8)
        # Both DeepCompile runs keep the probe on (rank 0 formats its first 20 flushes): with both flags off DeepSpeed
        # would run its native runtime, which does not build on CPU.
        specs = (("plain", TrainSpec(**{**base.__dict__, "mode": "plain"})),
                 ("allreduce", TrainSpec(**{**base.__dict__, "reduce_to_owner": False})),
                 ("owner", base))
        for rep in range(args.repeats):
            this: dict[str, float] = {}
            for name, spec in specs:
                start = time.monotonic()
                results = run_ranks(train, args.world_size, args=(spec,), timeout=args.timeout)
                this[name] = _median_step(results, args.warmup)
                step[name].append(this[name])
                summary = results[0]["summary"] or summary
                print(f"[bench] round {rep + 1} {name}: {time.monotonic() - start:.1f}s wall, "
                      f"step {this[name] * 1e3:.2f} ms", file=sys.stderr, flush=True)
            for name in ratios:
                ratios[name].append(this[name] / this["plain"])

    print("=" * 100)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"reduce_grad through the op (real runtime, no flush): {op['reduce_grad op']:8.2f} us")
    print(f"empty op, Library DEF + impl (same kind as ours):    {op['empty Library op']:8.2f} us")
    print(f"empty op, torch.library.custom_op (the floor):       {op['empty custom_op']:8.2f} us")
    print(f"ratio reduce_grad op / custom_op floor:              {op['reduce_grad op'] / op['empty custom_op']:8.3f}")
    print(f"all_reduce, 64 floats, 1-rank gloo: torch.distributed {comm['torch.distributed']:.2f} us, "
          f"deepspeed.comm {comm['deepspeed.comm']:.2f} us, TorchDistComm in a group {comm['TorchDistComm']:.2f} us")
    for n, ms in flush.items():
        print(f"flush host time, {n:4d} gradients (ws 4, no-op comm): {ms:8.3f} ms")
    for stages, (kept, fresh) in two_level.items():
        print(f"two-level flush, host time per stage ({stages:2d} stages, 1 node + 3 rail calls, no-op comms): "
              f"{kept:6.2f} us with the views kept, {fresh:6.2f} us made per flush ({kept / fresh:.2f}x)")
    print(f"cupy NCCL communicator, host time per group of 4 Reduces (no-op NCCL, CPU buffers): {cupy_group:6.2f} us")
    print(f"owner runtime's issue time, fitted over {', '.join(map(str, ISSUE_COUNTS))} calls per group and stages per "
          f"two-level flush (no-op cupy NCCL, CPU buffers, {args.issue_rounds} interleaved rounds): per call "
          f"{issue['call_us']:.2f} us, per group {issue['group_us']:.2f} us (largest residual "
          f"{issue['call_residual']:.0%}); per two-level stage {issue['stage_us']:.2f} us beyond its 2 groups and 2 "
          f"calls ({issue['stage_total_us']:.2f} us in all, largest residual {issue['stage_residual']:.0%})")
    print(f"  medians (us): {', '.join(f'{k} {v}' for k, v in issue['medians'].items())}")
    for (ga, release), (nbytes, grad_bytes) in memory.items():
        what = "release_reduce_buckets" if release else "buckets kept          "
        print(f"bytes allocated per steady step, GA {ga}, {what}: {nbytes:12,d} "
              f"(gradients {grad_bytes:,d} B)")
    if step["plain"]:
        print(summary)
        print(f"world size {args.world_size}, tiny transformer dim={args.dim} layers={args.layers}, "
              f"backend={args.backend}, {args.steps} steps, {args.repeats} interleaved rounds "
              f"(median over steps {args.warmup}..{args.steps - 1}, slowest rank per step)")
        for name, label in (("plain", "plain ZeRO-1"), ("allreduce", "DeepCompile + AllReduce path"),
                            ("owner", "DeepCompile + owner path")):
            print(f"step time {label + ':':31s} {statistics.median(step[name]) * 1e3:8.2f} ms  "
                  f"(rounds: {', '.join(f'{t * 1e3:.2f}' for t in step[name])})")
        for name, label in (("allreduce", "AllReduce path"), ("owner", "owner path")):
            print(f"ratio {label} / plain ZeRO-1: {statistics.median(ratios[name]):8.3f}  "
                  f"(rounds: {', '.join(f'{r:.3f}' for r in ratios[name])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
