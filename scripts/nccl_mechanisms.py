"""On a GPU, the failure mechanisms issue 37's review found by reading, and the product's answer to them, each run by
two rank processes on the visible GPU(s) (ranks sharing one GPU need NCCL >= 2.30: ``NCCL_MULTI_RANK_GPU_ENABLE=1`` and
``NCCL_MAX_NCHANNELS=4`` are set here for them):

- ``launch-stall``: rank 0 issues an AllReduce on a side stream that rank 1 never joins (it spins), makes the current
  stream wait for it (as a bucket's free event does) and launches ``--launches`` tiny kernels there: the host blocks
  inside a launch once the stream's launch queue is full (the review: after about a thousand), and an abort of the
  communicator from another thread (what the flush watchdog does) lets the launches finish.
- ``abort-order``: rank 0 issues an AllReduce on communicator A (rank 1 never joins it) and then one on communicator B
  on the same stream (queued behind A's spinning kernel). Aborting B alone does not return (``ncclCommAbort`` waits for
  B's last kernel, behind A's); aborting A then, concurrently, lets both return. With a fresh pair, both aborted at
  once from the start return.
- ``product-stall``: owner_reduce's runtime with its cupy communicator on real CUDA tensors, a deep model (``--layers``
  layers, a few kernels each, small buckets, so that the backward holds far more launches than the launch queue):
  rank 1 stops before its ``--stall-step``-th backward; rank 0 must fail within the deadline (``--deadline``, the
  runtime's ``compile.reduce_to_owner_timeout_s``) plus 10 s, naming the call, the communicator and the flush (raised,
  or written by the flush watchdog as it ends the process).

Each prints ``RESULT nccl_mechanisms check=<name> ...`` and exits 0 when the mechanism (or the product's bound) showed
as claimed, 1 when it did not, 3 without a CUDA GPU, 5 when a rank crashed or the check ran past ``--timeout``.
Runs only where a GPU is lent (``scripts/gpu_check.sh`` steps ``mech_launch_stall``, ``mech_abort_order``,
``stall_deep``); without one it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: owner_reduce, harness/, research/

NO_GPU, RANKS_FAILED = 3, 5
ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("launch-stall", "abort-order", "product-stall")
SHARED_GPU_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_NCHANNELS": "4"}
PRODUCT_BOUND_S = 10.0  # issue 37: every surviving rank fails within the deadline plus 10 s
WATCHDOG_ERROR = re.compile(r"OwnerReduceCommError: owner_reduce: rank 0(?: \([^)]*\))?, flush #(\d+): flush watchdog: "
                            r"(.+?) on the (data-parallel|node|rail|node hand-off) communicator (timed out|failed|has "
                            r"not returned)")


# ---- pure pieces (tested without a GPU) -------------------------------------------------------------------------


def deep_model_numels(layers: int, per_layer: tuple[int, ...] = (4096, 64)) -> list[int]:
    """A deep model's parameter sizes in registration order: a weight and a bias per layer."""
    return [n for _ in range(layers) for n in per_layer]


def owner_tables(numels: list[int], world_size: int) -> Any:
    """ZeRO-1-like partition tables: the gradients laid out flat, split in ``world_size`` equal partitions."""
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
    return GroupTables(group=0, param_ids=tuple(range(len(numels))), numels=tuple(numels),
                       partition_count=world_size, partition_ids=partition_ids, start_offsets=starts,
                       same_comm_as_dp=True)


def kept_slice(numels: list[int], world_size: int, rank: int, pid: int) -> tuple[int, int]:
    """(offset, length) of parameter ``pid``'s elements that rank ``rank``'s partition keeps (length 0: none)."""
    part = -(-sum(numels) // world_size)
    lo = sum(numels[:pid])
    hi = lo + numels[pid]
    start, stop = max(lo, rank * part), min(hi, (rank + 1) * part)
    return (start - lo, stop - start) if start < stop else (0, 0)


def judge_product_stall(returncode: int | None, failed_after_s: float | None, deadline_s: float, output: str
                        ) -> tuple[bool, str]:
    """Whether rank 0 failed as the product promises: non-zero exit within deadline + 10 s of rank 1's stall, with the
    flush watchdog's error naming the flush, the call and the communicator (or the main thread's own bounded wait)."""
    if returncode is None or failed_after_s is None:
        return False, "rank 0 was still running at the check's bound"
    if returncode == 0:
        return False, "rank 0 finished every step: the stall did not stall it"
    match = WATCHDOG_ERROR.search(output) or re.search(
        r"OwnerReduceCommError: owner_reduce: rank 0[^\n]*?, flush #(\d+): (.+?) (timed out|failed)", output)
    if match is None:
        return False, f"rank 0 exited {returncode} without owner_reduce's bounded error"
    if failed_after_s > deadline_s + PRODUCT_BOUND_S:
        return False, f"rank 0 failed {failed_after_s:.1f} s after the stall, past the deadline + {PRODUCT_BOUND_S:g} s"
    return True, match.group(0)


# ---- ranks ---------------------------------------------------------------------------------------------------------


def _setup(rank: int, world_size: int) -> Any:
    """torch.distributed over gloo (the unique ids' exchange and the barriers), this rank's GPU."""
    import datetime

    import torch
    import torch.distributed as dist

    from harness.launch import local_device

    torch.cuda.set_device(local_device(rank, torch.cuda.device_count()))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=float(os.environ.get("MECH_PG_TIMEOUT_S", "120"))))
    return torch.device("cuda", torch.cuda.current_device())


