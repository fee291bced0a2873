"""What to size: a preset (GPT-2 or Llama-2 shapes, with overrides) or a ``module:factory``, and how its
parameters are grouped for the optimizer.

Why one spec shared by both layout builders: the meta builder and the real-engine builder must partition the
same parameters in the same groups, or their cross-check means nothing. A spec is a small frozen value, so it
also travels to the spawned process that each world size is sized in.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .gpt_presets import GPT, GPTConfig
from .gpt_presets import PRESETS as GPT_PRESETS
from .gpt_presets import describe as describe_gpt
from .llama_presets import LLAMA_PRESETS, Llama, LlamaConfig, with_overrides

PresetConfig = GPTConfig | LlamaConfig

PRESETS: dict[str, PresetConfig] = {**GPT_PRESETS, **LLAMA_PRESETS}

# How the optimizer's parameter groups are formed. "one": torch.optim.Adam(model.parameters()).
# "decay": matrices (dim >= 2) in one group, vectors (biases, norm weights) in a second one without weight
# decay, nanoGPT's configure_optimizers rule; Hugging Face's Trainer splits the same tensors of these models
# (biases and norm weights) by name. Two groups mean two flat buffers, each partitioned over every rank.
GROUPINGS: dict[str, str] = {
    "one": "one parameter group",
    "decay": "two parameter groups (dim >= 2 with weight decay, the rest without)",
}


def describe_preset(config: PresetConfig) -> str:
    return config.describe() if isinstance(config, LlamaConfig) else describe_gpt(config)


@dataclass(frozen=True)
class ModelSpec:
    """A preset name (with optional overrides) or ``module:factory`` returning an nn.Module.

    ``tied_head`` None keeps the preset's own head (GPT-2 presets tie it to the token embedding, Llama-2
    presets keep a separate ``lm_head``). ``vocab_size`` and ``tied_head`` apply to presets only.
    """

    name: str
    vocab_size: int | None = None
    tied_head: bool | None = None
    param_groups: str = "one"

    def __post_init__(self) -> None:
        if self.param_groups not in GROUPINGS:
            raise ValueError(f"param_groups {self.param_groups!r} is not one of {', '.join(GROUPINGS)}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {self.vocab_size}")
        if self.is_preset():
            return
        module_name, sep, attr = self.name.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"model {self.name!r} is neither a preset ({', '.join(PRESETS)}) nor module:factory")
        overrides = [f"{key}={value}" for key, value in (("vocab_size", self.vocab_size),
                                                          ("tied_head", self.tied_head)) if value is not None]
        if overrides:
            raise ValueError(f"{self.name}: {', '.join(overrides)} given, but vocab_size and tied_head apply to "
                             f"presets ({', '.join(PRESETS)}) only")

    def is_preset(self) -> bool:
        return self.name in PRESETS

    def config(self) -> PresetConfig:
        base = PRESETS[self.name]
        if isinstance(base, LlamaConfig):
            return with_overrides(base, self.vocab_size, self.tied_head)
        return dataclasses.replace(base, vocab_size=self.vocab_size or base.vocab_size,
                                   tied_head=base.tied_head if self.tied_head is None else self.tied_head)

    def factory(self) -> Callable[[], nn.Module]:
        if self.is_preset():
            config = self.config()
            if isinstance(config, LlamaConfig):
                return lambda: Llama(config)
            return lambda: GPT(config)
        module_name, _, attr = self.name.partition(":")
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{self.name} is not callable")
        return target

    def describe(self) -> str:
        text = describe_preset(self.config()) if self.is_preset() else f"{self.name}()"
        return text if self.param_groups == "one" else f"{text}; {GROUPINGS[self.param_groups]}"

    def optimizer_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """The parameter groups to build the optimizer with (empty ones included: DeepSpeed drops them)."""
        params = list(model.parameters())
        if self.param_groups == "one":
            return [{"params": params}]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_meta_model(spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, list[str]]:
    """The model on the meta device (no storage at all); a factory that fails there is built for real.

    The fallback keeps real storage (the caller reads shapes only, through meta stand-ins), and says so.
    """
    factory = spec.factory()
    try:
        with torch.device("meta"):
            model = factory().to(dtype=dtype)
        notes = []
    except Exception as exc:  # noqa: BLE001 - any factory failure under meta: retry the plain way, say so
        notes = [f"factory failed on the meta device ({type(exc).__name__}: {exc}); built it normally"]
        model = factory().to(dtype=dtype)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec.name} returned {type(model).__name__}, not an nn.Module")
    return model, notes

