"""GPT-2-like models of a few sizes, for sizing the owner path on a real layout without downloading anything.

Why a local model and not a hub checkpoint: what decides which gradients reduce to one rank is only the
sequence of parameter shapes in optimizer order, and ZeRO-1 then partitions that flat sequence. A
nanoGPT-style GPT-2 reproduces that sequence exactly (token embedding, position embedding, per block
ln1 / qkv / attention proj / ln2 / fc / mlp proj, final norm, LM head), with the sizes below.

The LM head is tied to the token embedding by default, as in GPT-2: it then contributes no parameter of
its own, and the largest single gradient is the embedding (vocab x d). ``tied_head=False`` adds a separate
bias-free ``lm_head`` (vocab x d), as in untied GPT-like models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shapes of a GPT-2-like model; ``vocab_size`` defaults to GPT-2's own 50257 (nanoGPT pads it to 50304)."""

    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int = 50257
    block_size: int = 1024
    tied_head: bool = True

    def num_params(self) -> int:
        """Trainable parameters, counted from the shapes (a tied head counts once)."""
        d = self.d_model
        per_block = 12 * d * d + 13 * d  # ln1 2d, qkv 3d^2+3d, proj d^2+d, ln2 2d, fc 4d^2+4d, proj 4d^2+d
        head = 0 if self.tied_head else self.vocab_size * d
        return self.vocab_size * d + self.block_size * d + self.n_layer * per_block + 2 * d + head


# GPT-2 small/medium/large shapes; "1b" is an 18-layer d=2048 model of about 1.0 B parameters (GPT-2 XL,
# 1.5 B, is past the ~1 B this tool is sized for on a CPU box).
PRESETS: dict[str, GPTConfig] = {
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, d_model=768),
    "gpt2-350m": GPTConfig(n_layer=24, n_head=16, d_model=1024),
    "gpt2-774m": GPTConfig(n_layer=36, n_head=20, d_model=1280),
    "1b": GPTConfig(n_layer=18, n_head=16, d_model=2048),
    # Test-sized: a few MB, builds in well under a second.
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=1000, block_size=64),
}


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(d)
        self.attn_qkv = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(nn.functional.gelu(self.mlp_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT-style GPT-2; parameters are declared in forward order, so backward reverses them."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = None if config.tied_head else nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = x @ self.wte.weight.t() if self.lm_head is None else self.lm_head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_uninitialized(factory: Callable[[], nn.Module], dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> nn.Module:
    """``factory()`` built on the meta device, cast to ``dtype``, then given uninitialized storage on ``device``.

    Why: sizing needs shapes only, and initializing 1 B fp32 weights and then casting them costs ~10 s and
    6 GB on two cores, while the meta build allocates nothing. DeepSpeed itself does not accept meta
    parameters (the engine's ``module.to(device)`` cannot copy out of meta), hence ``to_empty``. It runs in
    torch's swap-on-conversion mode so that tied parameters (a head sharing the embedding's weight) stay
    one Parameter object; plain ``to_empty`` would untie them and change the layout.
    """
    with torch.device("meta"):
        model = factory().to(dtype=dtype)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def build_gpt(config: GPTConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              initialize: bool = True) -> nn.Module:
    """A GPT of ``config``; with ``initialize=False`` the weights are left uninitialized (fast, for sizing)."""
    if initialize:
        return GPT(config).to(device=device, dtype=dtype)
    return build_uninitialized(lambda: GPT(config), dtype=dtype, device=device)


def preset_names() -> list[str]:
    return list(PRESETS)


def describe(config: GPTConfig) -> str:
    """One line naming the shapes, e.g. for a report header."""
    millions = config.num_params() / 1e6
    size = f"{millions / 1000:.2f}B" if millions >= 1000 else f"{millions:.1f}M"
    head = "tied" if config.tied_head else "untied"
    return (f"GPT-like {size} params: n_layer={config.n_layer} d_model={config.d_model} n_head={config.n_head} "
            f"vocab={config.vocab_size} block_size={config.block_size} lm_head={head}")

