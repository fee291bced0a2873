"""Why the one published grouped measurement is missed by half: each candidate cause costed on it (issue 39).

The measurement: 8x A800 over NVLink, 806 MB of bf16 gradients, one collective per parameter in one group:
AllReduce 22.72 ms, reduce-to-owner 18.43 ms; NCCL 2.30's tuner model (``collective_time.group_time_us``) gives about
half. The same tables predict single-call nccl-tests results within about 17%, so what is missing is per call or
per aggregate. Three candidates, each costed on both measurements from its source, none tuned:

- (a) the host's issue per call (``host_cost``): NCCL launches the group's kernel after every call is enqueued, so
  the issue adds to the device time. From the sources the model charges nothing for NCCL's enqueue or a C++ loop
  (no number), and this runtime's Python 2.5 us per call. The check reports the per-call cost that would close each
  gap, and how one such constant fits both;
- (b) how NCCL 2.30 plans the group (``nccl_plan``): kernels, work batches, works, and where the works land on the
  channels; the model then charged channel by channel (``nccl_plan.channel_time_us``). The check reports the
  per-work device overhead on the busiest channel that would close each gap, and how one such constant fits both;
- (c) small-call bandwidth: the calls under 64 KiB (biases and norms) each at its own single-call time, as if NCCL
  aggregated nothing (an upper bound: every small task at its own algorithm, protocol and channels' latency), and
  every call alone.

And, for reference, the measured / modelled ratio of each: a cost in proportion to the bytes would fit both alike,
but no source gives one.
Pure: numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from owner_reduce.planning.collective_time import Topology, best_algo, group_time_us
from owner_reduce.planning.host_cost import DEFAULT, HostCost

from .nccl_plan import channel_time_us, plan_group

SMALL_BYTES = 64 << 10  # (c): a call this small is latency-bound on any of the tables' protocols
NCCL_TESTS_ONE_CHANNEL_US = 33.7  # nccl-tests issue 123: 8-GPU DGX A100 ring AllReduce, 1 channel, 8-128 bytes
NCCL_TABLE_RING_LL_8_US = 6.6 + 14 * 0.6  # tuning.cc's latency for that call: base + 2(n-1) NVLink hops (LL)


@dataclass(frozen=True)
class Case:
    """One measured group: its calls (kind, bytes), the measurement, and NCCL's tuner model of it."""

    name: str
    calls: tuple[tuple[str, int], ...]
    measured_ms: float
    model_ms: float


@dataclass(frozen=True)
class Causes:
    """Each candidate cause's numbers on both cases (AllReduce first, reduce-to-owner second)."""

    calls: tuple[int, int]
    # (a) the host: the model's own charge (native's C++ issue, none; this runtime's Python), the per-call cost each
    # gap needs, one per-call cost fitted to both and what it gives
    host_native_ms: tuple[float, float]
    host_runtime_ms: tuple[float, float]
    per_call_needed_us: tuple[float, float]
    per_call_fit_us: float
    per_call_fit_ms: tuple[float, float]
    # (b) NCCL's plan
    plans: tuple[int, int]
    batches: tuple[int, int]
    works: tuple[int, int]
    busiest: tuple[int, int]
    channel_ms: tuple[float, float]
    channel_measured_ms: tuple[float, float]  # every work at a measured single-channel call's latency (an upper bound)
    per_work_needed_us: tuple[float, float]
    per_work_fit_us: float
    per_work_fit_ms: tuple[float, float]
    # (c) small calls
    small_calls: tuple[int, int]
    small_share: tuple[float, float]  # of the bytes
    small_alone_ms: tuple[float, float]  # the model with every small call at its own single-call time
    all_alone_ms: tuple[float, float]  # every call at its own single-call time, one after another


def _fit_one(gaps: Sequence[float], counts: Sequence[int]) -> float:
    """The constant ``c`` of ``gap_i = c x count_i`` closest to both in relative terms (least squares of
    ``c x count_i / gap_i - 1``: both cases weigh alike)."""
    x = [n / g for g, n in zip(gaps, counts, strict=True) if g > 0]
    return sum(x) / sum(v * v for v in x) if x else 0.0


