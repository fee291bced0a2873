"""The model against the one published measurement: 8x A800 over NVLink, 806 MB of bf16 gradients, one collective
per parameter in one group (``scripts/size_the_win.py --check-published``).

Why apart from the package: no training and no sizing reads it. It is research on the cost model: how far NCCL's
tuner model, as the runtime uses it, is from the only published grouped run, and each candidate cause of the gap
costed on it (``published_causes``). It takes DeepSpeed's own layout of the nearest preset from the package's
offline sizing (``offline_sizing.fake_engine.build_layout``) and costs both runs with the package's cost model
(``planning.collective_time``); the sizing command composes this check with the package's report.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

from owner_reduce.offline_sizing.fake_engine import build_layout
from owner_reduce.offline_sizing.model_spec import ModelSpec
from owner_reduce.planning.calls import ALLREDUCE, REDUCE
from owner_reduce.planning.collective_time import A800_NODE, Topology, flush_time_us
from owner_reduce.planning.owner_map import OwnerMap, Placement

from .published_causes import Case, Causes, costed, format_causes

PUBLISHED = {"gpus": "8x A800, NVLink", "params": 402.8e6, "bytes": 806e6, "dtype": "bf16",
             "allreduce_ms": 22.72, "owner_ms": 18.43}


@dataclass(frozen=True)
class PublishedCheck:
    """The alpha-beta model against the published 8x A800 measurement (one collective per parameter), and each
    candidate cause of the gap costed on it (``published_causes``)."""

    topology: str
    tensors: int
    model_bytes: float
    allreduce_ms: float  # one AllReduce per gradient (DeepCompile today)
    owner_ms: float  # one Reduce per single-owner gradient, one AllReduce per straddler (the proposal)
    measured_allreduce_ms: float
    measured_owner_ms: float
    causes: Causes | None = None

    @property
    def ratio(self) -> float:
        return self.owner_ms / self.allreduce_ms

    @property
    def measured_ratio(self) -> float:
        return self.measured_owner_ms / self.measured_allreduce_ms


def published_check(owner_map: OwnerMap, total_bytes: float = PUBLISHED["bytes"],
                    topology: Topology = A800_NODE) -> PublishedCheck:
    """Model the published run: every gradient scaled so the model holds ``total_bytes``, one grouped flush."""
    elems = sum(p.numel for p in owner_map)
    scale = total_bytes / elems
    tensors = [p for p in owner_map if p.numel]
    # NCCL's own table, either sameChannels: the check compares NCCL's model, as published, with the measurement.
    ar_calls = tuple((ALLREDUCE, int(p.numel * scale)) for p in tensors)
    owner_calls = tuple((REDUCE if p.placement is Placement.ONE_OWNER else ALLREDUCE, int(p.numel * scale))
                        for p in tensors)
    allreduce = flush_time_us(ar_calls, topology, physical=False)
    owner = flush_time_us(owner_calls, topology, physical=False)
    cases = (Case("AllReduce", ar_calls, PUBLISHED["allreduce_ms"], allreduce / 1000),
             Case("reduce-to-owner", owner_calls, PUBLISHED["owner_ms"], owner / 1000))
    return PublishedCheck(topology=topology.name, tensors=len(tensors), model_bytes=total_bytes,
                          allreduce_ms=allreduce / 1000, owner_ms=owner / 1000,
                          measured_allreduce_ms=PUBLISHED["allreduce_ms"], measured_owner_ms=PUBLISHED["owner_ms"],
                          causes=costed(cases, topology))


def format_published_check(check: PublishedCheck, model: str) -> str:
    err_ar = check.allreduce_ms / check.measured_allreduce_ms - 1
    err_ow = check.owner_ms / check.measured_owner_ms - 1
    return "\n".join([
        f"published measurement check: {PUBLISHED['gpus']}, {check.model_bytes / 1e6:.0f} MB bf16 gradients, "
        f"one collective per parameter",
        f"  tensor sizes: {model}, {check.tensors} tensors scaled to {check.model_bytes / 1e6:.0f} MB",
        f"  topology: {check.topology}",
        f"  AllReduce       model {check.allreduce_ms:7.2f} ms   measured {check.measured_allreduce_ms:6.2f} ms   "
        f"({100 * err_ar:+.0f}%)",
        f"  reduce-to-owner model {check.owner_ms:7.2f} ms   measured {check.measured_owner_ms:6.2f} ms   "
        f"({100 * err_ow:+.0f}%)",
        f"  owner / AllReduce: model {check.ratio:.3f}   measured {check.measured_ratio:.3f}",
        *(format_causes(check.causes, (Case("AllReduce", (), check.measured_allreduce_ms, check.allreduce_ms),
                                       Case("reduce-to-owner", (), check.measured_owner_ms, check.owner_ms)))
          if check.causes is not None else []),
    ])


PUBLISHED_SPEC = ModelSpec("gpt2-350m", tied_head=False)  # 406.3M params, 293 tensors: nearest preset to 402.8M


def check_published(spec: ModelSpec = PUBLISHED_SPEC,
                    exact_engine: bool = False) -> tuple[str, tuple[PublishedCheck, ...]]:
    """The alpha-beta model against the published 8x A800 run, on ``spec``'s tensors and DeepSpeed's ws-8 map;
    once per Reduce-latency variant of tuning.cc (graph sameChannels 1 and 0)."""
    layout = build_layout(spec, 8, exact_engine=exact_engine)
    checks = tuple(published_check(layout.owner_map, topology=dataclasses.replace(
        A800_NODE, same_channels=same, name=f"{A800_NODE.name}, sameChannels={int(same)}")) for same in (True, False))
    return spec.describe(), checks


def check_published_in_subprocess(spec: ModelSpec = PUBLISHED_SPEC,
                                  exact_engine: bool = False) -> tuple[str, tuple[PublishedCheck, ...]]:
    """``check_published`` in a fresh spawned process: it makes its process rank 0 of a fake world of 8, which is
    process-global (``offline_sizing.fake_engine``)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(check_published, spec, exact_engine).result()
