"""Issue 40's case: a checkpoint saved during the measured guard's trial, on 3 gloo ranks.

Different data per rank, a 24-wide tied LM, bucket 700 elements, bf16 with ``check_grad_overflow``, gradient
accumulation 2, clipping that triggers, an inf injected on step 2 (rank 0), the guard on, ``save_checkpoint`` after
step ``--save-at`` of 8. Per ZeRO stage three launches of fresh ranks: the run that saves, the same run without the
save, and the run resumed from the checkpoint (``load_checkpoint``, then ``engine.compile(schedule=[(global_steps,
[reduce pass])])``). Prints, per stage, each run's verdicts (rank 0's measured lines) and where the runs' bits differ.

    .venv/bin/python scripts/checkpoint_trial_repro.py [--stages 1 2] [--save-at 3] [--no-guard] [--fixed]
        [--drop-trial-state]

The guard's samples are the host clock's (as in the product) unless ``--fixed``: then every rank's samples are fixed
(``harness.fixed_samples``) and close, the case of ``tests/processes/test_checkpoint_trial_e2e.py``. On the host
clock whether two runs decide alike depends on the machine's load; where a resumed trial's own samples decide otherwise
than the saving run's, rank 0 says so (the "within the noise" warning). ``--drop-trial-state``: the resumed run drops
the checkpoint's trial under way where the runtime reads it (``harness.faults``), as every run did before issue 40.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: owner_reduce, harness/, research/

from harness.launch import run_ranks  # noqa: E402
from harness.toy_training import TrainSpec, train_each  # noqa: E402

WS = 3
STEPS = 8


# --fixed: per rank, per trial flush (the model's samples by round, native's), us; flush 1 close with native ahead,
# flush 2 within the noise, flush 3 the model's (the samples of tests/processes/test_checkpoint_trial_e2e.py)
FIXED = ((([30, 24, 26], [21, 22, 23]), ([10, 30, 12], [11, 9, 10.5]), ([10, 10, 11], [20, 21, 20])),
         (([29, 25, 27], [22, 23, 22]), ([10, 30, 12], [11, 9, 10.5]), ([10, 10, 11], [20, 21, 20])),
         (([28, 25, 26], [22, 21, 23]), ([10, 30, 12], [11, 9, 10.5]), ([10, 10, 11], [20, 21, 20])))


def fixed_samples() -> tuple:
    return tuple(tuple(((flush, variant, k), us) for flush, pair in enumerate(rank)
                       for variant, samples in enumerate(pair) for k, us in enumerate(samples)) for rank in FIXED)


def spec(stage: int, directory: str, save_at: int, **changes) -> TrainSpec:
    base = dict(mode="owner", model="tied_lm", model_kwargs=(("dim", 24),), zero_stage=stage, steps=STEPS,
                grad_accum=2, same_data=False, bf16=True, check_grad_overflow=True, gradient_clipping=0.05,
                inf_at=(2, 0), reduce_probe=False, reduce_bucket_size=700, checkpoint_dir=directory,
                compile_keys=(("reduce_to_owner_timeout_s", 60),))  # ranks that diverge fail within a minute
    if changes.pop("saving", False):
        base["save_at"] = save_at
    return TrainSpec(**{**base, **changes})


def differences(a: tuple, b: tuple, first_step: int, grad_accum: int = 2) -> list[str]:
    out = []
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        xl, yl = x["losses"][first_step * grad_accum:], y["losses"]
        bad = next((i for i, (u, v) in enumerate(zip(xl, yl, strict=True)) if u != v), None)
        if bad is not None:
            out.append(f"rank {rank}: loss {xl[bad]:.6f} vs {yl[bad]:.6f} at micro-step "
                       f"{first_step * grad_accum + bad + 1}")
        xn, yn = x["grad_norms"][first_step:], y["grad_norms"]
        bad = next((i for i, (u, v) in enumerate(zip(xn, yn, strict=True)) if u != v), None)
        if bad is not None:
            out.append(f"rank {rank}: grad norm {xn[bad]:.6f} vs {yn[bad]:.6f} at step {first_step + bad + 1}")
        worst = max(((x["params"][n] - p).abs().max().item(), n) for n, p in y["params"].items())
        if worst[0]:
            out.append(f"rank {rank}: parameters up to {worst[0]:.3e} apart ({worst[1]})")
    return out


def verdict_lines(run: tuple) -> list[str]:
    return [line.split("graph ", 1)[1] for line in run[0]["stats"].measured_lines]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--no-guard", action="store_true",
                        help='compile.reduce_to_owner_algo "model" for every run (the measured guard off)')
    parser.add_argument("--fixed", action="store_true", help="fixed, close guard samples instead of the host clock")
    parser.add_argument("--drop-trial-state", action="store_true",
                        help="the resumed run drops the checkpoint's trial under way (the behaviour before issue 40)")
    args = parser.parse_args()
    extra = {"trial_samples": fixed_samples()} if args.fixed else {}
    if args.no_guard:
        extra["flush_algo"] = "model"
    failures = 0
    for stage in args.stages:
        directory = tempfile.mkdtemp(prefix=f"issue40-z{stage}-")
        runs = {}
        for name, changes in (("saving", {"saving": True}), ("not saving", {}),
                              ("resumed", {"resume": True, "load_before_compile": True,
                                           "compile_at_loaded_step": True,
                                           "inject_fault": "drop_trial_state" if args.drop_trial_state else None})):
            by_rank = run_ranks(train_each, WS, args=((spec(stage, directory, args.save_at, **changes, **extra),),),
                                timeout=600)
            runs[name] = tuple(r[0] for r in by_rank)
        print(f"stage {stage}, save after step {args.save_at} of {STEPS}, guard {'off' if args.no_guard else 'on'}, "
              f"samples {'fixed' if args.fixed else 'of the host clock'}:")
        for name, run in runs.items():
            s = run[0]["stats"]
            print(f"  {name}: trials decided {s.trials_decided}, replayed {s.trials_replayed}, trial steps "
                  f"{s.trial_steps}, trials resumed {getattr(s, 'trials_resumed', 'n/a')}; verdicts: "
                  f"{verdict_lines(run) or 'none'}" + "".join(f"\n    rank 0 warned: {line}"
                                                              for line in getattr(s, "close_lines", ())))
        for what, a, b, first in (("saving vs not saving", runs["not saving"], runs["saving"], 0),
                                  ("resumed vs saving", runs["saving"], runs["resumed"], args.save_at)):
            diff = differences(a, b, first)
            failures += bool(diff)
            print(f"  {what}: " + ("bitwise equal" if not diff else "DIFFER: " + "; ".join(diff)))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / ".venv" /
                                                      "torch_extensions"))
    raise SystemExit(main())
