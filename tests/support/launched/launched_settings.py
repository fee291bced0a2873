"""Runs started by DeepSpeed's own launcher (``deepspeed --module owner_reduce.run launched_settings.py``) for
``test_settings_e2e.py``: each run a ``TrainSpec`` whose DeepSpeed config is a JSON file (``config_file``), one after
the other in one process group (each owner engine destroyed before the next). Each rank writes what it saw: its
command line and ``LOCAL_RANK`` (the launcher puts ``--local_rank=N`` right after the script's name), whether
DeepSpeed's config parsing takes every owner run's config file before any run (only after ``owner_reduce.install()``,
which ``owner_reduce.run`` made in this process: ``harness.toy_training.train`` installs it again later), the
``OWNER_REDUCE_*`` variables in its environment (the test scrubs them: none) and each run's results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

GROUP_TIMEOUT_S = 900  # deepspeed.init_distributed(timeout=...): the deadline owner_reduce takes (no key of its own)


def _accepts(path: str) -> bool:
    """Whether DeepSpeed's config parsing takes this config file (its ``compile`` keys: only after install())."""
    from deepspeed.runtime.config import DeepSpeedConfig

    with open(path) as f:
        config = json.load(f)
    try:
        DeepSpeedConfig(config)
    except ValueError:
        return False
    return True


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

    from harness.toy_training import TrainSpec, train

    rank, world_size = dist.get_rank(), dist.get_world_size()
    runs = json.loads(args.runs)
    results = {"world_size": world_size, "runs": {}, "argv": sys.argv, "local_rank_arg": args.local_rank,
               "env_local_rank": os.environ.get("LOCAL_RANK"),
               "keys_accepted": [_accepts(fields["config_file"]) for _, fields in runs if fields.get("config_file")],
               "owner_reduce_env": sorted(k for k in os.environ if k.startswith("OWNER_REDUCE_"))}
    for name, fields in runs:
        results["runs"][name] = train(rank, world_size, TrainSpec(**fields))
    os.makedirs(args.out, exist_ok=True)
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
