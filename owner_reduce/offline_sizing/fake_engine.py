"""DeepSpeed's own ZeRO-1 partitioning of a model, obtained in one CPU process through a fake process group.

Why a fake process group: the owner map must come from DeepSpeed's partition tables, not from a
re-implementation (alignment padding and ordering change between releases). torch's "fake" backend lets
one process claim to be rank ``r`` of ``n``: collectives return at once and do nothing, yet
``DeepSpeedZeroOptimizer`` computes exactly the tables the real job would. The owner map is identical on
every rank, so rank 0 suffices.

Note (process-global state): the fake group is torch.distributed's default group and DeepSpeed keeps its
own communication backend in a module global, so one process can size one world size only.
``size_in_subprocess`` runs each world size in a fresh spawned process; tests must do the same.

Memory and time: parameters are built as uninitialized bf16 storage (``gpt_presets.build_uninitialized``);
ZeRO-1 then copies them into one flat buffer and keeps an fp32 copy plus Adam state of 1/n of it, so a 1 B
model at n=8 peaks near 3.5 GB and takes about 10 s on two cores.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import torch
from torch import nn

from ..planning.owner_map import OwnerMap
from ..planning.sizing import (
    DEFAULT_BUCKET_SIZE,
    PublishedCheck,
    SizingReport,
    backward_order,
    published_check,
    size_the_win,
)
from .gpt_presets import GPT as GPTModel
from .gpt_presets import PRESETS, GPTConfig, build_uninitialized, describe


@dataclass(frozen=True)
class ModelSpec:
    """What to build: a preset name (with optional overrides) or ``module:factory`` returning an nn.Module."""

    name: str
    vocab_size: int | None = None
    tied_head: bool = True

    def is_preset(self) -> bool:
        return self.name in PRESETS

    def config(self) -> GPTConfig:
        base = PRESETS[self.name]
        return GPTConfig(n_layer=base.n_layer, n_head=base.n_head, d_model=base.d_model,
                         vocab_size=self.vocab_size or base.vocab_size, block_size=base.block_size,
                         tied_head=self.tied_head)

    def factory(self) -> Callable[[], nn.Module]:
        if self.is_preset():
            config = self.config()
            return lambda: GPTModel(config)
        module_name, sep, attr = self.name.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"model {self.name!r} is neither a preset ({', '.join(PRESETS)}) nor module:factory")
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{self.name} is not callable")
        return target

    def describe(self) -> str:
        return describe(self.config()) if self.is_preset() else f"{self.name}()"


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


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """Make this process rank ``rank`` of ``world_size`` in torch's fake process group, then in DeepSpeed."""
    import deepspeed
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_backend() != "fake":
            raise RuntimeError(f"this process already belongs to a {dist.get_backend()} group of "
                               f"{dist.get_world_size()}; size each world size in its own process")
    else:
        # DeepSpeed's sanity checks read the launcher's variables even when the group already exists.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    deepspeed.init_distributed(dist_backend="fake")


def zero1_sizing_config(bf16: bool = True) -> dict[str, Any]:
    """A plain ZeRO-1 config: partitioning does not depend on the bucket sizes, dtype or optimizer type."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000_000,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


@dataclass(frozen=True)
class BuiltLayout:
    owner_map: OwnerMap
    grad_order: tuple[int, ...]
    reduce_bucket_size: int  # the engine's zero_optimization.reduce_bucket_size (DeepCompile's bucket)
    optimizer_class: str
    seconds: float
    notes: tuple[str, ...]


def build_layout(spec: ModelSpec, world_size: int) -> BuiltLayout:
    """Build a real ZeRO-1 engine as rank 0 of ``world_size`` (fake group) and read its owner map."""
    import deepspeed

    from ..wiring.engine_tables import build_owner_map, zero_optimizer_of

    start = time.perf_counter()
    init_fake_world(world_size)
    model, notes = build_model(spec)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero1_sizing_config())
    zero = zero_optimizer_of(engine)
    owner_map = build_owner_map(engine)
    known = {id(p) for group in zero.bit16_groups for p in group}
    forward = [zero.get_param_id(p) for p in engine.module.parameters() if id(p) in known]
    return BuiltLayout(owner_map=owner_map, grad_order=backward_order(forward),
                       reduce_bucket_size=int(engine.zero_reduce_bucket_size() or DEFAULT_BUCKET_SIZE),
                       optimizer_class=type(zero).__name__, seconds=time.perf_counter() - start,
                       notes=tuple(notes))


def size_model(spec: ModelSpec, world_size: int, bucket_sizes: Sequence[int] = (), dtype: str = "bf16") -> SizingReport:
    """Build the layout in this process and size it; the first bucket size is the engine's own when none given."""
    layout = build_layout(spec, world_size)
    sizes = tuple(bucket_sizes) or (layout.reduce_bucket_size,)
    notes = (f"partitioning by deepspeed {_deepspeed_version()} {layout.optimizer_class} (ZeRO stage 1), "
             f"fake process group, rank 0 of {world_size}",) + layout.notes
    return size_the_win(layout.owner_map, layout.grad_order, sizes, model=spec.describe(), dtype=dtype,
                        build_seconds=layout.seconds, notes=notes)


PUBLISHED_SPEC = ModelSpec("gpt2-350m", tied_head=False)  # 406.3M params, 293 tensors: nearest preset to 402.8M


def check_published(spec: ModelSpec = PUBLISHED_SPEC) -> tuple[str, tuple[PublishedCheck, ...]]:
    """The alpha-beta model against the published 8x A800 run, on ``spec``'s tensors and DeepSpeed's ws-8 map;
    once per Reduce-latency variant of tuning.cc (graph sameChannels 1 and 0)."""
    import dataclasses

    from ..planning.collective_time import A800_NODE

    layout = build_layout(spec, 8)
    checks = tuple(published_check(layout.owner_map, topology=dataclasses.replace(
        A800_NODE, same_channels=same, name=f"{A800_NODE.name}, sameChannels={int(same)}")) for same in (True, False))
    return spec.describe(), checks


def check_published_in_subprocess(spec: ModelSpec = PUBLISHED_SPEC) -> tuple[str, tuple[PublishedCheck, ...]]:
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(check_published, spec).result()


def size_in_subprocess(spec: ModelSpec, world_size: int, bucket_sizes: Sequence[int] = (),
                       dtype: str = "bf16") -> SizingReport:
    """``size_model`` in a fresh spawned process, because the fake process group is process-global."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(size_model, spec, world_size, tuple(bucket_sizes), dtype).result()


def _deepspeed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)
