"""Building real DeepSpeed ZeRO-1 engines inside spawned gloo ranks (shared by the tests)."""

from __future__ import annotations

from typing import Any

import deepspeed
import torch

from harness.toy_models import OddMLP


def zero1_config(**compile_section: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }
    if compile_section:
        config["compile"] = dict(compile_section)
    return config


def odd_mlp_engine(two_groups: bool = True, empty_param: bool = True, seed: int = 0, **compile_section: Any):
    torch.manual_seed(seed)
    model = OddMLP(empty_param=empty_param)
    if two_groups:
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        groups = [{"params": list(model.parameters())}]
    optimizer = torch.optim.Adam(groups, lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero1_config(**compile_section))
    return engine
