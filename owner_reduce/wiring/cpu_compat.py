"""Three fixes that let DeepCompile compile on the CPU accelerator (gloo), applied only there.

Why: the whole product is tested on CPU with real DeepSpeed, real graphs and real gloo collectives, and
DeepCompile assumes CUDA in three places (DESIGN.md, "CPU traps"):
1. ``backend.py`` and ``profilers/graph_profile.py`` call ``torch.device(get_accelerator().current_device())``;
   the CPU accelerator returns LOCAL_RANK as a string. Those two modules get an accelerator view whose current
   device is "cpu" (and whose ``random().fork_rng`` forks the CPU generator only: its CUDA default fails).
2. Compile-time profiling runs real gloo collectives with the Python dispatcher on; a gloo worker's
   destructor then needs the GIL the main thread holds (about 1 run in 6 hangs). The passes run with the
   Python dispatcher off.
3. ``util.sym_size_ops`` is defined at import only when CUDA is present; the pass helpers read it.
Every name replaced here is restored by ``restore()``.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

_saved: dict[tuple[Any, str], Any] = {}


class _CpuRandom:
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.random, name)

    @staticmethod
    def fork_rng(devices: Any = None, enabled: bool = True, **kwargs: Any) -> Any:
        return torch.random.fork_rng(devices=[], enabled=enabled, device_type="cpu")


class CpuAcceleratorView:
    """The CPU accelerator, except that ``current_device()`` is a valid torch device string."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def current_device(self) -> str:
        return "cpu"

    def random(self) -> _CpuRandom:
        return _CpuRandom()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def is_cpu_accelerator() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def _replace(module: Any, name: str, value: Any) -> None:
    _saved.setdefault((module, name), getattr(module, name, _MISSING))
    setattr(module, name, value)


_MISSING = object()


def _without_python_dispatcher(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch._dispatch.python.no_python_dispatcher():
            return fn(*args, **kwargs)

    return wrapped


def apply() -> None:
    """Idempotent; call only on the CPU accelerator."""
    if _saved:
        return
    import deepspeed.compile.backend as backend
    import deepspeed.compile.profilers.graph_profile as graph_profile
    import deepspeed.compile.util as util
    from deepspeed.accelerator import get_accelerator

    view = CpuAcceleratorView(get_accelerator())
    _replace(backend, "get_accelerator", lambda: view)
    _replace(graph_profile, "get_accelerator", lambda: view)
    _replace(backend, "run_opt_passes", _without_python_dispatcher(backend.run_opt_passes))
    if not hasattr(util, "sym_size_ops"):
        _replace(util, "sym_size_ops", {operator.ge, operator.le, operator.eq, operator.ne, operator.gt, operator.lt,
                                        torch.ops.aten.sym_size.int, operator.getitem})


def restore() -> None:
    for (module, name), value in _saved.items():
        if value is _MISSING:
            delattr(module, name)
        else:
            setattr(module, name, value)
    _saved.clear()
