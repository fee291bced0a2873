"""Benchmark of the Python runtime on CPU: host cost per reduce_grad and per flush, and end-to-end step time.

Prints, from one run (each configuration trains on --world-size gloo ranks with the same model and data):
- host time of one ``owner_reduce::reduce_grad`` op call (dispatch + body, no communication), median;
- host time per reduce_grad inside training (body without flushes) and per flush (with its collectives), median;
- median step time of DeepCompile + owner_reduce (owner path), of DeepCompile + owner_reduce with the owner path
  off (AllReduce, as the native runtime does), and of plain ZeRO-1, as ratios.
CPU numbers say what the Python runtime costs on the host; collective speed here is gloo's, not NCCL's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _op_call_cost(iterations: int) -> tuple[float, float]:
    """Median µs of one reduce_grad op call with a runtime that does nothing, and of a bare Python call."""
    import torch

    from owner_reduce.wiring import ops

    class Null:
        def reduce_grad(self, grad: torch.Tensor, graph_id: int, ds_id: int) -> None:
            pass

    ops.set_active_runtime(Null())
    grad = torch.randn(64)
    samples, bare = [], []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        ops.REDUCE_GRAD(grad, 1, 1)
        samples.append(time.perf_counter_ns() - start)
        start = time.perf_counter_ns()
        Null().reduce_grad(grad, 1, 1)
        bare.append(time.perf_counter_ns() - start)
    ops.set_active_runtime(None)
    return statistics.median(samples) / 1e3, statistics.median(bare) / 1e3


def _median_step(results: list, skip: int) -> float:
    steps = range(skip, len(results[0]["step_times"]))
    return statistics.median(max(r["step_times"][i] for r in results) for i in steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time median")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from owner_reduce.harness.launch import run_ranks
    from owner_reduce.harness.toy_training import TrainSpec, train

    op_us, bare_us = _op_call_cost(20000)
    base = TrainSpec(model="tiny_transformer", model_kwargs=(("dim", args.dim), ("layers", args.layers)),
                     steps=args.steps, backend=args.backend, micro_batch=8)
    # Both DeepCompile runs keep the probe on (first 20 flushes print): with both flags off DeepSpeed would run
    # its native runtime, which does not build on CPU.
    runs = {}
    for name, spec in (("plain", TrainSpec(**{**base.__dict__, "mode": "plain"})),
                       ("allreduce", TrainSpec(**{**base.__dict__, "reduce_to_owner": False, "time_runtime": True})),
                       ("owner", TrainSpec(**{**base.__dict__, "time_runtime": True}))):
        start = time.monotonic()
        runs[name] = run_ranks(train, args.world_size, args=(spec,), timeout=args.timeout)
        print(f"[bench] {name}: {time.monotonic() - start:.1f}s wall", file=sys.stderr, flush=True)

    owner = runs["owner"]
    rg = [t for r in owner for t in r["timings"]["reduce_grad_ns"]]
    fl = [t for r in owner for t in r["timings"]["flush_ns"]]
    fl_all = [t for r in runs["allreduce"] for t in r["timings"]["flush_ns"]]
    stats = owner[0]["stats"]
    step = {name: _median_step(results, args.warmup) for name, results in runs.items()}
    print("=" * 100)
    print(owner[0]["summary"])
    print(f"world size {args.world_size}, tiny transformer dim={args.dim} layers={args.layers}, "
          f"backend={args.backend}, {args.steps} steps "
          f"(median over steps {args.warmup}..{args.steps - 1}, slowest rank per step)")
    print(f"reduce_grad op call, null runtime:      {op_us:8.1f} us  (bare Python method call {bare_us:.2f} us)")
    print(f"reduce_grad in training, no flush:      {statistics.median(rg) / 1e3:8.1f} us  (n={len(rg)})")
    print(f"flush, owner path (incl. collectives):  {statistics.median(fl) / 1e3:8.1f} us  (n={len(fl)}, "
          f"{stats.collectives / stats.flushes:.1f} calls/flush)")
    print(f"flush, AllReduce path:                  {statistics.median(fl_all) / 1e3:8.1f} us  (n={len(fl_all)})")
    print(f"owner share of reduced elements:        {stats.owner_elems / stats.reduced_elems:8.1%}")
    print(f"step time plain ZeRO-1:                 {step['plain'] * 1e3:8.2f} ms")
    print(f"step time DeepCompile + AllReduce path: {step['allreduce'] * 1e3:8.2f} ms")
    print(f"step time DeepCompile + owner path:     {step['owner'] * 1e3:8.2f} ms")
    print(f"ratio owner / plain ZeRO-1:             {step['owner'] / step['plain']:8.3f}")
    print(f"ratio owner / AllReduce path:           {step['owner'] / step['allreduce']:8.3f}")
    print(f"ratio flush owner / AllReduce:          {statistics.median(fl) / statistics.median(fl_all):8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