def _solve(time_ms: Callable[[float], float], target_ms: float) -> float:
    """The ``w >= 0`` for which the increasing ``time_ms(w)`` reaches ``target_ms`` (bisection; 0 if it already
    does)."""
    lo, hi = 0.0, 1.0
    if time_ms(lo) >= target_ms:
        return 0.0
    while time_ms(hi) < target_ms:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if time_ms(mid) < target_ms else (lo, mid)
    return (lo + hi) / 2


def _closest(times_ms: Callable[[float], list[float]], targets_ms: Sequence[float], top: float) -> float:
    """The ``w`` in ``[0, top]`` whose ``times_ms(w)`` is closest to ``targets_ms`` in relative terms (least squares,
    golden-section search: the error is unimodal in ``w``, each time increasing in it)."""
    def error(w: float) -> float:
        return sum((t / m - 1) ** 2 for t, m in zip(times_ms(w), targets_ms, strict=True))

    lo, hi = 0.0, top
    ratio = (5 ** 0.5 - 1) / 2
    for _ in range(80):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        lo, hi = (lo, b) if error(a) <= error(b) else (a, hi)
    return (lo + hi) / 2


def costed(cases: Sequence[Case], topo: Topology, host: HostCost = DEFAULT) -> Causes:
    """Every candidate cause on ``cases`` (the AllReduce case, then the owner case) on ``topo``."""
    n = tuple(len([c for c in case.calls if c[1] > 0]) for case in cases)
    gaps_ms = [case.measured_ms - case.model_ms for case in cases]
    per_call = tuple(1000.0 * g / k for g, k in zip(gaps_ms, n, strict=True))
    fit_call = _fit_one([1000.0 * g for g in gaps_ms], n)
    plans = [plan_group(case.calls, topo) for case in cases]
    channel = [channel_time_us(p, topo) / 1000.0 for p in plans]
    busiest = tuple(p.busiest for p in plans)
    per_work = tuple(_solve(lambda w, p=p: channel_time_us(p, topo, w) / 1000.0, case.measured_ms)
                     for p, case in zip(plans, cases, strict=True))
    fit_work = _closest(lambda w: [channel_time_us(p, topo, w) / 1000.0 for p in plans],
                        [case.measured_ms for case in cases], max(per_work))
    small = [[c for c in case.calls if 0 < c[1] < SMALL_BYTES] for case in cases]
    small_alone, all_alone = [], []
    for case, few in zip(cases, small, strict=True):
        big = [c for c in case.calls if c[1] >= SMALL_BYTES]
        alone = sum(best_algo(k, b, topo, 1, physical=False)[0] for k, b in few)
        small_alone.append((group_time_us(big, topo, physical=False) + alone) / 1000.0)
        all_alone.append(sum(best_algo(k, b, topo, 1, physical=False)[0] for k, b in case.calls if b) / 1000.0)
    return Causes(
        calls=n,
        host_native_ms=tuple(case.model_ms + host.native_issue_us(k) / 1000.0 for case, k in zip(cases, n,
                                                                                                  strict=True)),
        host_runtime_ms=tuple(case.model_ms + host.issue_us(k) / 1000.0 for case, k in zip(cases, n, strict=True)),
        per_call_needed_us=per_call, per_call_fit_us=fit_call,
        per_call_fit_ms=tuple(case.model_ms + fit_call * k / 1000.0 for case, k in zip(cases, n, strict=True)),
        plans=tuple(p.plans for p in plans), batches=tuple(p.batches for p in plans),
        works=tuple(p.works for p in plans), busiest=busiest, channel_ms=tuple(channel),
        channel_measured_ms=tuple(channel_time_us(p, topo, NCCL_TESTS_ONE_CHANNEL_US - NCCL_TABLE_RING_LL_8_US) / 1000.0
                                  for p in plans),
        per_work_needed_us=per_work, per_work_fit_us=fit_work,
        per_work_fit_ms=tuple(channel_time_us(p, topo, fit_work) / 1000.0 for p in plans),
        small_calls=tuple(len(f) for f in small),
        small_share=tuple(sum(b for _, b in f) / sum(b for _, b in case.calls) for f, case in zip(small, cases,
                                                                                                   strict=True)),
        small_alone_ms=tuple(small_alone), all_alone_ms=tuple(all_alone))


