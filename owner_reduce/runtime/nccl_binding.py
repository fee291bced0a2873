"""cupy's NCCL binding, as the package uses it: the only module of the package that imports cupy, and it does so
lazily (inside a function), so that importing owner_reduce never needs cupy or a GPU.

Why apart from the communicator (``nccl_comm.CupyNcclComm``): what is cupy's (its module, NCCL's data types and
reduction ops, the library's version, unique ids and their exchange over a torch process group, the handles left open
at exit) is read by more than the communicator (``comm_select`` asks whether NCCL loads at all, the settings line
names its version, ``calibrate`` and the user's ``scripts/nccl_check.py`` read them too), and the communicator's own
module then holds its lifecycle and its error handling alone. cupy is imported inside ``nccl_module`` and
``cupy_module`` at each call, so a process that never makes an NCCL communicator never loads it, and the simulated
device (``tests/support/sim/nccl.py`` installs its own ``cupy`` modules) is what a test's communicator gets.
"""

from __future__ import annotations

import atexit
from types import ModuleType
from typing import Any

import torch

from ..planning.settings import nccl_version_of_code
from . import deadline as deadlines
from . import watchdog as watchdogs
from .host_memory import pinned

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)

# torch dtype -> name of cupy's NCCL constant; resolved on use, so a cupy without one leaves it unmapped.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "NCCL_FLOAT32",
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float64: "NCCL_FLOAT64",
    torch.int64: "NCCL_INT64",
    torch.int32: "NCCL_INT32",
    torch.int8: "NCCL_INT8",
    torch.uint8: "NCCL_UINT8",
}
_OP_NAMES: dict[str, str] = {"sum": "NCCL_SUM"}


def nccl_module() -> ModuleType:
    """``cupy.cuda.nccl``, imported on first use (ImportError without cupy)."""
    from cupy.cuda import nccl

    return nccl


def cupy_module() -> ModuleType:
    """``cupy`` itself (``from_dlpack``, ``cuda.Device``), imported on first use."""
    import cupy

    return cupy


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL cupy loaded (``ncclGetVersion``) as (major, minor, patch), or None where it cannot be loaded: the
    settings line names it beside torch's (issue 48)."""
    try:
        code = int(nccl_module().get_version())
    except Exception:  # noqa: BLE001 - no cupy, or no libnccl for it: nothing to name
        return None
    return nccl_version_of_code(code)


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how an error names a dtype."""
    return str(dtype).removeprefix("torch.")


def nccl_dtype(dtype: torch.dtype) -> int:
    """NCCL's data type for a torch dtype; TypeError naming the dtype when there is none (never a guess)."""
    name = _DTYPE_NAMES.get(dtype)
    value = getattr(nccl_module(), name, None) if name else None
    if value is None:
        supported = ", ".join(dtype_name(d) for d in _DTYPE_NAMES)
        raise TypeError(f"owner_reduce: no NCCL data type for torch.{dtype_name(dtype)} "
                        f"(mapped: {supported}{'' if name is None else f'; this cupy lacks {name}'})")
    return int(value)


def nccl_op(op: str) -> int:
    """NCCL's reduction op by name ("sum"); ValueError naming the op otherwise."""
    name = _OP_NAMES.get(op.lower())
    if name is None:
        raise ValueError(f"owner_reduce: no NCCL reduction op {op!r} (mapped: {', '.join(_OP_NAMES)})")
    return int(getattr(nccl_module(), name))


def version_tuple(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as (major, minor, patch): 23203 -> (2, 32, 3); 2708 -> (2, 7, 8)."""
    if code >= 10000:  # NCCL_VERSION_CODE since 2.9: major*10000 + minor*100 + patch
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def nccl_runtime_version() -> tuple[int, int, int]:
    """The NCCL library cupy loads; ImportError if cupy or libnccl is missing. Needs no GPU."""
    nccl = nccl_module()
    if not getattr(nccl, "available", True):
        raise ImportError("cupy is installed without a loadable NCCL library (libnccl)")
    try:
        code = int(nccl.get_version())
    except Exception as error:  # noqa: BLE001 - a missing libnccl surfaces here with cupy's lazy loading
        raise ImportError(f"libnccl could not be loaded: {type(error).__name__}: {error}") from error
    return version_tuple(code)


def new_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` as 128 bytes (cupy >= 14 returns bytes; older cupy a tuple of signed chars)."""
    uid = nccl_module().get_unique_id()
    data = uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)
    if len(data) != UNIQUE_ID_BYTES:
        raise RuntimeError(f"owner_reduce: NCCL unique id has {len(data)} bytes, expected {UNIQUE_ID_BYTES}")
    return data


def failure(what: str, who: int | str, error: BaseException) -> RuntimeError:
    """The error raised for a failed NCCL call: which call, with which arguments, on which rank (``who``: a rank, or
    ``rank 5, flush #3`` from the communicator: ``comm`` Note (names)), and why."""
    where = f"rank {who}" if isinstance(who, int) else who
    return RuntimeError(f"owner_reduce NCCL {what} failed on {where}: {type(error).__name__}: {error}")


def group_or_world(process_group: Any) -> Any:
    """``process_group``, or torch's world group for None (DeepSpeed's data-parallel group may be None)."""
    import torch.distributed as dist

    return dist.group.WORLD if process_group is None else process_group


