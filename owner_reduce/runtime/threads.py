"""Every thread the runtime starts (the flush watchdog, the concurrent aborts, init's watchdog) starts here, on the
rank's CUDA device.

Why: CUDA's current device is a property of the host thread, and a new thread's is device 0. The calls such a thread
makes run in the primary context of its current device and create that context where it does not exist yet: torch's
``CUDAEvent::query`` (the flush watchdog's poll) takes no device guard, and NCCL switches to its communicator's device
for a call and switches back afterwards, which since CUDA 12 initialises the context of the device switched back to.
So a thread that never set its device creates a context on GPU 0 in every rank's process: about half a GiB of GPU 0 per
rank, and eight ranks per node can run GPU 0 out of memory (issue 46, finding 1). torch's current stream is per thread
as well: a thread started here sees every device's default stream as current, so it is handed the streams and events
it uses, never reads "the current stream".

Note (device first): the device is set before the thread's target runs, so that no CUDA call of the target ever runs
on device 0 by accident; a failure to set it (a sticky CUDA error) is kept for the target to report
(``DeviceThread.device_error``), never a reason not to run it: a watchdog must still fire on a broken device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def current_cuda_device() -> int | None:
    """The calling thread's CUDA device where this process uses CUDA (torch has initialised it), else None: the device
    a thread started from here must set. Never initialises CUDA itself."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


class DeviceThread(threading.Thread):
    """A daemon thread that sets ``device`` (None: none, a CPU-only process) before running ``target``."""

    def __init__(self, target: Callable[..., Any], *, name: str, device: int | None, args: tuple[Any, ...] = ()
                 ) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self._target_args = args
        self.device = device
        self.device_error: BaseException | None = None  # Note (device first)

    def run(self) -> None:
        if self.device is not None:
            try:
                import torch

                torch.cuda.set_device(self.device)
            except Exception as error:  # noqa: BLE001 - Note (device first)
                self.device_error = error
        self._target_fn(*self._target_args)


def start(target: Callable[..., Any], *, name: str, device: int | None, args: tuple[Any, ...] = ()) -> DeviceThread:
    """Start ``target(*args)`` on a daemon thread on ``device`` (Note (device first))."""
    thread = DeviceThread(target, name=name, device=device, args=args)
    thread.start()
    return thread
