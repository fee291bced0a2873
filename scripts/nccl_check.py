"""Standalone check of the owner flush on real NCCL through cupy: correct against AllReduce, and how fast.

Why standalone (no DeepSpeed; on one node no torch.distributed either): when the end-to-end run misbehaves on a
GPU machine, this separates "NCCL through cupy on torch buffers" from everything above it. It spawns one process per
rank on the visible GPUs (several ranks on one GPU need NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1, set
here), hands every rank the unique id the parent made, and builds one reduce bucket with a realistic owner
layout: a GPT-2 124M parameter list partitioned ZeRO-1 style over the ranks, the bucket being a window of
gradients in backward order around a partition boundary, planned by owner_reduce's own ``plan_flush``
(ranges Reduce to their owner or AllReduce, adjacent same-root ranges merged, all in one ncclGroupStart/End),
against the native flush: one AllReduce over the whole bucket. For each dtype it checks:
- identical inputs on every rank: the owner flush equals the AllReduce flush bitwise on every element that
  reaches this rank (its own ranges and the AllReduce ranges);
- random inputs per rank: both equal the float64 reference within the dtype's tolerance;
and times both flushes with CUDA events (median over --iters after warm-up; the slowest rank's median).

One node: ``python scripts/nccl_check.py --world-size 8`` (default: one rank per visible GPU).
Several nodes: start it under a launcher, one process per GPU, on every node, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr HOST --master-port PORT scripts/nccl_check.py``.
With RANK and WORLD_SIZE set it is one rank of that world: a gloo process group only hands rank 0's NCCL unique id
to every rank and brings the results back to rank 0, which prints them; the check itself runs on cupy's NCCL.
``--dry-run`` prints each dtype's bucket plan at --world-size (default 8) and runs nothing: no GPU, no cupy.

Exit codes: 0 all checks passed, 1 a check failed, 3 no CUDA GPU, 4 cannot run here (no cupy/libnccl, or
ranks sharing a GPU with NCCL < 2.30), 5 ranks crashed or timed out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: owner_reduce, harness/, research/

NO_GPU, CANNOT_RUN, RANKS_FAILED = 3, 4, 5
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TOLERANCE = {"float32": (1e-5, 1e-6), "bfloat16": (1.6e-2, 1e-2), "float16": (2e-3, 1e-3)}  # (rtol, atol)


def gpt2_param_numels(layers: int = 12, dim: int = 768, vocab: int = 50257, ctx: int = 1024) -> list[int]:
    """GPT-2 (124M at the defaults) parameter sizes in ``named_parameters`` order."""
    numels = [vocab * dim, ctx * dim]
    for _ in range(layers):
        numels += [dim, dim, dim * 3 * dim, 3 * dim, dim * dim, dim, dim, dim, dim * 4 * dim, 4 * dim,
                   4 * dim * dim, dim]
    return numels + [dim, dim]


def zero1_owner_map(numels: list[int], world_size: int) -> Any:
    """ZeRO-1 partitioning of one flat group: padded to a multiple of 2*ws, equal contiguous partitions."""
    from owner_reduce.planning.owner_map import GroupTables, OwnerMap

    total = sum(numels)
    align = 2 * world_size
    size = -(-total // align) * align // world_size
    partition_ids: dict[int, tuple[int, ...]] = {}
    starts: dict[int, dict[int, int]] = {p: {} for p in range(world_size)}
    begin = 0
    for pid, numel in enumerate(numels):
        parts = tuple(range(begin // size, (begin + numel - 1) // size + 1))
        partition_ids[pid] = parts
        for p in parts:
            starts[p][pid] = max(0, p * size - begin)
        begin += numel
    tables = GroupTables(group=0, param_ids=tuple(range(len(numels))), numels=tuple(numels),
                         partition_count=world_size, partition_ids=partition_ids, start_offsets=starts,
                         same_comm_as_dp=True)
    return OwnerMap.from_group_tables([tables], dp_world_size=world_size)


def bucket_window(numels: list[int], world_size: int, bucket_elems: int) -> list[int]:
    """Param ids of one bucket in backward order: consecutive gradients around the middle partition boundary."""
    order = list(reversed(range(len(numels))))
    total = sum(numels)
    boundary = total // 2 if world_size == 1 else (world_size // 2) * (-(-total // world_size))
    starts, begin = {}, 0
    for pid, numel in enumerate(numels):
        starts[pid] = begin
        begin += numel
    k = next(i for i, pid in enumerate(order) if starts[pid] <= boundary < starts[pid] + numels[pid])
    lo = hi = k
    used = numels[order[k]]
    grown = True
    while grown:
        grown = False
        if hi + 1 < len(order) and used + numels[order[hi + 1]] <= bucket_elems:
            hi += 1
            used += numels[order[hi]]
            grown = True
        if lo > 0 and used + numels[order[lo - 1]] <= bucket_elems:
            lo -= 1
            used += numels[order[lo]]
            grown = True
    return order[lo:hi + 1]


def plan_bucket(world_size: int, bucket_bytes: int, elem_size: int) -> Any:
    from owner_reduce.planning.flush_plan import BucketEntry, plan_flush

    numels = gpt2_param_numels()
    owner_map = zero1_owner_map(numels, world_size)
    entries, offset = [], 0
    for pid in bucket_window(numels, world_size, bucket_bytes // elem_size):
        entries.append(BucketEntry(pid, offset, numels[pid]))
        offset += numels[pid]
    return plan_flush(entries, owner_map, reduce_to_owner=True)


def plan_facts(dtype_name: str, plan: Any, ws: int) -> dict[str, Any]:
    """What the plan line says about one dtype's bucket (the same with or without a GPU)."""
    from owner_reduce.planning.flush_plan import ALL

    n = plan.reduced_elems
    reduce_ranges = sum(1 for r in plan.ranges if r.root is not ALL)
    return {"dtype": dtype_name, "elems": n, "params": plan.tasks, "ranges": len(plan.ranges),
            "reduce_ranges": reduce_ranges, "allreduce_ranges": len(plan.ranges) - reduce_ranges,
            "owner_share": plan.owner_elems / n if n else 0.0,
            "received_share": [plan.received_elems(r) / max(n, 1) for r in range(ws)]}


