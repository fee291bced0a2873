"""The main job: a CPU demo on several gloo ranks with real DeepSpeed ZeRO-1.

Today it prints the owner-map report of a small transformer-like model: the init line, where each
gradient goes, and a check that every rank derived the same map and that it agrees with the optimizer.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def _report(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import deepspeed
    import deepspeed.comm as dist
    import torch

    import owner_reduce
    from owner_reduce.engine_tables import disagreements_with_optimizer
    from owner_reduce.toy_models import TinyTransformer

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.manual_seed(0)
    model = TinyTransformer(dim=args.dim, layers=args.layers)
    owner_reduce.install()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1_000_000,
              "compile": {"deepcompile": True, "reduce_to_owner": True, "reduce_probe": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                                      config=config)
    owner_map = owner_reduce.build_owner_map(engine)
    digests = [None] * world_size
    dist.all_gather_object(digests, owner_map.digest())
    names = {engine.optimizer.get_param_id(p): n for n, p in model.named_parameters()}
    rows = [(names[p.param_id], p.numel, p.placement.value, " ".join(f"[{s.offset}:+{s.length}]->r{s.owner}"
                                                                      for s in p.slices)) for p in owner_map]
    return {"summary": owner_map.summary(), "digests": digests, "rows": rows, "share": owner_map.owner_share(),
            "problems": disagreements_with_optimizer(owner_map, engine)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--dim", type=int, default=48)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from owner_reduce.launch import run_ranks

    start = time.monotonic()
    results = run_ranks(_report, args.world_size, args=(args,), timeout=args.timeout)
    first = results[0]
    print(first["summary"])
    width = max(len(name) for name, *_ in first["rows"])
    print(f"{'parameter':<{width}}  {'elements':>9}  {'placement':<10} slices -> owner rank")
    for name, numel, kind, slices in first["rows"]:
        print(f"{name:<{width}}  {numel:>9}  {kind:<10} {slices}")
    print(f"elements in single-owner gradients: {first['share']:.1%}")
    agree = all(r["digests"] == [first["digests"][0]] * args.world_size for r in results)
    problems = [p for r in results for p in r["problems"]]
    print(f"ranks agree on the map: {'yes' if agree else 'NO'} (digest {first['digests'][0][:16]}); "
          f"map matches each rank's optimizer: {'yes' if not problems else 'NO'}")
    for p in problems:
        print(f"  {p}")
    print(f"{args.world_size} gloo ranks, {time.monotonic() - start:.1f}s")
    return 0 if agree and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