def exchange_unique_id(process_group: Any) -> bytes:
    """Group rank 0 creates the unique id; every rank of ``process_group`` returns the same 128 bytes.

    One broadcast of 129 bytes: a status byte, then the id. If rank 0 cannot create an id, every rank raises
    (instead of the others waiting for an id that never comes). The tensor lives where the group's backend
    wants it: on the current CUDA device for NCCL, on the CPU otherwise (gloo).
    """
    import torch.distributed as dist
    from torch._dispatch.python import no_python_dispatcher

    group = group_or_world(process_group)
    rank = dist.get_rank(group)
    payload = torch.zeros(1 + UNIQUE_ID_BYTES, dtype=torch.uint8)
    problem = ""
    if rank == 0:
        try:
            payload[1:] = torch.frombuffer(bytearray(new_unique_id()), dtype=torch.uint8)
            payload[0] = 1
        except Exception as error:  # noqa: BLE001 - reported to every rank through the status byte
            problem = f": {type(error).__name__}: {error}"
    src = dist.get_global_rank(group, 0)
    if "nccl" in str(dist.get_backend(group)):
        data = _broadcast_on_device(payload, src, group, rank)
    else:
        with no_python_dispatcher():
            dist.broadcast(payload, src=src, group=group)
        data = payload
    if int(data[0]) != 1:
        raise RuntimeError(f"owner_reduce: group rank 0 could not create an NCCL unique id{problem}")
    return bytes(data[1:].tolist())


def _broadcast_on_device(payload: torch.Tensor, src: int, group: Any, rank: int) -> torch.Tensor:
    """``payload`` broadcast from ``src`` over an NCCL process group, without a blocking copy (Note (no blocking copy)
    in ``CupyNcclComm.all_gather_ints``): to the device by a non-blocking copy, the broadcast's work polled within the
    deadline (init's, inside its window), then back by a non-blocking copy, waited for the same way."""
    import torch.distributed as dist
    from torch._dispatch.python import no_python_dispatcher

    device = torch.device("cuda", torch.cuda.current_device())
    on_device = torch.empty_like(payload, device=device)
    on_device.copy_(pinned(payload), non_blocking=True)
    with no_python_dispatcher():
        work = dist.broadcast(on_device, src=src, group=group, async_op=True)
    work.block_current_stream()  # the stream waits for it, the host does not
    deadline = deadlines.from_environment()
    what = "broadcast of the NCCL unique id (over the data-parallel process group)"

    def failed() -> str | None:
        error = work.exception() if work.is_completed() else None
        return None if error is None else f"{type(error).__name__}: {deadlines.first_line(error)}"

    deadlines.poll_until_done(lambda: bool(work.is_completed()), deadline=deadline, rank=process_rank(rank),
                              flush=None, call=what, check_error=failed)
    back = pinned(torch.empty_like(payload))
    back.copy_(on_device, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    deadlines.poll_until_done(copied.query, deadline=deadline, rank=process_rank(rank), flush=None,
                              call=f"{what}: its copy to the host")
    return back


# id(handle) -> (a cupy NcclCommunicator neither aborted nor destroyed yet, its CUDA device)
_LEFT_OPEN: dict[int, tuple[Any, int]] = {}
_EXIT_HANDLER = False  # _abort_left_open is registered with atexit


def remember_open(handle: Any, device: int) -> None:
    """Note (left open at exit): cupy's ``NcclCommunicator.__dealloc__`` calls ``ncclCommDestroy``, which waits for the
    communicator's kernels in flight, forever where a peer stalled. So every handle is kept here until it is aborted or
    destroyed (its ``NcclCommunicator`` never deallocated before), and at exit whatever is left is aborted, all at
    once, within the watchdog's abort bound: never destroyed. (A communicator dropped without ``close`` keeps its NCCL
    resources until exit.)"""
    global _EXIT_HANDLER  # registered once per process
    if not _EXIT_HANDLER:
        atexit.register(_abort_left_open)
        _EXIT_HANDLER = True
    _LEFT_OPEN[id(handle)] = (handle, device)


def forget_open(handle: Any) -> None:
    """``handle`` was aborted or destroyed (or is about to be, by its owner alone): no exit handler touches it."""
    _LEFT_OPEN.pop(id(handle), None)


def _abort_left_open() -> None:
    watchdogs.stop_all()  # no watchdog claims a communicator meanwhile
    handles = [h for h in (_LEFT_OPEN.pop(key, None) for key in list(_LEFT_OPEN)) if h is not None]
    stuck, _ = watchdogs.abort_concurrently([(f"left-open #{i}", h.abort, device)
                                             for i, (h, device) in enumerate(handles)], watchdogs.ABORT_BOUND_S)
    if stuck:
        import sys

        sys.stderr.write(f"owner_reduce: at exit, {len(stuck)} of {len(handles)} NCCL communicators left open did not "
                         f"finish their abort within {watchdogs.ABORT_BOUND_S:g} s\n")


def process_rank(fallback: int) -> int:
    """This process's global rank (torch.distributed's), which names it in the launcher's logs; a node or rail
    communicator's own rank is another number. ``fallback`` without a process group."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else fallback


def current_device() -> int:
    """torch's current CUDA device; where torch sees no CUDA, cupy's (which then fails with CUDA's own error)."""
    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(cupy_module().cuda.runtime.getDevice())
