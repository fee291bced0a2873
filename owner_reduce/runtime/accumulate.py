"""Gradient accumulation across micro-steps for ZeRO stage 1 (z1.cpp): sum locally, reduce once at the boundary.

Note (accumulation buffer): between micro-steps the native runtime keeps the graph's own gradient tensor and adds
into it; here each gradient gets one buffer of its own, allocated at its first accumulation and kept (the first
micro-step copies into it, later ones add), so a compiler that recycles the graph's buffers cannot corrupt the
running sum and no step allocates. On CUDA the copies and adds run on the current stream, as the copy of the
last micro-step's sum into the bucket does, so they are ordered without events; that copy is finished before the
next step writes the buffer (``end_backward`` waits for the reduce stream, which waited for the current one).
"""

from __future__ import annotations

import torch

from .stats import RuntimeStats


class Accumulator:
    """Per gradient: hold the running sum until the micro-step that updates, then hand it over."""

    def __init__(self, stats: RuntimeStats) -> None:
        self._buffers: dict[int, torch.Tensor] = {}  # one buffer per gradient, allocated once
        self._running: set[int] = set()  # ds_ids whose buffer holds this step's running sum
        self._stats = stats

    def take(self, ds_id: int, grad: torch.Tensor, update: bool) -> torch.Tensor | None:
        """The gradient to reduce now (the sum over this step's micro-steps), or None while accumulating."""
        if ds_id in self._running:
            running = self._buffers[ds_id]
            running.add_(grad)
            if not update:
                self._stats.accumulated_calls += 1
                return None
            self._running.discard(ds_id)
            return running
        if not update:
            running = self._buffers.get(ds_id)
            if running is None or running.shape != grad.shape or running.dtype != grad.dtype:
                running = self._buffers[ds_id] = torch.empty_like(grad, memory_format=torch.contiguous_format)
            running.copy_(grad)
            self._running.add(ds_id)
            self._stats.accumulated_calls += 1
            return None
        return grad

    def clear(self) -> None:
        self._buffers.clear()
        self._running.clear()