def plan_line(row: dict[str, Any]) -> str:
    return (f"  {row['dtype']}: {row['elems']} elements in {row['params']} gradients; plan {row['ranges']} ranges "
            f"({row['reduce_ranges']} Reduce, {row['allreduce_ranges']} AllReduce), owner path "
            f"{100 * row['owner_share']:.1f}% of elements; received per rank "
            f"{', '.join(f'{100 * s:.1f}%' for s in row['received_share'])}")


# ---- one rank ------------------------------------------------------------------------------------------------


def _flush(comm: Any, buf: Any, plan: Any | None) -> None:
    """The owner flush (``plan``) or, with ``plan`` None, the native one: one AllReduce over the bucket."""
    from owner_reduce.planning.flush_plan import ALL

    with comm.group():
        if plan is None:
            comm.all_reduce(buf)
            return
        for r in plan.ranges:
            segment = buf.narrow(0, r.offset, r.count)
            if r.root is ALL:
                comm.all_reduce(segment)
            else:
                comm.reduce(segment, r.root)


def _inputs(seed: int, n: int, dtype: Any) -> Any:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, device="cuda", generator=gen, dtype=torch.float32).to(dtype)


def _check_dtype(comm: Any, rank: int, ws: int, dtype_name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from owner_reduce.planning.flush_plan import ALL

    dtype = getattr(torch, dtype_name)
    elem = torch.empty(0, dtype=dtype).element_size()
    plan = plan_bucket(ws, int(args.bucket_mb * 2**20), elem)
    n = plan.reduced_elems
    mine = torch.zeros(n, dtype=torch.bool, device="cuda")  # elements whose result reaches this rank
    for r in plan.ranges:
        if r.root is ALL or r.root == rank:
            mine[r.offset:r.offset + r.count] = True

    def both(x: Any) -> tuple[Any, Any]:
        ar, ow = x.clone(), x.clone()
        ar.div_(ws)
        ow.div_(ws)
        _flush(comm, ar, None)
        _flush(comm, ow, plan)
        torch.cuda.synchronize()
        return ar, ow

    ar, ow = both(_inputs(7, n, dtype))  # the same on every rank
    bitwise = bool(torch.equal(ar[mine], ow[mine]))
    ar, ow = both(_inputs(1000 + rank, n, dtype))  # different on every rank
    reference = sum(_inputs(1000 + r, n, dtype).double() / ws for r in range(ws))
    rtol, atol = TOLERANCE[dtype_name]
    close = all(bool(torch.allclose(t[mine].double(), reference[mine], rtol=rtol, atol=atol)) for t in (ar, ow))
    max_err = max(float((t[mine].double() - reference[mine]).abs().max()) for t in (ar, ow)) if n else 0.0
    del reference

    source = _inputs(11 + rank, n, dtype)
    buf = torch.empty_like(source)
    times: dict[str, list[float]] = {"allreduce": [], "owner": []}
    for i in range(args.warmup + args.iters):
        for name, p in (("allreduce", None), ("owner", plan)):
            buf.copy_(source)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _flush(comm, buf, p)
            end.record()
            end.synchronize()
            if i >= args.warmup:
                times[name].append(start.elapsed_time(end))
    reduce_ranges = sum(1 for r in plan.ranges if r.root is not ALL)
    return {"dtype": dtype_name, "elems": n, "params": plan.tasks, "ranges": len(plan.ranges),
            "reduce_ranges": reduce_ranges, "allreduce_ranges": len(plan.ranges) - reduce_ranges,
            "owner_share": plan.owner_elems / n if n else 0.0, "received_elems": plan.received_elems(rank),
            "bitwise_equal": bitwise, "within_tolerance": close, "max_abs_err": max_err, "rtol": rtol, "atol": atol,
            "allreduce_ms": statistics.median(times["allreduce"]), "owner_ms": statistics.median(times["owner"])}


def rank_main(rank: int, ws: int, unique_id: bytes, args: argparse.Namespace,
              local_rank: int | None = None) -> dict[str, Any]:
    import torch

    from owner_reduce.runtime.nccl_comm import CupyNcclComm

    device = (rank if local_rank is None else local_rank) % torch.cuda.device_count()
    torch.cuda.set_device(device)
    comm = CupyNcclComm(unique_id, rank, ws, device=device)
    try:
        rows = [_check_dtype(comm, rank, ws, DTYPES[d], args) for d in args.dtypes]
        gathered = comm.all_gather_ints([rank, len(rows)])
    finally:
        comm.close()
    return {"device": device, "rows": rows, "gathered": gathered}


# ---- the parent ----------------------------------------------------------------------------------------------


def timing_label(ws: int, gpus: int) -> str | None:
    """What the flush timings mean at this world size: None where they measure communication between GPUs."""
    if ws == 1:
        return ("no communication measurement: at ws=1 NCCL only copies within one GPU; "
                "this run checks correctness only")
    if ws > gpus:
        return "ranks share a GPU: not an interconnect measurement"
    return None


def _report(ws: int, results: list[dict[str, Any]], header: dict[str, Any]) -> tuple[bool, list[dict]]:
    rows_by_rank = [results[r]["rows"] for r in range(ws)]
    ok = all(results[r]["gathered"] == [[q, len(rows_by_rank[0])] for q in range(ws)] for r in range(ws))
    summary = []
    for i, first in enumerate(rows_by_rank[0]):
        per_rank = [rows[i] for rows in rows_by_rank]
        ar = max(row["allreduce_ms"] for row in per_rank)
        ow = max(row["owner_ms"] for row in per_rank)
        bitwise = all(row["bitwise_equal"] for row in per_rank)
        close = all(row["within_tolerance"] for row in per_rank)
        ok = ok and bitwise and close
        row = {**header, **{k: first[k] for k in ("dtype", "elems", "params", "ranges", "reduce_ranges",
                                                    "allreduce_ranges", "owner_share", "rtol", "atol")},
               "bitwise_equal": bitwise, "within_tolerance": close,
               "max_abs_err": max(r["max_abs_err"] for r in per_rank),
               "received_share": [r["received_elems"] / max(first["elems"], 1) for r in per_rank],
               "allreduce_ms": ar, "owner_ms": ow, "ratio": ow / ar if ar else float("nan")}
        summary.append(row)
        print(plan_line(row))
        print(f"    identical inputs, owner == AllReduce bitwise on received elements: {bitwise}")
        print(f"    random inputs, both within rtol={row['rtol']} atol={row['atol']} of the fp64 reference: {close} "
              f"(max abs err {row['max_abs_err']:.3g})")
        row["timing"] = timing_label(ws, header["gpus"])
        if ws == 1:
            print(f"    median flush: AllReduce {ar:.3f} ms, owner {ow:.3f} ms: {row['timing']}")
            print(f"RESULT nccl_check ws=1 dtype={row['dtype']} elems={row['elems']} bitwise={bitwise} close={close} "
                  f"timing=not-a-communication-measurement", flush=True)
            continue
        note = "" if row["timing"] is None else f" ({row['timing']})"
        print(f"    median flush (slowest rank): AllReduce {ar:.3f} ms, owner {ow:.3f} ms, "
              f"ratio {row['ratio']:.3f}{note}")
        print(f"RESULT nccl_check ws={ws} dtype={row['dtype']} elems={row['elems']} allreduce_ms={ar:.4f} "
              f"owner_ms={ow:.4f} ratio={row['ratio']:.4f} bitwise={bitwise} close={close}"
              f"{'' if row['timing'] is None else ' timing=ranks-share-a-gpu'}", flush=True)
    return ok, summary


def dry_run(args: argparse.Namespace) -> int:
    """Each dtype's bucket plan at --world-size, as the run prints it; nothing runs (no torch CUDA, no cupy)."""
    ws = args.world_size or 8
    print(f"nccl_check: dry run, no GPU touched: ws={ws}; bucket {args.bucket_mb:g} MiB; the plan each rank would run",
          flush=True)
    for d in args.dtypes:
        name = DTYPES[d]
        print(plan_line(plan_facts(name, plan_bucket(ws, int(args.bucket_mb * 2**20), ELEMENT_BYTES[name]), ws)))
    return 0


def launched(args: argparse.Namespace, header: dict[str, Any]) -> int:
    """One rank of a world a launcher started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), across nodes.

    Why a gloo group: the ranks are on several hosts, so the NCCL unique id cannot be handed over in memory as on one
    node. The group carries the id out from rank 0 and the results back to it, nothing else: the check runs on cupy's
    communicator alone."""
    import torch.distributed as dist

    from owner_reduce.runtime.nccl_binding import new_unique_id

    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        box = [new_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        result = rank_main(rank, ws, box[0], args, local_rank=local_rank)
        results: list[Any] = [None] * ws
        dist.all_gather_object(results, result)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    ok, summary = _report(ws, results, header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"nccl_check: {'all checks passed' if ok else 'A CHECK FAILED'}", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks on this node (default: the number of GPUs); under a launcher, its WORLD_SIZE")
    parser.add_argument("--bucket-mb", type=float, default=32.0, help="reduce bucket size in MiB per dtype")
    parser.add_argument("--iters", type=int, default=20, help="timed flushes per path and dtype")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtypes", type=lambda s: [d.strip() for d in s.split(",") if d.strip()],
                        default=["fp32", "bf16"], help=f"comma list of {', '.join(DTYPES)}")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds for all ranks together (under a launcher: the gloo group's timeout)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--dry-run", action="store_true", help="print the bucket plans at --world-size (default 8)")
    args = parser.parse_args(argv)
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtypes {unknown}; choose from {list(DTYPES)}")
    if args.dry_run:
        return dry_run(args)
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_launcher and args.world_size is not None:
        parser.error("--world-size is the launcher's WORLD_SIZE here: leave it out")

    import torch

    if not torch.cuda.is_available():
        print("nccl_check: no CUDA GPU is visible (torch.cuda.is_available() is False): nothing to check", flush=True)
        return NO_GPU
    try:
        from owner_reduce.runtime.nccl_binding import nccl_runtime_version, new_unique_id

        version = nccl_runtime_version()
        unique_id = None if under_launcher else new_unique_id()
    except Exception as error:  # noqa: BLE001 - reported as "cannot run here"
        print(f"nccl_check: cupy's NCCL is unavailable: {type(error).__name__}: {error}", flush=True)
        return CANNOT_RUN
    gpus = torch.cuda.device_count()
    if under_launcher:
        ws = int(os.environ["WORLD_SIZE"])
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(ws, gpus)))
        shared, in_use = per_node > gpus, -(-ws // per_node) * min(per_node, gpus)  # GPUs of every node in the run
    else:
        ws = args.world_size or gpus
        per_node, shared, in_use = ws, ws > gpus, gpus
    if shared:
        if version < (2, 30, 0):
            print(f"nccl_check: {per_node} ranks on {gpus} GPU(s) need NCCL >= 2.30 (NCCL_MULTI_RANK_GPU_ENABLE); "
                  f"cupy loads NCCL {'.'.join(map(str, version))}", flush=True)
            return CANNOT_RUN
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    header = {"world_size": ws, "gpus": in_use, "gpu": torch.cuda.get_device_name(0),
              "nccl": ".".join(map(str, version)), "torch": torch.__version__, "bucket_mb": args.bucket_mb,
              "iters": args.iters}
    torch_nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    if not under_launcher or int(os.environ["RANK"]) == 0:
        print(f"nccl_check: NCCL {header['nccl']} through cupy (torch {torch.__version__} has NCCL {torch_nccl}); "
              f"ws={ws} on {in_use} x {header['gpu']}; bucket {args.bucket_mb:g} MiB; {args.iters} iters after "
              f"{args.warmup} warm-up" + ("; ranks share GPUs: timings are not an interconnect's" if shared else ""),
              flush=True)
    if under_launcher:
        return launched(args, header)
    from harness.launch import RankFailure, RankTimeout, run_ranks

    try:  # no DeepSpeed, no torch process group: the ranks meet through the NCCL unique id alone
        results = run_ranks(rank_main, ws, args=(unique_id, args), timeout=args.timeout, dist_backend=None)
    except (RankFailure, RankTimeout) as error:
        print(f"nccl_check: {error}", file=sys.stderr)
        return RANKS_FAILED
    ok, summary = _report(ws, results, header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"nccl_check: {'all checks passed' if ok else 'A CHECK FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
