"""The main job: DeepCompile ZeRO-1 on CPU gloo ranks, trained twice on the same data, AllReduce path then owner path.

Both runs use owner_reduce's runtime (the native DeepCompile runtime does not build on CPU); the first with
``reduce_to_owner`` off (every gradient AllReduced, as DeepCompile does), the second with it on. The probe is on
in both. Writes two plots and a JSON summary under --out and prints a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: owner_reduce, harness/, research/


def _per_step(results: list[dict[str, Any]], key: str) -> list[float]:
    return [sum(r[key][i] for r in results) / len(results) for i in range(len(results[0][key]))]


def _flush_bytes(results: list[dict[str, Any]]) -> list[list[int]]:
    """Bytes delivered to each rank in each flush: [rank][flush]."""
    return [[f.received_elems * f.element_size for f in r["flush_log"]] for r in results]


def _algos(flush_log: list[Any]) -> dict[str, int]:
    """Flushes per algorithm (the probe's ``algo=``), most frequent first."""
    counts: dict[str, int] = {}
    for f in flush_log:
        counts[f.algo] = counts.get(f.algo, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _calls_per_flush(flush_log: list[Any]) -> float:
    return sum(f.calls for f in flush_log) / len(flush_log) if flush_log else 0.0


def summarize(runs: dict[str, list[dict[str, Any]]], steps: int) -> dict[str, Any]:
    loss = {name: _per_step(results, "losses") for name, results in runs.items()}
    diffs = [abs(a - b) for a, b in zip(loss["allreduce"], loss["owner"], strict=True)]
    rel = [d / abs(b) for d, b in zip(diffs, loss["allreduce"], strict=True) if b]
    out: dict[str, Any] = {
        "init_line": runs["owner"][0]["stats"].init_line,
        "steps": steps,
        "world_size": len(runs["owner"]),
        "max_abs_loss_diff": max(diffs),
        "max_rel_loss_diff": max(rel) if rel else 0.0,
        "max_abs_loss_diff_first_10": max(diffs[:10]),
        "final_loss": {name: values[-1] for name, values in loss.items()},
        "loss_curves": loss,
    }
    for name, results in runs.items():
        per_rank = _flush_bytes(results)
        flushes = [f for r in results for f in r["flush_log"]]
        out[name] = {
            "bytes_per_rank_per_step": [sum(b) / steps for b in per_rank],
            "calls_per_flush": sum(f.calls for f in flushes) / len(flushes),
            # steady state: the last step (after the measured guard's trial when the run is long enough)
            "calls_per_flush_last_step": _calls_per_flush(results[0]["flush_log"][
                -len(results[0]["flush_log"]) // steps:]),
            "measured_lines": list(results[0]["stats"].measured_lines),
            "owner_share": sum(f.owner_elems for f in flushes) / sum(f.reduced_elems for f in flushes),
            "kept_share": sum(f.kept_elems for f in flushes) / sum(f.received_elems for f in flushes),
            "flushes_per_rank": len(results[0]["flush_log"]),
            "algos": _algos(results[0]["flush_log"]),
            "algos_last_step": _algos(results[0]["flush_log"][-len(results[0]["flush_log"]) // steps:]),
        }
    total = {name: sum(out[name]["bytes_per_rank_per_step"]) for name in runs}
    out["bytes_saved_share"] = 1 - total["owner"] / total["allreduce"]
    return out


def plot(runs: dict[str, list[dict[str, Any]]], summary: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, label in (("allreduce", "AllReduce path"), ("owner", "owner path (reduce_to_owner)")):
        ax.plot(summary["loss_curves"][name], label=label, linestyle="-" if name == "allreduce" else "--")
    ax.set_xlabel("micro-step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(f"DeepCompile ZeRO-1, {summary['world_size']} gloo ranks: max |loss diff| "
                 f"{summary['max_abs_loss_diff']:.2e}")
    ax.legend()
    loss_png = out / "loss_curves.png"
    fig.tight_layout()
    fig.savefig(loss_png, dpi=110)
    plt.close(fig)

    # One training step in steady state (the last one): each flush, the KiB each rank received.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, (name, label) in zip(axes, (("allreduce", "AllReduce path"), ("owner", "owner path")), strict=True):
        per_rank = _flush_bytes(runs[name])
        per_step = summary[name]["flushes_per_rank"] // summary["steps"]
        width = 0.8 / len(per_rank)
        for rank, values in enumerate(per_rank):
            last = values[-per_step:]
            ax.bar([i + rank * width for i in range(per_step)], [v / 1024 for v in last], width, label=f"rank {rank}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(per_step)], [f"flush {i + 1}" for i in range(per_step)])
        ax.set_title(f"{label}: {sum(summary[name]['bytes_per_rank_per_step']) / 1024:.0f} KiB/step, all ranks")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("KiB delivered to the rank (last step)")
    bytes_png = out / "bytes_per_flush.png"
    fig.tight_layout()
    fig.savefig(bytes_png, dpi=110)
    plt.close(fig)
    return [loss_png, bytes_png]


def _algo_text(algos: dict[str, int]) -> str:
    return ", ".join(f"{a} x{n}" for a, n in algos.items())


def print_table(summary: dict[str, Any]) -> None:
    a, o = summary["allreduce"], summary["owner"]
    rows = [
        ("bytes delivered per rank per step (mean)",
         f"{sum(a['bytes_per_rank_per_step']) / summary['world_size']:,.0f}",
         f"{sum(o['bytes_per_rank_per_step']) / summary['world_size']:,.0f}"),
        ("share of delivered elements kept", f"{a['kept_share']:.1%}", f"{o['kept_share']:.1%}"),
        ("share of reduced elements on the owner path", f"{a['owner_share']:.1%}", f"{o['owner_share']:.1%}"),
        ("collective calls per flush, whole run", f"{a['calls_per_flush']:.2f}", f"{o['calls_per_flush']:.2f}"),
        ("collective calls per flush, last step", f"{a['calls_per_flush_last_step']:.2f}",
         f"{o['calls_per_flush_last_step']:.2f}"),
        ("flush algorithm, one step (model's choice)", _algo_text(a["algos_last_step"]),
         _algo_text(o["algos_last_step"])),
        ("final loss (mean over ranks)", f"{summary['final_loss']['allreduce']:.6f}",
         f"{summary['final_loss']['owner']:.6f}"),
    ]
    width = max(16, *(len(x) for _, x, _ in rows), *(len(y) for _, _, y in rows))
    print(f"{'':45}   {'AllReduce path':>{width}}   {'owner path':>{width}}")
    for name, x, y in rows:
        print(f"{name:45}   {x:>{width}}   {y:>{width}}")
    print(f"bytes saved: {summary['bytes_saved_share']:.1%}; max |loss diff| {summary['max_abs_loss_diff']:.3e} "
          f"(relative {summary['max_rel_loss_diff']:.3e}) over {summary['steps']} steps, "
          f"{summary['max_abs_loss_diff_first_10']:.1e} in the first 10")
    print("(different data per rank: the two paths sum in different orders, like any change of NCCL algorithm; "
          "see docs/reduce_to_owner.md, Numerics)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dim", type=int, default=48)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=20000, help="reduce_bucket_size in elements")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (the acceptance script's)")
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from harness.launch import run_ranks
    from harness.toy_training import TrainSpec, train

    args.out.mkdir(parents=True, exist_ok=True)
    base = TrainSpec(model="tiny_transformer", model_kwargs=(("dim", args.dim), ("layers", args.layers)),
                     steps=args.steps, same_data=False, reduce_probe=True, probe_all_ranks=False,
                     record_collectives=True, progress=True, reduce_bucket_size=args.bucket_size, micro_batch=4,
                     lr=args.lr)
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, owner in (("allreduce", False), ("owner", True)):
        print(f"== DeepCompile ZeRO-1, {args.world_size} gloo ranks, {args.steps} steps, "
              f"reduce_to_owner={str(owner).lower()} reduce_probe=true", flush=True)
        start = time.monotonic()
        runs[name] = run_ranks(train, args.world_size, args=(TrainSpec(**{**base.__dict__, "reduce_to_owner": owner}),),
                               timeout=args.timeout)
        print(f"   {time.monotonic() - start:.1f}s", flush=True)
    summary = summarize(runs, args.steps)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    pngs = plot(runs, summary, args.out)
    print()
    print(summary["init_line"])
    print(runs["owner"][0]["stats"].settings_line)
    for line in runs["owner"][0]["stats"].schedule_lines + runs["owner"][0]["stats"].measured_lines:
        print(line)
    for line in runs["owner"][0]["stats"].probe_lines[:3]:
        print(line)
    # The probe's step summary (rank 0, after the 8th step; none in a shorter run): the AllReduce run is a probe-only
    # run, whose lines add the owner path's modelled saving; the owner run's say what was measured, and on which calls.
    for name in ("allreduce", "owner"):
        lines = runs[name][0]["stats"].exposure_lines
        if lines:
            print(f"step summary, {'probe only' if name == 'allreduce' else 'owner path on'}:")
            for line in lines:
                print(line)
    print()
    print_table(summary)
    print(f"wrote {', '.join(str(p) for p in [*pngs, args.out / 'summary.json'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