def _raw_comm(device: Any) -> Any:
    """A raw cupy NcclCommunicator over WORLD (both ranks call it), warmed by one AllReduce both join (NCCL connects
    lazily: after this, a collective only enqueues)."""
    import cupy
    import torch
    import torch.distributed as dist
    from cupy.cuda import nccl

    from owner_reduce.runtime.nccl_binding import exchange_unique_id

    uid = exchange_unique_id(dist.group.WORLD)
    cupy.cuda.Device(device.index).use()
    comm = nccl.NcclCommunicator(dist.get_world_size(), uid, dist.get_rank())
    buf = torch.ones(1024, device=device)
    comm.allReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(), nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                   torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return comm


def _all_reduce(comm: Any, buf: Any, stream: Any) -> None:
    from cupy.cuda import nccl

    comm.allReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(), nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.cuda_stream)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - reported
            out["error"] = f"{type(error).__name__}: {error}"
        out["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def rank_launch_stall(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    device = _setup(rank, world_size)
    comm = _raw_comm(device)
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        _all_reduce(comm, torch.ones(1 << 20, device=device), side)  # rank 1 never joins: it spins
        stalled = torch.cuda.Event()
        stalled.record(side)
        torch.cuda.current_stream().wait_event(stalled)  # a bucket's free event that never fires
        x = torch.zeros(1, device=device)
        progress = [0]
        watch: dict[str, Any] = {}

        def watchdog() -> None:  # what the flush watchdog does: notice the host stopped, abort
            last, since = -1, time.monotonic()
            while progress[0] < args.launches:
                time.sleep(0.05)
                if progress[0] != last:
                    last, since = progress[0], time.monotonic()
                elif time.monotonic() - since >= args.blocked_s:
                    watch["blocked_in_launch"] = progress[0] + 1
                    started = time.monotonic()
                    comm.abort()
                    watch["abort_s"] = time.monotonic() - started
                    return

        thread = threading.Thread(target=watchdog, daemon=True)
        thread.start()
        started = time.monotonic()
        for i in range(args.launches):
            x.add_(1)
            progress[0] = i + 1
        torch.cuda.synchronize()
        out.update(watch, launches=progress[0], loop_s=time.monotonic() - started, value=float(x.item()))
        thread.join(5)
    dist.barrier()
    if rank != 0:
        comm.abort()
    return out


def rank_abort_order(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    device = _setup(rank, world_size)
    pairs = [(_raw_comm(device), _raw_comm(device)) for _ in range(2)]  # (A, B), then a fresh (A, B)
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        for part, (a, b) in enumerate(pairs):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            _all_reduce(a, torch.ones(1 << 20, device=device), stream)  # rank 1 never joins A: it spins
            _all_reduce(b, torch.ones(1 << 10, device=device), stream)  # queued behind A's kernel
            if part == 0:  # B first, alone: waits for B's last kernel, behind A's
                thread_b, b_out = _in_thread(b.abort)
                thread_b.join(args.alone_s)
                out["b_alone_returned"] = not thread_b.is_alive()
                thread_a, a_out = _in_thread(a.abort)
            else:  # both at once
                thread_a, a_out = _in_thread(a.abort)
                thread_b, b_out = _in_thread(b.abort)
            started = time.monotonic()
            thread_a.join(args.join_s)
            thread_b.join(max(0.0, args.join_s - (time.monotonic() - started)))
            out[f"part{part}"] = {"a_returned": not thread_a.is_alive(), "b_returned": not thread_b.is_alive(),
                                  "a": a_out, "b": b_out, "after_s": time.monotonic() - started}
    dist.barrier()
    if rank != 0:
        for a, b in pairs:
            a.abort()
            b.abort()
    return out


def rank_product_stall(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """The product: ``OwnerReduceRuntime`` with ``CupyNcclComm``, driven as DeepCompile drives it, a few compute kernels
    per layer on the current stream before each gradient (the backward's launches)."""
    import types

    import torch
    import torch.distributed as dist

    from owner_reduce.planning.flags import OwnerReduceFlags
    from owner_reduce.planning.owner_map import OwnerMap
    from owner_reduce.planning.settings import MODEL, OwnerReduceSettings
    from owner_reduce.runtime.handle import OwnerReduceRuntime
    from owner_reduce.runtime.nccl_comm import CupyNcclComm

    device = _setup(rank, world_size)
    numels = deep_model_numels(args.layers)
    owner_map = OwnerMap.from_group_tables([owner_tables(numels, world_size)], world_size)
    rt = OwnerReduceRuntime(OwnerReduceSettings(OwnerReduceFlags(True, False), algo=MODEL, timeout_s=args.deadline),
                            owner_map, CupyNcclComm.from_process_group)
    rt.init(dist.group.WORLD, types.SimpleNamespace(double_buffer=True), args.bucket)
    for pid, n in enumerate(numels):
        offset, length = kept_slice(numels, world_size, rank, pid)
        rt.register_param(pid, (n,), torch.zeros(n, device=device),
                          torch.zeros(length, device=device) if length else torch.empty(0, device=device), offset)
    graph = 7
    rt.register_graph_z1(graph, list(range(len(numels))))
    grads = [torch.ones(n, device=device) for n in numels]
    work = torch.ones(256, 256, device=device)
    marker = Path(args.dir) / f"stalled-{rank}"
    for step in range(1, args.steps + 1):
        if rank == 1 and step == args.stall_step:
            marker.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # never joins this backward's flushes
        rt.start_backward(True)
        for pid in reversed(range(len(numels))):
            for _ in range(args.kernels):
                work.mul_(1.0)
            rt.reduce_grad(grads[pid], graph, pid)
        rt.end_backward(graph, False)
        print(f"rank {rank}: step {step} done ({rt.stats.flushes} flushes so far)", flush=True)
    rt.cleanup()
    return {"rank": rank, "steps": args.steps, "flushes": rt.stats.flushes}


RANK_MAIN = {"launch-stall": rank_launch_stall, "abort-order": rank_abort_order, "product-stall": rank_product_stall}


# ---- the parent ----------------------------------------------------------------------------------------------------


def _rank_command(argv: list[str], rank: int, out_dir: Path) -> list[str]:
    """How the parent starts a rank: this script again, with the parent's arguments and the rank's."""
    return [sys.executable, __file__, *argv, "--rank", str(rank), "--dir", str(out_dir)]


def _spawn(args: argparse.Namespace, out_dir: Path) -> list[subprocess.Popen]:
    from harness.launch import free_port

    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, **SHARED_GPU_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "PYTHONUNBUFFERED": "1"}
        log = (out_dir / f"{args.check}-rank{rank}.log").open("w")
        procs.append(subprocess.Popen(_rank_command(args.argv, rank, out_dir), env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT))
    return procs


def _finish(procs: list[subprocess.Popen], until: float) -> list[int | None]:
    for p in procs:
        try:
            p.wait(timeout=max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(10)
    return codes


def _rank_result(out_dir: Path, check: str, rank: int) -> tuple[dict[str, Any] | None, str]:
    text = (out_dir / f"{check}-rank{rank}.log").read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("MECH ")]
    return (json.loads(lines[-1][5:]) if lines else None), text


def parent(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"nccl_mechanisms {args.check}: no CUDA GPU is visible (torch.cuda.is_available() is False): nothing to "
              f"check", flush=True)
        return NO_GPU
    out_dir = Path(args.dir or os.environ.get("OUT", "out")) / "nccl_mechanisms"
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    procs = _spawn(args, out_dir)
    if args.check == "product-stall":
        return _parent_product_stall(args, procs, out_dir, started)
    codes = _finish(procs, started + args.timeout)
    results = [_rank_result(out_dir, args.check, r) for r in range(2)]
    r0 = results[0][0]
    if r0 is None or any(c != 0 for c in codes):
        print(f"RESULT nccl_mechanisms check={args.check} ok=0 ranks_exit={codes} (a rank crashed or ran past "
              f"{args.timeout:g} s); rank 0's last lines: {results[0][1][-800:]!r}", flush=True)
        return RANKS_FAILED
    ok, line = (judge_launch_stall if args.check == "launch-stall" else judge_abort_order)(r0, args)
    print(line, flush=True)
    return 0 if ok else 1


def judge_launch_stall(r0: dict[str, Any], args: argparse.Namespace) -> tuple[bool, str]:
    """The host blocked in a launch before the last one, and every launch ran once the abort came."""
    blocked = r0.get("blocked_in_launch")
    resumed = r0.get("launches") == args.launches
    ok = blocked is not None and blocked < args.launches and resumed
    return ok, (f"RESULT nccl_mechanisms check=launch-stall ok={int(ok)} launches={args.launches} "
                f"host_blocked_in_launch={blocked} abort_s={r0.get('abort_s', float('nan')):.2f} "
                f"resumed_after_abort={int(resumed)} loop_s={r0.get('loop_s', float('nan')):.1f}")


def judge_abort_order(r0: dict[str, Any], args: argparse.Namespace) -> tuple[bool, str]:
    """B's abort alone did not return; A's then, concurrently, let both return; a fresh pair at once returned."""
    p0, p1 = r0["part0"], r0["part1"]
    both0, both1 = p0["a_returned"] and p0["b_returned"], p1["a_returned"] and p1["b_returned"]
    ok = not r0["b_alone_returned"] and both0 and both1
    return ok, (f"RESULT nccl_mechanisms check=abort-order ok={int(ok)} b_alone_returned_within_{args.alone_s:g}s="
                f"{int(r0['b_alone_returned'])} then_a_concurrently: both_returned={int(both0)} in "
                f"{p0['after_s']:.2f}s; fresh_pair_concurrently: both_returned={int(both1)} in {p1['after_s']:.2f}s")


def _parent_product_stall(args: argparse.Namespace, procs: list[subprocess.Popen], out_dir: Path,
                          started: float) -> int:
    marker = out_dir / "stalled-1"
    stalled_at = None
    while time.monotonic() < started + args.timeout and stalled_at is None:
        if any(p.poll() is not None for p in procs):
            break
        if marker.exists():
            stalled_at = time.monotonic()
        time.sleep(0.1)
    if stalled_at is None:
        codes = _finish(procs, time.monotonic())
        _, text = _rank_result(out_dir, args.check, 0)
        print(f"RESULT nccl_mechanisms check=product-stall ok=0 the ranks never reached the stall (exit {codes}); "
              f"rank 0's last lines: {text[-800:]!r}", flush=True)
        return RANKS_FAILED
    bound = stalled_at + args.deadline + PRODUCT_BOUND_S + 20  # past the product's bound: the check's own
    try:
        procs[0].wait(timeout=max(0.1, bound - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    failed_after = time.monotonic() - stalled_at if procs[0].poll() is not None else None
    code = procs[0].poll()
    _finish(procs, time.monotonic())
    _, text = _rank_result(out_dir, args.check, 0)
    ok, why = judge_product_stall(code, failed_after, args.deadline, text)
    after = "none" if failed_after is None else f"{failed_after:.1f}"
    print(f"RESULT nccl_mechanisms check=product-stall ok={int(ok)} layers={args.layers} bucket={args.bucket} "
          f"deadline_s={args.deadline:g} rank0_exit={code} failed_after_stall_s={after} "
          f"bound_s={args.deadline + PRODUCT_BOUND_S:g} error={why[:300]!r}", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=CHECKS)
    parser.add_argument("--timeout", type=float, default=60.0, help="the check's own bound, seconds")
    parser.add_argument("--launches", type=int, default=5000, help="launch-stall: kernels launched behind the stall")
    parser.add_argument("--blocked-s", type=float, default=2.0, help="launch-stall: no launch for this long = blocked")
    parser.add_argument("--alone-s", type=float, default=10.0, help="abort-order: how long B's abort alone is given")
    parser.add_argument("--join-s", type=float, default=20.0, help="abort-order: how long the concurrent aborts get")
    parser.add_argument("--layers", type=int, default=128, help="product-stall: layers of the deep model")
    parser.add_argument("--kernels", type=int, default=8, help="product-stall: compute launches per layer")
    parser.add_argument("--bucket", type=int, default=16384, help="product-stall: reduce bucket size, elements")
    parser.add_argument("--steps", type=int, default=6, help="product-stall: steps rank 0 would run")
    parser.add_argument("--stall-step", type=int, default=3, help="product-stall: rank 1 stops before this backward")
    parser.add_argument("--deadline", type=float, default=8.0,
                        help="product-stall: the flushes' deadline (compile.reduce_to_owner_timeout_s)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="where the ranks' logs go (default: $OUT/nccl_mechanisms)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    if args.rank is None:
        return parent(args)
    result = RANK_MAIN[args.check](args.rank, 2, args)
    print("MECH " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a thread left in an abort that never returned must not keep the rank alive


if __name__ == "__main__":
    sys.exit(main())
