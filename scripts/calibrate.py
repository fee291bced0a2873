"""Measure this cluster's call times for owner_reduce's flush choice and write them as a calibration file.

Under a launcher (torchrun, deepspeed, srun with the torchrun-style RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT environment), on every rank, at the world size the training will run:

    torchrun --nproc-per-node 8 scripts/calibrate.py --out calibration.json

On this machine without a launcher, N gloo ranks on the CPU (as scripts/demo.py starts them):

    python scripts/calibrate.py --local-gloo 4 --out out/calibration.json

What it would run, anywhere (no launcher, no GPU, nothing timed): ``--dry-run --world-size 64`` (add ``--cpu`` for the
ladder of gloo ranks). Besides each call kind's ladder it times the host's cost of a call: one group of 1, 2, 4, 8, 16
AllReduces of 64 KiB in all, each group alone; per extra call the slope, per group the rest beyond one AllReduce of
the same bytes (owner_reduce/planning/calibration.py, Note (host)).

Rank 0 writes the file and prints the fits. Name the file in the DeepSpeed config
(``"compile": {"reduce_to_owner_calibration": "calibration.json"}``) to have the flush choice cost every candidate on
it instead of NCCL's tables (owner_reduce/planning/calibration.py describes the format and fits).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: owner_reduce, harness/, research/

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``4096``, ``4KiB``, ``64M``: bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 4KiB, 64MiB)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(part) for part in text.split(",") if part.strip())


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _options(args: argparse.Namespace) -> object:
    from owner_reduce.runtime.calibrate import HOST_BYTES, HOST_CALLS, MEASURED, CalibrationOptions

    return CalibrationOptions(sizes=args.sizes, peers=args.peers, warmup=args.warmup, repeats=args.repeats,
                              inner=args.inner, dtype=args.dtype, kinds=args.kinds or MEASURED,
                              peer_stride=args.peer_stride, host_calls=args.host_calls or HOST_CALLS,
                              host_bytes=args.host_bytes or HOST_BYTES)


def _dry_run(args: argparse.Namespace) -> int:
    """Print the measurements a run at ``--world-size`` would make on a GPU (``--cpu``: on gloo ranks), in order,
    with their repeats: nothing is timed, no process group is made."""
    import torch

    from owner_reduce.runtime.calibrate import plan_measurements

    options = _options(args)
    on_gpu = not args.cpu
    dtype = getattr(torch, options.dtype or ("bfloat16" if on_gpu else "float32"))
    element_size = torch.empty((), dtype=dtype).element_size()
    measurements = plan_measurements(options, args.world_size, element_size, on_gpu)
    inner = options.inner or (10 if on_gpu else 1)
    print(f"owner_reduce: calibration dry run: {args.world_size} ranks, {'cupy NCCL on GPUs' if on_gpu else 'gloo'}, "
          f"{str(dtype).removeprefix('torch.')}, {options.warmup} warm-up then {options.repeats} timed repeats of "
          f"each (every repeat after the ranks meet in a one-element AllReduce), medians, the maximum over ranks")
    for m in measurements:
        per_repeat = 1 if m.kind == "host" else inner
        print(f"  {m.describe()}   x{per_repeat} per timed repeat")
    print(f"owner_reduce: {len(measurements)} measurements; {args.out} would hold the fits (format "
          f"owner_reduce.calibration/2)")
    return 0


def _report(text: str, out: Path, started: float) -> None:
    from owner_reduce.planning.calibration import Calibration, format_fits

    cal = Calibration.from_json(text, source=str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    for line in format_fits(cal):
        print(line)
    print(f"owner_reduce: wrote {out} (digest {cal.digest()}) in {time.monotonic() - started:.1f}s; use it with "
          f"\"compile\": {{\"reduce_to_owner_calibration\": \"{out}\"}} in the DeepSpeed config")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the calibration file rank 0 writes")
    parser.add_argument("--sizes", type=parse_sizes, default=None,
                        help="comma-separated bytes per call (4KiB,1MiB,...); default 4 KiB..64 MiB on GPUs, "
                             "4 KiB..4 MiB on CPU")
    parser.add_argument("--peers", type=parse_ints, default=None,
                        help="send/recv peer counts (default 1,2,4,.. up to min(world_size-1, 8))")
    parser.add_argument("--peer-stride", type=int, default=1,
                        help="distance between send/recv partners (ranks per node: every partner on another node)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--inner", type=int, default=None, help="calls per timed repeat (default 10 on GPU, 1 on CPU)")
    parser.add_argument("--dtype", default=None, help="buffer element type (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--kinds", type=lambda s: tuple(k for k in s.split(",") if k), default=None,
                        help="subset of allreduce,reduce,reduce_scatter,p2p,host (default all; host needs allreduce)")
    parser.add_argument("--host-calls", type=parse_ints, default=None,
                        help="calls per group of the per-call measurement (default 1,2,4,8,16)")
    parser.add_argument("--host-bytes", type=parse_size, default=None,
                        help="bytes every group of the per-call measurement moves (default 64KiB)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what a run at --world-size would measure (the GPU ladder; --cpu: gloo's) and exit")
    parser.add_argument("--world-size", type=int, default=None, help="--dry-run: the ranks of the run (default "
                        "WORLD_SIZE, else 8)")
    parser.add_argument("--cpu", action="store_true", help="--dry-run: the ladder of gloo ranks on CPUs")
    parser.add_argument("--local-gloo", type=int, default=0, metavar="N",
                        help="spawn N gloo ranks on this machine's CPU instead of running under a launcher")
    parser.add_argument("--timeout", type=float, default=600, help="--local-gloo: seconds before the ranks are killed")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.dry_run:
        args.world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 8))
        if args.world_size < 2:
            parser.error("--dry-run needs --world-size of at least 2")
        try:
            return _dry_run(args)
        except ValueError as error:
            parser.error(str(error))

    if args.local_gloo:
        if args.local_gloo < 2:
            parser.error("--local-gloo needs at least 2 ranks")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from harness.launch import run_ranks
        from owner_reduce.runtime.calibrate import local_rank_worker

        options = _options(args)
        print(f"owner_reduce: calibrating on {args.local_gloo} local gloo ranks", flush=True)
        results = run_ranks(local_rank_worker, args.local_gloo, args=(options,), timeout=args.timeout)
        if len({digest for digest, _ in results}) != 1:
            print(f"owner_reduce: ranks disagree on the calibration: {[d for d, _ in results]}", file=sys.stderr)
            return 1
        _report(results[0][1], args.out, started)
        return 0

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("no launcher environment (RANK, WORLD_SIZE): run under torchrun/deepspeed, or use --local-gloo N")
    import deepspeed
    import torch.distributed as dist

    from owner_reduce.runtime.calibrate import run_calibration

    if not dist.is_initialized():
        deepspeed.init_distributed(verbose=False)
    rank = dist.get_rank()
    try:
        cal = run_calibration(_options(args), log=(lambda line: print(line, flush=True)) if rank == 0 else None)
        if rank == 0:
            _report(cal.to_json(), args.out, started)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
