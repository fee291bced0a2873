"""Runs started by DeepSpeed's own launcher (``deepspeed --module owner_reduce.run launched_settings.py``) for
``test_settings_e2e.py``: each run a ``TrainSpec`` whose DeepSpeed config is a JSON file (``config_file``), one after
the other in one process group (each owner engine destroyed before the next). Each rank writes what it saw: the
``OWNER_REDUCE_*`` variables in its environment (the test scrubs them: none) and each run's results."""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

GROUP_TIMEOUT_S = 900  # deepspeed.init_distributed(timeout=...): the deadline owner_reduce takes (no key of its own)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="JSON: [[name, {TrainSpec fields}], ...]")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None, help="set by DeepSpeed's launcher")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    import deepspeed.comm as dist

    from owner_reduce.harness.toy_training import TrainSpec, train

    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {"world_size": world_size, "runs": {},
               "owner_reduce_env": sorted(k for k in os.environ if k.startswith("OWNER_REDUCE_"))}
    for name, fields in json.loads(args.runs):
        results["runs"][name] = train(rank, world_size, TrainSpec(**fields))
    os.makedirs(args.out, exist_ok=True)
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
