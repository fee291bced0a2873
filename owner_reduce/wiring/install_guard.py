"""A DeepSpeed config that carries owner_reduce's keys in a process where ``install()`` has not run fails naming
owner_reduce and ``install()``, not with pydantic's bare "Extra inputs are not permitted".

Why armed when the package is imported: a message can only come from code that runs, and a user who forgot
``install()`` has at least imported owner_reduce. Importing the package must not import DeepSpeed (nor torch), and
DeepSpeed may be imported before it or after it. So where ``deepspeed.runtime.config`` is loaded already its
``CompileConfig`` is wrapped at once; otherwise a finder on ``sys.meta_path`` wraps it right after DeepSpeed executes
that module, and leaves. The wrapper hands every config without owner_reduce's keys to DeepSpeed's own class,
untouched; one with them, which DeepSpeed would refuse anyway, fails with ``OwnerReduceConfigError`` (a ValueError,
as pydantic's error is). ``install()`` puts its own factory over DeepSpeed's class (``unguarded``); ``uninstall()``
puts the wrapper back.

Not caught: a process that never imports owner_reduce (a Trainer script started directly, not through
``python -m owner_reduce.run``). Nothing of owner_reduce runs there; DeepSpeed's pydantic error is all there is.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

from ..planning.flags import OwnerReduceConfigError
from ..planning.settings import SETTING_KEYS, forgotten_install_message

CONFIG_MODULE = "deepspeed.runtime.config"
GUARD_ATTR = "owner_reduce_guarded"  # on the wrapper: DeepSpeed's class it stands in front of


def unguarded(compile_config: Any) -> Any:
    """DeepSpeed's own class behind the wrapper (or whatever is there, unwrapped)."""
    return getattr(compile_config, GUARD_ATTR, compile_config)


def guard(module: Any) -> None:
    """Put the wrapper in front of ``module.CompileConfig`` (``deepspeed.runtime.config``), unless something of
    owner_reduce's is there already (this wrapper, or ``install()``'s factory)."""
    original = module.CompileConfig
    if hasattr(original, GUARD_ATTR) or hasattr(original, "owner_reduce_original"):
        return

    def compile_config(**data: Any) -> Any:
        keys = [key for key in SETTING_KEYS if key in data]
        if keys:
            raise OwnerReduceConfigError(forgotten_install_message(keys))
        return original(**data)

    setattr(compile_config, GUARD_ATTR, original)
    module.CompileConfig = compile_config


class _GuardAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``deepspeed.runtime.config`` it asks the finders after it, and has the module guarded
    once its code ran; then it leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != CONFIG_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_guard(module: Any) -> None:
            exec_module(module)
            guard(module)

        loader.exec_module = exec_and_guard  # this module's own loader (module.__loader__ stays DeepSpeed's file's)
        return spec


def arm() -> None:
    """Guard DeepSpeed's config now if it is loaded, or right after it loads. Idempotent; imports nothing."""
    module = sys.modules.get(CONFIG_MODULE)
    if module is not None and hasattr(module, "CompileConfig"):
        guard(module)
    elif not any(isinstance(finder, _GuardAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _GuardAfterImport())
