"""Small models for the CPU demo, the benchmarks and the tests.

Why each has its own ``forward``: in torch 2.13, ``nn.Module.compile()`` of a bare ``nn.Sequential`` captures
no graph while DeepCompile still removes ZeRO's gradient hooks, so nothing would be reduced (DESIGN.md,
CPU trap 3). Layer widths are deliberately odd so that ZeRO-1 partition boundaries fall inside parameters.
"""

from __future__ import annotations

import torch
from torch import nn


class OddMLP(nn.Module):
    """Three linear layers with odd widths; at ws 2-4 several weights straddle partition boundaries."""

    def __init__(self, d_in: int = 12, hidden: int = 23, d_out: int = 5, empty_param: bool = False,
                 freeze_fc2: bool = False, unused_empty_param: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)
        # A zero-sized trainable parameter, as some models carry (an unused bias slot, say), used in forward.
        self.empty = nn.Parameter(torch.zeros(0)) if empty_param else None
        # One that forward never reads (it is still an input DeepCompile sees only if forward reads it).
        self.unused_empty = nn.Parameter(torch.zeros(0, 3)) if unused_empty_param else None
        if freeze_fc2:  # a frozen layer in the middle, as in fine-tuning: ZeRO leaves it out of its groups
            self.fc2.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h)) + h
        out = self.fc3(h)
        if self.empty is not None:
            out = out + self.empty.sum()
        return nn.functional.mse_loss(out, y)


class ExactLinear(nn.Module):
    """Linear layers of odd widths, each applied to the input, and a loss linear in their outputs.

    Why: bitwise comparisons where a reduction adds the ranks' shares in another order than the reference (two levels
    of three nodes, or of four ranks each, against gloo's ring). Every gradient here is a sum over the batch of
    target x input products and never depends on the weights, so with inputs and targets of a few bits (``batch``)
    every gradient, every share (the division by 6 or 8 included) and every partial sum of every reduction is exact:
    no order of addition can change a bit, while a share lost or counted twice changes many."""

    def __init__(self, d_in: int = 12, widths: tuple[int, ...] = (23, 7, 17)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d_in, w) for w in widths)

    @property
    def d_out(self) -> int:
        return sum(layer.out_features for layer in self.layers)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (torch.cat([layer(x) for layer in self.layers], dim=1) * t).sum()

    @staticmethod
    def batch(micro_batch: int, d_in: int, d_out: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """Inputs of 4 bits over 8, targets 3 times that: a weight's gradient is 3k / 64, a bias's 3k / 8, so its
        share at 6 or 8 ranks is exact too."""
        x = torch.randint(-8, 9, (micro_batch, d_in), generator=generator).float() / 8
        t = torch.randint(-8, 9, (micro_batch, d_out), generator=generator).float() * 3 / 8
        return x, t


class TinyTransformer(nn.Module):
    """A transformer-like stack (embedding, attention-ish mixing, MLPs, norms, head) for the demo."""

    def __init__(self, vocab: int = 97, dim: int = 48, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.LayerNorm(dim),
                "qkv": nn.Linear(dim, 3 * dim),
                "proj": nn.Linear(dim, dim),
                "norm2": nn.LayerNorm(dim),
                "up": nn.Linear(dim, 4 * dim),
                "down": nn.Linear(4 * dim, dim),
            }))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](h)).chunk(3, dim=-1)
            att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1]**0.5, dim=-1)
            h = h + block["proj"](att @ v)
            h = h + block["down"](torch.nn.functional.gelu(block["up"](block["norm2"](h))))
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class FewBigTensors(nn.Module):
    """A few large matrices and nothing else; with dim 45, partition boundaries fall inside them at ws 2, 3 and 4."""

    def __init__(self, dim: int = 45, layers: int = 3) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(dim, dim) / dim**0.5) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x @ w)
        return nn.functional.mse_loss(x, y)


class TiedLM(nn.Module):
    """A token model whose output head is the input embedding (tied weights, as GPT-2): one parameter that
    gets two gradient contributions per step. Odd sizes put partition boundaries inside the parameters."""

    def __init__(self, vocab: int = 61, dim: int = 23, seq: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[:tokens.shape[1]]
        h = h + torch.tanh(self.mix(self.norm(h)))
        logits = h @ self.embed.weight.t() + self.bias
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
