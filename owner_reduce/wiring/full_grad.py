"""``deepspeed.utils.safe_get_full_grad`` between backward and step with DeepCompile ZeRO-1/2 and the owner path.

Why: ZeRO-1/2 links each parameter to its gradient fragment through ``param._hp_mapping.gradient_dict``, which is
``optimizer.averaged_gradients`` as it was at init (``stage_1_and_2.py``, ``link_hp_params(gradient_dict=...)``).
DeepCompile's pre-backward hooks (``compile/init_z1_and_2.py``: ``set_z1_grad_buffer`` / ``set_z2_grad_buffer``)
bind ``optimizer.averaged_gradients`` to a new dict every step, so the mapping keeps reading the old, empty one: a
rank that holds a fragment raises ``ValueError: Gradients are only available immediately after backward and before
engine step`` while a rank without one enters ``get_full_hp_grad``'s ``all_reduce`` and waits there for ever
(DeepCompile alone behaves the same: an upstream issue). With owner_reduce on, each mapping reads the optimizer's
current dict instead, so every rank takes the same path: its fragment (the owner's reduced gradient, which is what
the owner path delivers), then the one ``all_reduce`` that assembles the full gradient on every rank.

Note (one-time): the mappings are re-pointed once at init to a live view of ``optimizer.averaged_gradients``; no
per-step or per-gradient work is added.

Note (re-links): ZeRO builds the mappings anew, bound to the dict of that moment, whenever it re-links the fragments
(``_link_all_hp_params``: at the end of ``load_checkpoint``'s legacy load and in ``reload_states``). The optimizer's
re-link is therefore wrapped, on this optimizer only, to re-point the new mappings as it returns: resuming from a
checkpoint after ``engine.compile()`` (the guide's order), or before it, or reloading offloaded states, leaves every
mapping live.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any


class LiveGradientDict(Mapping):
    """``optimizer.averaged_gradients`` as it is now, whatever dict DeepCompile bound to it last."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    def __getitem__(self, key: Any) -> Any:
        return self._optimizer.averaged_gradients[key]

    def __contains__(self, key: object) -> bool:
        return key in self._optimizer.averaged_gradients

    def __iter__(self) -> Iterator[Any]:
        return iter(self._optimizer.averaged_gradients)

    def __len__(self) -> int:
        return len(self._optimizer.averaged_gradients)


def link_live_gradients(optimizer: Any, params: Iterable[Any]) -> int:
    """Point every parameter's fragment mapping at the optimizer's current gradient dict; returns how many."""
    live = LiveGradientDict(optimizer)
    linked = 0
    for p in params:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None and hasattr(mapping, "gradient_dict"):
            mapping.gradient_dict = live
            linked += 1
    return linked


def keep_live_gradients(optimizer: Any, params: Callable[[], Iterable[Any]]) -> int:
    """``link_live_gradients`` now and after every re-link ZeRO makes (Note (re-links)); returns how many now."""
    relink = getattr(optimizer, "_link_all_hp_params", None)
    if relink is not None and not getattr(relink, "owner_reduce_live", False):
        def link_all_hp_params(*args: Any, **kwargs: Any) -> Any:
            result = relink(*args, **kwargs)
            link_live_gradients(optimizer, params())
            return result

        link_all_hp_params.owner_reduce_live = True  # type: ignore[attr-defined]
        optimizer._link_all_hp_params = link_all_hp_params
    return link_live_gradients(optimizer, params())
