"""Size the win of reduce_to_owner for a model and world size, on a CPU box, with DeepSpeed's own partitioning.

Builds a real DeepSpeed ZeRO-1 engine as rank 0 of N in torch's fake process group (no GPU, no other
processes), reads the owner map from its partition tables, and prints the init line, the share of elements
on the owner path, bytes delivered per rank per step, collective calls per bucket flush and the ring-model
time ratio. Examples::

    python scripts/size_the_win.py --model gpt2-124m --world-size 8 64
    python scripts/size_the_win.py --model 1b --world-size 8 --json
    python scripts/size_the_win.py --model mypkg.models:make_model --world-size 16
    python scripts/size_the_win.py --world-size 8 64 512 --check-published

Time estimates: calls per flush today (arrival order), with the owner-ordered bucket, and natively, each
timed with NCCL's alpha-beta tuning model (owner_reduce/planning/collective_time.py) on a named topology:
one 8-GPU NVLink node up to ws 8, nodes of 8 GPUs over a network above. ``--check-published`` also models
the one published measurement (8x A800 NVLink, 806 MB bf16, one collective per parameter).

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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from owner_reduce.offline_sizing.fake_engine import (  # noqa: E402
    ModelSpec,
    check_published_in_subprocess,
    size_in_subprocess,
    size_model,
)
from owner_reduce.offline_sizing.gpt_presets import PRESETS, describe  # noqa: E402
from owner_reduce.planning.sizing import (  # noqa: E402
    DEFAULT_BUCKET_SIZE,
    DTYPE_BYTES,
    format_published_check,
    format_report,
    report_to_dict,
)


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m",
                        help=f"a preset ({', '.join(PRESETS)}) or module:factory returning an nn.Module")
    parser.add_argument("--world-size", type=int, nargs="+", default=[8], help="data-parallel world size(s)")
    parser.add_argument("--bucket-size", type=_elements, nargs="+",
                        default=[DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE // 10],
                        help="reduce bucket size(s) in elements (default: DeepSpeed's 5e8, and 5e7)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="gradient dtype for bytes")
    parser.add_argument("--vocab", type=int, default=None, help="preset vocabulary size (default GPT-2's 50257)")
    parser.add_argument("--untied-head", action="store_true", help="preset with a separate LM head")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the text report")
    parser.add_argument("--check-published", action="store_true",
                        help="also model the published 8x A800 measurement (GPT-2 350M untied-head tensors)")
    parser.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.world_size):
        parser.error("--world-size must be at least 1")
    if (args.vocab is not None or args.untied_head) and args.model not in PRESETS:
        parser.error("--vocab and --untied-head apply to presets only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_presets:
        for name, config in PRESETS.items():
            print(f"{name:10} {describe(config)}")
        return 0
    spec = ModelSpec(args.model, vocab_size=args.vocab, tied_head=not args.untied_head)
    sizer = size_model if len(args.world_size) == 1 else size_in_subprocess
    with _stdout_to_stderr():
        reports = [sizer(spec, ws, args.bucket_size, args.dtype) for ws in args.world_size]
        published = check_published_in_subprocess() if args.check_published else None
    wall = time.perf_counter() - _START
    if args.json:
        data: dict = {"reports": [report_to_dict(r) for r in reports], "wall_seconds": wall}
        if published is not None:
            data["published_check"] = {"model": published[0], "variants": [
                dict(dataclasses.asdict(c), ratio=c.ratio, measured_ratio=c.measured_ratio) for c in published[1]]}
        print(json.dumps(data, indent=2))
    else:
        print("\n\n".join(format_report(r) for r in reports))
        if published is not None:
            print("\n" + "\n\n".join(format_published_check(c, published[0]) for c in published[1]))
        print(f"\nwall time: {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
