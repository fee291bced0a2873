"""The runtime's schedules, the measured guard's verdicts and its trials under way in DeepSpeed's checkpoints: saved
with every ``engine.save_checkpoint``, restored by ``engine.load_checkpoint``.

Why: a run resumed in fresh processes would learn its schedules again from an arrival-order backward, and its guard
would measure again and could decide otherwise where two variants are close: either adds the ranks' terms in another
order than the run that saved (``planning.verdict_book``, ``runtime.placement`` Note (resumed schedules)); a trial
under way at the save would start again from its first step (``runtime.trial`` Note (resumed trials)). All of it
travels in DeepSpeed's own client state (``CHECKPOINT_KEY``; during a trial ``checkpoint_state`` gathers every rank's
samples first, one collective: ``save_checkpoint`` is called on every rank):
``save_checkpoint`` writes it with the model states every data-parallel rank reads back, ``load_checkpoint`` returns
it with the client state, and it is taken out of what the caller gets.

Why on the engine class (``install``): a user may load before ``engine.compile()`` (the runtime does not exist yet)
or after it. A checkpoint loaded before is kept on the engine and handed to its runtime when DeepCompile starts it
(``activation``); loaded after, it goes to the live runtime at once. An engine without owner_reduce saves and loads
exactly as DeepSpeed does (its client state is not touched; a checkpoint's verdicts are only taken out of it).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..planning.verdict_book import CHECKPOINT_KEY

RUNTIME_ATTR = "_owner_reduce_runtime"  # the engine's live runtime (set by activation, removed at its cleanup)
PENDING_ATTR = "_owner_reduce_pending_verdicts"  # a checkpoint's verdicts loaded before the runtime existed


def wrap_save_checkpoint(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = getattr(self, RUNTIME_ATTR, None)
        verdicts = runtime.checkpoint_state() if runtime is not None else None
        if verdicts is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        client_state = dict(bound.arguments.get("client_state") or {})
        if CHECKPOINT_KEY in client_state:
            raise KeyError(f"owner_reduce: client_state holds '{CHECKPOINT_KEY}', the key owner_reduce saves its "
                           f"schedules and the measured guard's verdicts under; rename it")
        client_state[CHECKPOINT_KEY] = verdicts
        bound.arguments["client_state"] = client_state
        return original(*bound.args, **bound.kwargs)

    save_checkpoint.owner_reduce_original = original  # type: ignore[attr-defined]
    return save_checkpoint


def wrap_load_checkpoint(original: Any) -> Any:
    @functools.wraps(original)
    def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        load_path, client_state = result if isinstance(result, tuple) and len(result) == 2 else (None, None)
        if load_path is None or not isinstance(client_state, dict) or CHECKPOINT_KEY not in client_state:
            return result
        verdicts = client_state.pop(CHECKPOINT_KEY)
        runtime = getattr(self, RUNTIME_ATTR, None)
        if runtime is not None and runtime.comm is not None:
            runtime.restore_checkpoint_state(verdicts, source=f"the checkpoint {load_path}")
        else:
            setattr(self, PENDING_ATTR, (verdicts, load_path))
        return load_path, client_state

    load_checkpoint.owner_reduce_original = original  # type: ignore[attr-defined]
    return load_checkpoint


def hand_pending_verdicts(engine: Any, runtime: Any) -> None:
    """A checkpoint loaded before DeepCompile started ``runtime``: its verdicts, now (activation)."""
    pending = engine.__dict__.pop(PENDING_ATTR, None)
    if pending is not None:
        verdicts, load_path = pending
        runtime.restore_checkpoint_state(verdicts, source=f"the checkpoint {load_path}")
