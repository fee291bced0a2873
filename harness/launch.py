"""Run a function on N local gloo ranks with a hard deadline: the harness of the CPU demo and the tests.

Why a deadline on everything: a collective that one rank never joins hangs the others forever; on CI
that would burn the whole time limit. Every rank reports back (result or traceback) through a queue,
and the parent kills all ranks once the deadline passes, naming the ranks that did not finish; before it
kills them, it asks each unfinished rank for its Python stacks (SIGUSR1, ``faulthandler``: all threads, on the
rank's stderr), so that a hang says where it hangs.

Note (start method): on a machine where torch sees no GPU, ranks are forked from a fork server that has already
imported torch and DeepSpeed (``harness.preload``; started once per parent process), which saves each rank several
seconds of imports; each rank then takes the parent's environment as it is at ``run_ranks`` (plus ``env``), not
the fork server's; their stdout and stderr are the ones the fork server started with (the parent's at its first
``run_ranks``). Where torch sees a GPU, ranks are spawned fresh: a process forked after CUDA was touched cannot
use it. ``OWNER_REDUCE_START_METHOD=spawn`` forces spawning.

Note (GPUs): a rank's CUDA device is its local rank among the visible GPUs (``local_device``), and where ranks
outnumber the GPUs LOCAL_RANK itself is rewritten to that index before DeepSpeed starts: DeepSpeed binds its
process group and engine to ``cuda:LOCAL_RANK`` (``device_id``), which for rank 1 on one GPU is out of range.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from owner_reduce.errors import OwnerReduceError

from .preload import MODULES as PRELOADED

_FAILURE_GRACE_S = 5.0
_STACK_DUMP_WAIT_S = 2.0


class RankFailure(OwnerReduceError, RuntimeError):
    """One or more ranks raised; the message carries each rank's traceback."""


class RankTimeout(OwnerReduceError, TimeoutError):
    """The ranks did not all finish before the deadline (a hung collective, typically)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_device(local_rank: int, device_count: int) -> int:
    """The CUDA device index of a rank: its local rank among the ``device_count`` visible GPUs, wrapping around
    where ranks outnumber them (ranks sharing a GPU, NCCL >= 2.30). Never the rank itself."""
    if device_count < 1:
        raise ValueError(f"local_device: no visible GPU (device_count={device_count})")
    if local_rank < 0:
        raise ValueError(f"local_device: LOCAL_RANK must be >= 0, got {local_rank}")
    return local_rank % device_count


def _start_context() -> Any:
    """The multiprocessing context for ranks (see Note (start method))."""
    import torch

    method = os.environ.get("OWNER_REDUCE_START_METHOD", "").strip() or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available() else "spawn")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"OWNER_REDUCE_START_METHOD must be forkserver or spawn, got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def fresh_process_context() -> Any:
    """The multiprocessing context ranks start from, for a test's other fresh processes (a ``ProcessPoolExecutor``
    that needs process-global state of its own, such as a fake process group): forked from the same preloaded fork
    server on a machine without a GPU, spawned otherwise (see Note (start method)). A forked process gets the fork
    server's environment, not the caller's current one."""
    return _start_context()


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: Sequence[Any],
               results: Any, env: dict[str, str], dist_backend: str | None,
               environ: dict[str, str] | None = None) -> None:
    if environ is not None:  # forked from the fork server: the parent's environment now, not the server's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(env)  # before torch touches CUDA: CUDA_VISIBLE_DEVICES and LOCAL_RANK may be set here
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's "where are you" on a timeout
    except (AttributeError, ValueError, RuntimeError):  # no SIGUSR1 (Windows) or no usable stderr
        pass
    try:
        import torch

        if torch.cuda.is_available():
            device = local_device(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count())
            os.environ["LOCAL_RANK"] = str(device)  # DeepSpeed's device_id and engine device: cuda:LOCAL_RANK
            torch.cuda.set_device(device)
        if dist_backend != "nccl":
            torch.set_num_threads(1)  # N ranks share the machine's few cores
        if dist_backend is not None:
            import deepspeed

            deepspeed.init_distributed(dist_backend=dist_backend, verbose=False)
        out = fn(rank, world_size, *args)
        # Plain pickle bytes, not the queue's tensor sharing: shared-memory handles die with this process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as tdist

            if tdist.is_initialized():
                tdist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def run_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 240.0,
              env: dict[str, str] | None = None, rank_env: Sequence[dict[str, str]] | None = None,
              dist_backend: str | None = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* plus ``env`` and its own ``rank_env[rank]``, then
    ``deepspeed.init_distributed(dist_backend)`` ("gloo" or "nccl"; None: no process group, ``fn`` brings its
    own). Where torch sees a GPU, every rank first selects ``local_device(LOCAL_RANK, visible GPUs)`` and
    LOCAL_RANK becomes that index (see the module's note). ``fn`` must be importable by name (module level).
    Raises RankFailure if any rank raised, RankTimeout if any rank had not reported within ``timeout``
    seconds (after the unfinished ranks dumped their stacks to stderr); all ranks are dead when this returns.
    """
    ctx = _start_context()
    results = ctx.Queue()
    port = free_port()
    envs = [{**(env or {}), **(rank_env[r] if rank_env else {})} for r in range(world_size)]
    environ = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, tuple(args), results, envs[r], dist_backend,
                                             environ), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[bool, Any]] = {}
    clean = False
    try:
        while len(outcome) < world_size:
            if any(not ok for ok, _ in outcome.values()):
                # A raising rank leaves its peers blocked in the next collective: give them a moment, then stop.
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if any(not ok for ok, _ in outcome.values()):
                    break
                missing = sorted(set(range(world_size)) - set(outcome))
                dumped = _dump_stacks([procs[r] for r in missing])
                raise RankTimeout(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                                  "(hung collective?)" + ("; their Python stacks are on stderr" if dumped else ""))
            try:
                rank, ok, out = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
                if dead:
                    raise RankFailure(f"ranks {dead} died without reporting (exit codes "
                                      f"{[procs[r].exitcode for r in dead]})") from None
                continue
            outcome[rank] = (ok, out)
        clean = all(ok for ok, _ in outcome.values())
    finally:
        for p in procs:
            p.join(timeout=10 if clean else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = {r: out for r, (ok, out) in outcome.items() if not ok}
    if failed:
        raise RankFailure("".join(f"\n--- rank {r} raised ---\n{tb}" for r, tb in sorted(failed.items())))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


def _dump_stacks(procs: Sequence[Any]) -> bool:
    """Ask each live rank for its Python stacks (``faulthandler`` on SIGUSR1) and give them a moment to print."""
    asked = False
    for p in procs:
        if p.is_alive() and p.pid is not None and hasattr(signal, "SIGUSR1"):
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked = True
            except OSError:
                pass
    if asked:
        time.sleep(_STACK_DUMP_WAIT_S)
    return asked
