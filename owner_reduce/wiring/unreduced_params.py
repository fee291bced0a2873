"""Frozen and zero-element parameters: graph inputs that DeepCompile must not treat as ZeRO parameters.

Why: ZeRO stages 1 and 2 leave a parameter out of their optimizer groups when it is frozen
(``requires_grad=False``) or has no elements (``deepspeed.runtime.utils.is_optimized_parameter``), so
``init_z1_and_2`` never gives it a ``param_id``. DeepCompile's stage-1/2 backend then asserts that every
``nn.Parameter`` input of a graph has one (``All param inputs should have param_id``, backend.py): upstream,
any model with a frozen layer, or a zero-element parameter that forward reads, fails at its first forward.

Plain ZeRO-1 reduces exactly the parameters in its groups and leaves the others alone. owner_reduce does the
same under DeepCompile: its backend shows DeepCompile such an input as a plain tensor (same storage, same
``requires_grad``), so DeepCompile treats it as any other non-parameter input: no ``param_id``, no
``reduce_grad`` in the backward graph, no registration with the runtime. Its gradient, if it has one (a
zero-element parameter that forward reads), goes back to autograd unreduced, as plain ZeRO-1 leaves it in
``.grad``. Which inputs are hidden depends only on the model and the optimizer groups, both identical on every
rank (the owner map digest checks the groups at init), so every rank compiles the same graph and issues the
same collectives.

The substitution is on the example inputs DeepCompile compiles and profiles with; at run time dynamo passes the
real parameters, which the compiled code reads like any input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def optimized_param_ids(bit16_groups: Iterable[Iterable[torch.Tensor]]) -> frozenset[int]:
    """Python ids of the parameters in ZeRO's optimizer groups: the ones ``init_z1_and_2`` gave a ``param_id``."""
    return frozenset(id(p) for group in bit16_groups for p in group)


def as_plain_input(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter as a non-``Parameter`` tensor: same storage, shape and ``requires_grad``."""
    return param.detach().requires_grad_(param.requires_grad)


def hide_unoptimized_params(backend_fn: Callable[..., Any], optimized: frozenset[int]) -> Callable[..., Any]:
    """DeepCompile's backend, compiling with every parameter input outside ZeRO's groups shown as a plain tensor."""

    def owner_reduce_backend(gm: Any, real_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        shown = [as_plain_input(v) if isinstance(v, torch.nn.Parameter) and id(v) not in optimized else v
                 for v in real_inputs]
        return backend_fn(gm, shown if isinstance(real_inputs, list) else tuple(shown), *args, **kwargs)

    owner_reduce_backend.__wrapped__ = backend_fn  # type: ignore[attr-defined]
    return owner_reduce_backend
