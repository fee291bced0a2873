"""Llama-2-shaped models (7B, 13B, 70B and a test-sized one), for sizing the owner path at the scales it is for.

Why Llama shapes next to the GPT ones: what decides the owner map is the sequence of parameter shapes in
optimizer order, and Llama's differs from GPT-2's in ways that move partition boundaries: no biases, one
RMSNorm weight per norm, three MLP matrices with an ffn width that is not 4d, grouped-query k/v projections
(70B: 8192 -> 1024) and an untied LM head. The modules are declared in Hugging Face's order
(``LlamaForCausalLM``: ``model.embed_tokens``, per ``LlamaDecoderLayer`` ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``; then ``model.norm`` and
``lm_head``), so ``parameters()`` lists exactly the tensors, in exactly the order, that a Hugging Face
checkpoint hands to the optimizer.

The forward pass is a plain Llama (RMSNorm, rotary embeddings, grouped-query causal attention, SwiGLU): it is
there so that the model is a real one that trains, not for speed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a Llama-2-like model; ``n_kv_head < n_head`` is grouped-query attention."""

    n_layer: int
    n_head: int
    d_model: int
    ffn: int
    n_kv_head: int | None = None  # None: as many as n_head (multi-head attention)
    vocab_size: int = 32000
    tied_head: bool = False  # Llama-2 keeps a separate lm_head
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        """Output width of k_proj and v_proj (1024 for the 70B's 8 KV heads of 128)."""
        return self.kv_heads * self.head_dim

    def num_params(self) -> int:
        """Trainable parameters, counted from the shapes (a tied head counts once)."""
        d = self.d_model
        per_layer = 2 * d * d + 2 * d * self.kv_dim + 3 * d * self.ffn + 2 * d  # q,o; k,v; gate,up,down; 2 norms
        head = 0 if self.tied_head else self.vocab_size * d
        return self.vocab_size * d + self.n_layer * per_layer + d + head

    def describe(self) -> str:
        """One line naming the shapes, e.g. for a report header."""
        millions = self.num_params() / 1e6
        size = f"{millions / 1000:.2f}B" if millions >= 1000 else f"{millions:.1f}M"
        head = "tied" if self.tied_head else "untied"
        return (f"Llama-like {size} params: n_layer={self.n_layer} d_model={self.d_model} n_head={self.n_head} "
                f"n_kv_head={self.kv_heads} ffn={self.ffn} vocab={self.vocab_size} lm_head={head}")


# Llama-2 shapes (Hugging Face config.json of meta-llama/Llama-2-{7b,13b,70b}-hf).
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-7b": LlamaConfig(n_layer=32, n_head=32, d_model=4096, ffn=11008),
    "llama-13b": LlamaConfig(n_layer=40, n_head=40, d_model=5120, ffn=13824),
    "llama-70b": LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, d_model=8192, ffn=28672),
    # Test-sized, with grouped-query attention so that the k/v shapes differ from q's as in the 70B.
    "llama-tiny": LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, ffn=176, vocab_size=1000),
}


class RMSNorm(nn.Module):
    """Llama's RMSNorm: one weight of ``d`` elements, no bias (``LlamaRMSNorm``)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """``LlamaAttention``'s parameters: bias-free q, k, v, o projections (k and v narrower under GQA)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d = config.d_model
        self.config = config
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, config.kv_dim, bias=False)
        self.v_proj = nn.Linear(d, config.kv_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, c.n_head, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=x.device).float() / c.head_dim)
        angles = torch.outer(torch.arange(t, device=x.device).float(), inv_freq)
        cos, sin = (f(torch.cat((angles, angles), dim=-1)).to(x.dtype) for f in (torch.cos, torch.sin))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = c.n_head // c.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(att.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """``LlamaMLP``'s parameters: bias-free gate, up, down projections (SwiGLU)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn, bias=False)
        self.down_proj = nn.Linear(config.ffn, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Declared as ``LlamaDecoderLayer``: self_attn, mlp, input_layernorm, post_attention_layernorm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.d_model, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.rms_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """``LlamaModel``: embed_tokens, layers, norm (the rotary embedding has no parameters)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.rms_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Llama(nn.Module):
    """``LlamaForCausalLM``: ``model`` then ``lm_head``; a tied head shares the embedding's Parameter."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tied_head:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model(tokens))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def with_overrides(config: LlamaConfig, vocab_size: int | None, tied_head: bool | None) -> LlamaConfig:
    """``config`` with a different vocabulary and/or head tying (None keeps the preset's)."""
    changes: dict[str, object] = {}
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    if tied_head is not None:
        changes["tied_head"] = tied_head
    return dataclasses.replace(config, **changes)
