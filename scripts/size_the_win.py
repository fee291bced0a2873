"""Size the win of reduce_to_owner for a model and world size, on a CPU box, with DeepSpeed's own partitioning.

Computes DeepSpeed's own ZeRO-1 partitioning as rank 0 of N in torch's fake process group (no GPU, no other
processes): by default with the model on the meta device through DeepSpeed's partition methods (no parameter
storage: Llama-2 70B at ws 1024 in seconds), with ``--exact-engine`` by building a real engine with
uninitialized bf16 weights (the reference; ~3.4 GB for 1B). It reads the owner map and prints the init line,
the share of elements on the owner path, bytes delivered per rank per step, collective calls per bucket flush
and the ring-model time ratio. Examples::

    python scripts/size_the_win.py --model gpt2-124m --world-size 8 64
    python scripts/size_the_win.py --model 1b --world-size 8 --report-json
    python scripts/size_the_win.py --model llama-7b --world-size 512 --bucket-size 5e8 --json out/plan.json
    python scripts/size_the_win.py --model llama-13b --world-size 64 512 1024 --summary --handoff-sensitivity
    python scripts/size_the_win.py --model llama-7b --world-size 64 --no-nvls --gpu-generation ampere
    python scripts/size_the_win.py --model gpt2-124m --world-size 4 --calibration out/calibration.json
    python scripts/size_the_win.py --model llama-70b --world-size 1024
    python scripts/size_the_win.py --model llama-7b --vocab 128256 --param-groups decay --world-size 64
    python scripts/size_the_win.py --model mypkg.models:make_model --world-size 16
    python scripts/size_the_win.py --world-size 8 64 512 --check-published

Time estimates: calls per flush today (arrival order), with the owner-ordered bucket, and natively (one
AllReduce per gradient in one NCCL group, as DeepCompile issues them), each costed the way NCCL 2.30 plans a
group (owner_reduce/planning/collective_time.py) on the cluster the options describe: by default nodes of 8
Hopper GPUs on NVSwitch with NVLS, one 400 Gb/s NIC per GPU (one NVLink node when the world fits in one);
``--calibration FILE`` replaces NCCL's tables with times measured on your cluster (scripts/calibrate.py).
``--check-published`` also models the one published measurement (8x A800 NVLink, 806 MB bf16, one collective
per parameter; research/published_check.py, beside the package).

Why one process per world size when several are given: the fake process group is process-global.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_START = time.perf_counter()  # before torch and deepspeed are imported: the wall time printed covers them
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: owner_reduce, harness/, research/

from owner_reduce.offline_sizing.fake_engine import size_in_subprocess, size_model  # noqa: E402
from owner_reduce.offline_sizing.model_spec import GROUPINGS, PRESETS, ModelSpec, describe_preset  # noqa: E402
from owner_reduce.planning.sizing import (  # noqa: E402
    DEFAULT_BUCKET_SIZE,
    DTYPE_BYTES,
    HANDOFF_SENSITIVITY,
    Cluster,
    format_report,
    format_summary_rows,
    plan_to_dicts,
    report_to_dict,
    summary_header,
)
from research.published_check import check_published_in_subprocess, format_published_check  # noqa: E402


def _elements(text: str) -> int:
    """Bucket sizes as DeepSpeed writes them (5e8) or as integers."""
    value = float(text)
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"bucket size must be a positive whole number of elements, got {text}")
    return int(value)


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to fd 1 meanwhile (DeepSpeed's logger and op-builder prints, C code, spawned
    children) to stderr, so that stdout carries the report alone and ``--json`` output parses."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


READING_THE_PROBE = """\
what the win is worth in time (your own run, not a model):
  This script sizes the bytes and the modelled time of the reduction. A step
  saves time only where it waits for the reduction. To measure that wait, run a
  few steps with compile.reduce_probe true and reduce_to_owner false. After the
  8th step, rank 0 prints one line per step 2 to 7, e.g. (bash scripts/demo.sh,
  4 gloo ranks on a loaded CPU host: gloo's milliseconds, not a GPU's):

    [dc-probe][r0] step 3: reduction 51.1 ms, exposed 16.8 ms (33%) of a
    76.2 ms step (most exposed: rank 0); the owner path saves up to 1.4 ms of
    it (modelled)

  reduction: from the first flush's start to the last flush's end.
  exposed: the part after the backward's compute ended; the step waits for it.
  (33%): the exposed share of the reduction.
  step: from the previous step's reduction end to this one's.
  The numbers are those of the rank with the most exposed time.
  saves up to: the exposed time, cut by flush, times what the cost model says
  the owner path saves on each of those flushes. It is a model's number.
  Near 0 exposed: the reduction is hidden; the owner path saves little time.
  With reduce_to_owner true, the same lines say "measured on the owner path",
  or "on native's calls" for the measured guard's trial steps: compare them.
  On a GPU the times come from CUDA events, read a step later without waiting.
  On CPU they come from the host clock, where every flush blocks the backward.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=READING_THE_PROBE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m",
                        help=f"a preset ({', '.join(PRESETS)}) or module:factory returning an nn.Module")
    parser.add_argument("--world-size", type=int, nargs="+", default=[8], help="data-parallel world size(s)")
    parser.add_argument("--bucket-size", type=_elements, nargs="+",
                        default=[DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE // 10],
                        help="reduce bucket size(s) in elements (default: DeepSpeed's 5e8, and 5e7)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="gradient dtype for bytes")
    parser.add_argument("--vocab", type=int, default=None,
                        help="preset vocabulary size (default the preset's: GPT-2 50257, Llama-2 32000)")
    head = parser.add_mutually_exclusive_group()
    head.add_argument("--untied-head", action="store_true",
                      help="preset with a separate LM head (Llama presets have one already)")
    head.add_argument("--tied-head", action="store_true",
                      help="preset whose LM head shares the token embedding (GPT presets do already)")
    parser.add_argument("--param-groups", choices=list(GROUPINGS), default="one",
                        help="optimizer parameter groups: " + "; ".join(f"{k}: {v}" for k, v in GROUPINGS.items()))
    parser.add_argument("--exact-engine", action="store_true",
                        help="build a real ZeRO-1 engine (uninitialized bf16 weights) instead of the meta layout: "
                             "the reference, far slower and larger")
    cluster = parser.add_argument_group("the cluster modelled (default: 8 Hopper GPUs per node on NVSwitch, NVLS)")
    cluster.add_argument("--ranks-per-node", type=int, default=8, help="GPUs (ranks) per node (default 8)")
    cluster.add_argument("--gpu-generation", choices=("hopper", "ampere"), default="hopper",
                         help="NCCL's tuning constants for this generation (default hopper)")
    cluster.add_argument("--nvlinks", type=int, default=None, metavar="N",
                         help="NVLinks per GPU (default: the generation's: 18 on Hopper, 12 on Ampere as the A100 "
                              "SXM; the A800 has 8)")
    cluster.add_argument("--no-nvls", dest="nvls", action="store_false",
                         help="no NVSwitch multicast: native's AllReduce without NVLS / NVLS_TREE (any Ampere "
                              "cluster; Hopper without NVLS)")
    cluster.add_argument("--rail-without-same-channels", dest="rail_same_channels", action="store_false",
                         help="NCCL's protocol choice for a two-level flush's rail calls as if the rail's ring graph "
                              "had no sameChannels: its table then charges a rail Reduce the hop per rank that the "
                              "time always pays here, and picks LL128 where the chain's latency matters (NCCL's "
                              "search gives a one-GPU-per-node rail sameChannels, so its table picks Simple there)")
    cluster.add_argument("--calibration", metavar="FILE", default=None,
                         help="call times measured on your cluster by scripts/calibrate.py, in place of NCCL's "
                              "tables")
    cluster.add_argument("--handoff-sensitivity", action="store_true",
                         help="also size every bucket with the hand-off at 0.5x and 0.25x its modelled network "
                              "bandwidth (how much each row depends on it)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write the plan per flush (what native and reduce_to_owner issue, in NCCL groups, and "
                             "their modelled times) to FILE ('-': stdout); one JSON object per world size and "
                             "bucket, a list when there are several")
    parser.add_argument("--report-json", action="store_true",
                        help="print the whole report as JSON instead of the text report")
    parser.add_argument("--summary", action="store_true",
                        help="print one markdown row per world size and bucket (step time against native before and "
                             "after the per-flush choice, the worst flush) instead of the text report")
    parser.add_argument("--check-published", action="store_true",
                        help="also model the published 8x A800 measurement (GPT-2 350M untied-head tensors)")
    parser.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.world_size):
        parser.error("--world-size must be at least 1")
    if args.ranks_per_node < 1:
        parser.error("--ranks-per-node must be at least 1")
    if args.nvlinks is not None and args.nvlinks < 1:
        parser.error(f"--nvlinks must be at least 1, got {args.nvlinks}")
    if args.gpu_generation != "hopper" and args.nvls:
        args.nvls = False  # NVLS exists from Hopper on (search.cc): Ampere has none to turn off
    tied = True if args.tied_head else False if args.untied_head else None
    if args.model not in PRESETS and (args.vocab is not None or tied is not None):
        parser.error(f"--vocab, --untied-head and --tied-head apply to presets ({', '.join(PRESETS)}) only, "
                     f"not to {args.model}")
    try:
        args.spec = ModelSpec(args.model, vocab_size=args.vocab, tied_head=tied, param_groups=args.param_groups)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_presets:
        for name, config in PRESETS.items():
            print(f"{name:10} {describe_preset(config)}")
        return 0
    calibration = None
    if args.calibration:
        from owner_reduce.planning.calibration import load_calibration

        try:
            calibration = load_calibration(args.calibration)
            for ws in args.world_size:
                calibration.check_world_size(ws)
        except (OSError, ValueError) as exc:
            print(f"size_the_win.py: error: --calibration {args.calibration}: {exc}", file=sys.stderr)
            return 2
    cluster = Cluster(args.ranks_per_node, args.gpu_generation, args.nvls, calibration=calibration,
                      rail_same_channels=args.rail_same_channels, nvlinks=args.nvlinks)
    sensitivity = HANDOFF_SENSITIVITY if args.handoff_sensitivity else ()
    sizer = size_model if len(args.world_size) == 1 else size_in_subprocess
    with _stdout_to_stderr():
        reports = [sizer(args.spec, ws, args.bucket_size, args.dtype, args.exact_engine, cluster, sensitivity)
                   for ws in args.world_size]
        published = (check_published_in_subprocess(exact_engine=args.exact_engine) if args.check_published
                     else None)
    wall = time.perf_counter() - _START
    if args.json:
        plans = [plan for r in reports for plan in plan_to_dicts(r)]
        text = json.dumps(plans[0] if len(plans) == 1 else plans, indent=1)
        if args.json == "-":
            print(text)
            return 0
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
        print(f"plan of {len(plans)} world size / bucket pair(s) written to {args.json}", file=sys.stderr)
    if args.report_json:
        data: dict = {"reports": [report_to_dict(r) for r in reports], "wall_seconds": wall}
        if published is not None:
            data["published_check"] = {"model": published[0], "variants": [
                dict(dataclasses.asdict(c), ratio=c.ratio, measured_ratio=c.measured_ratio) for c in published[1]]}
        print(json.dumps(data, indent=2))
    elif args.summary:
        print(summary_header(sensitivity))
        for report in reports:
            print("\n".join(format_summary_rows(report, args.model)))
        print("\n(alpha-beta model, NCCL 2.30 group planning; ratios against native DeepCompile: one AllReduce per "
              f"gradient in one group per flush; wall time "
              f"{wall:.1f} s)")
        for report in reports:  # the topology each world size was costed on (the one the runtime would agree on)
            names = sorted({b.topology for b in report.buckets if b.topology})
            print(f"ws {report.world_size}: {'; '.join(names) or 'one rank, nothing to reduce'}")
    else:
        print("\n\n".join(format_report(r) for r in reports))
        if published is not None:
            print("\n" + "\n\n".join(format_published_check(c, published[0]) for c in published[1]))
        print(f"\nwall time: {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