def format_causes(causes: Causes, cases: Sequence[Case]) -> list[str]:
    """The check's ``candidate causes`` section: every cause's numbers on both measurements, which reproduce both,
    and whether the constant that does is physically plausible."""
    a, o = (case.name for case in cases)
    m = [case.measured_ms for case in cases]

    def pair(values: Sequence[float], unit: str = "ms", fmt: str = "{:.2f}") -> str:
        return f"{a} {fmt.format(values[0])} {unit}, {o} {fmt.format(values[1])} {unit}"

    def errors(values: Sequence[float]) -> str:
        return ", ".join(f"{100 * (v / t - 1):+.0f}%" for v, t in zip(values, m, strict=True))

    lines = [
        f"  candidate causes, each on both measurements ({a} {m[0]:.2f} ms, {o} {m[1]:.2f} ms; "
        f"{causes.calls[0]} / {causes.calls[1]} calls in one group):",
        "  (a) host issue per call and NCCL's enqueue (NCCL launches at ncclGroupEnd, after every enqueue; "
        "planning/host_cost.py):",
        f"      charged from sources: native's C++ loop and NCCL's enqueue have no number, none charged: "
        f"{pair(causes.host_native_ms)}; issued by this runtime (2.5 us per call of Python): "
        f"{pair(causes.host_runtime_ms)}",
        f"      per call needed to close each gap: {pair(causes.per_call_needed_us, 'us', '{:.1f}')}; one constant "
        f"{causes.per_call_fit_us:.1f} us per call gives {pair(causes.per_call_fit_ms)} "
        f"({errors(causes.per_call_fit_ms)}), ratio {causes.per_call_fit_ms[1] / causes.per_call_fit_ms[0]:.3f} "
        f"(measured {m[1] / m[0]:.3f})",
        "      plausible for a Python loop through torch.distributed (its all_reduce costs this host 10-20 us, "
        "scripts/benchmark_runtime.py), not for NCCL's enqueue (a pool allocation and a sorted insert, "
        "enqueue.cc 2690-2752); whether the published run issued from Python is not published",
        "  (b) NCCL 2.30's plan of the group (enqueue.cc 363-470, 576-858; research/nccl_plan.py):",
        f"      kernels {causes.plans[0]} / {causes.plans[1]}, work batches {causes.batches[0]} / "
        f"{causes.batches[1]} (of 254 per kernel), works {causes.works[0]} / {causes.works[1]}, busiest channel "
        f"{causes.busiest[0]} / {causes.busiest[1]} works (the small calls all land on one channel)",
        f"      each channel's works one after another: {pair(causes.channel_ms)} ({errors(causes.channel_ms)}); every "
        f"work {NCCL_TESTS_ONE_CHANNEL_US - NCCL_TABLE_RING_LL_8_US:.1f} us longer, as a whole one-channel 8-GPU ring "
        f"AllReduce of 8-128 bytes measured {NCCL_TESTS_ONE_CHANNEL_US} us against the table's "
        f"{NCCL_TABLE_RING_LL_8_US:.1f} (nccl-tests issue 123, DGX A100, launch included: an upper bound): "
        f"{pair(causes.channel_measured_ms)} ({errors(causes.channel_measured_ms)})",
        f"      per-work device cost (on every channel) needed to close each gap: "
        f"{pair(causes.per_work_needed_us, 'us', '{:.1f}')}; one constant {causes.per_work_fit_us:.1f} us gives "
        f"{pair(causes.per_work_fit_ms)} ({errors(causes.per_work_fit_ms)})",
        f"      not plausible: {causes.per_work_fit_us:.0f} us more per work is more than that whole measured call "
        f"({NCCL_TESTS_ONE_CHANNEL_US} us, its launch and its own latency included)",
        f"  (c) small-call bandwidth: {causes.small_calls[0]} / {causes.small_calls[1]} calls under 64 KiB "
        f"({100 * causes.small_share[0]:.3f}% / {100 * causes.small_share[1]:.3f}% of the bytes):",
        f"      each at its own single-call time (no aggregation): {pair(causes.small_alone_ms)} "
        f"({errors(causes.small_alone_ms)}); every call alone, one after another: {pair(causes.all_alone_ms)} "
        f"({errors(causes.all_alone_ms)}): no constant of theirs closes the gap",
        f"  for reference: measured / model {m[0] / cases[0].model_ms:.2f}x and {m[1] / cases[1].model_ms:.2f}x, so a "
        f"cost in proportion to the bytes (a bandwidth) would fit both alike; no source gives one",
    ]
    return lines


__all__ = ["Case", "Causes", "costed", "format_causes"]
