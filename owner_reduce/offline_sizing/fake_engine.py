"""The layout of a model as DeepSpeed's ZeRO-1 partitions it, obtained in one CPU process, and its sizing.

Two builders, one result (``BuiltLayout``):

- ``meta_layout.build_meta_layout`` (the default): the model on the meta device and DeepSpeed's own partition
  methods, no parameter storage; a 70 B model at ws 1024 in seconds and a few hundred MB.
- ``build_engine_layout`` (``exact_engine=True``, ``--exact-engine``): a real ``deepspeed.initialize`` as rank
  0 of n in torch's fake process group, with real (uninitialized) bf16 parameter storage, read through
  ``wiring.engine_tables``: the reference the meta builder is checked against. ZeRO-1 copies the parameters
  into one flat buffer and keeps an fp32 copy plus Adam state of 1/n of it, so a 1 B model peaks near 3.5 GB.

Why a fake process group: the owner map must come from DeepSpeed's partition tables, not from a
re-implementation (alignment padding and ordering change between releases). torch's "fake" backend lets
one process claim to be rank ``r`` of ``n``: collectives return at once and do nothing, yet DeepSpeed
computes exactly the tables the real job would. The owner map is identical on every rank, so rank 0 suffices.

Note (process-global state): the fake group is torch.distributed's default group and DeepSpeed keeps its
own communication backend in a module global, so one process can size one world size only.
``size_in_subprocess`` runs each world size in a fresh spawned process; tests must do the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
from torch import nn

from ..planning.sizing import DEFAULT_BUCKET_SIZE, Cluster, SizingReport, size_the_win
from .fake_world import BuiltLayout, grad_order_of, init_fake_world, zero1_sizing_config
from .gpt_presets import build_uninitialized
from .meta_layout import build_meta_layout
from .model_spec import ModelSpec

__all__ = ["BuiltLayout", "ModelSpec", "build_engine_layout", "build_layout", "build_model", "init_fake_world",
           "size_in_subprocess", "size_model", "zero1_sizing_config"]


def build_model(spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, list[str]]:
    """The model with uninitialized ``dtype`` weights; falls back to a real build if the factory rejects meta."""
    notes: list[str] = []
    factory = spec.factory()
    try:
        model = build_uninitialized(factory, dtype=dtype, device="cpu")
    except Exception as exc:  # noqa: BLE001 - any factory failure under meta: retry the plain way, say so
        notes.append(f"factory failed on the meta device ({type(exc).__name__}: {exc}); built it normally")
        model = factory().to(dtype=dtype)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec.name} returned {type(model).__name__}, not an nn.Module")
    return model, notes


def build_engine_layout(spec: ModelSpec, world_size: int) -> BuiltLayout:
    """Build a real ZeRO-1 engine as rank 0 of ``world_size`` (fake group) and read its owner map."""
    import deepspeed

    from ..wiring.engine_tables import build_owner_map, zero_optimizer_of

    start = time.perf_counter()
    init_fake_world(world_size)
    model, notes = build_model(spec)
    optimizer = torch.optim.Adam(spec.optimizer_groups(model), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero1_sizing_config())
    zero = zero_optimizer_of(engine)
    owner_map = build_owner_map(engine)
    known = {id(p) for group in zero.bit16_groups for p in group}

    def param_id(p: nn.Parameter) -> int | None:
        return zero.get_param_id(p) if id(p) in known else None

    notes.insert(0, f"real-engine layout builder: deepspeed.initialize with uninitialized bf16 storage, "
                    f"rank 0 of {world_size}")
    return BuiltLayout(owner_map=owner_map, grad_order=grad_order_of(engine.module, param_id),
                       reduce_bucket_size=int(engine.zero_reduce_bucket_size() or DEFAULT_BUCKET_SIZE),
                       optimizer_class=type(zero).__name__, seconds=time.perf_counter() - start,
                       notes=tuple(notes))


def build_layout(spec: ModelSpec, world_size: int, exact_engine: bool = False) -> BuiltLayout:
    """The layout of ``spec`` at ``world_size``: the meta builder, or with ``exact_engine`` a real engine.

    Either makes this process rank 0 of a fake world of ``world_size`` (process-global, see the docstring).
    """
    return build_engine_layout(spec, world_size) if exact_engine else build_meta_layout(spec, world_size)


def size_model(spec: ModelSpec, world_size: int, bucket_sizes: Sequence[int] = (), dtype: str = "bf16",
               exact_engine: bool = False, cluster: Cluster | None = None,
               sensitivity: Sequence[float] = ()) -> SizingReport:
    """Build the layout in this process and size it; the first bucket size is the engine's own when none given."""
    layout = build_layout(spec, world_size, exact_engine=exact_engine)
    sizes = tuple(bucket_sizes) or (layout.reduce_bucket_size,)
    notes = (f"partitioning by deepspeed {_deepspeed_version()} {layout.optimizer_class} (ZeRO stage 1), "
             f"fake process group, rank 0 of {world_size}",) + layout.notes
    return size_the_win(layout.owner_map, layout.grad_order, sizes, model=spec.describe(), dtype=dtype,
                        build_seconds=layout.seconds, notes=notes, cluster=cluster, sensitivity=tuple(sensitivity))


def size_in_subprocess(spec: ModelSpec, world_size: int, bucket_sizes: Sequence[int] = (),
                       dtype: str = "bf16", exact_engine: bool = False, cluster: Cluster | None = None,
                       sensitivity: Sequence[float] = ()) -> SizingReport:
    """``size_model`` in a fresh spawned process, because the fake process group is process-global."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(size_model, spec, world_size, tuple(bucket_sizes), dtype, exact_engine, cluster,
                           tuple(sensitivity)).result()


def _deepspeed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)
