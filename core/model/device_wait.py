"""Host waits on device work with a deadline, setup probes included: torch.cuda.synchronize takes none, so a hung
kernel would hang the process; here an event is polled until done or `seconds` pass (DeviceStalled).
"""

from __future__ import annotations

import os
import time
from typing import Callable

from core.errors import MlightError

WAIT_SECONDS = 600.0  # the longest a host waits on device work before calling it hung (Device.wait_seconds)


class DeviceStalled(MlightError):
    def __init__(self, what: str, seconds: float):
        super().__init__(f"{what} did not complete on the device within {seconds:g} s",
                         "a kernel or a copy hung (or the GPU is shared and starved): check nvidia-smi and restart "
                         "mlight; a slow GPU may need a longer wait (MLIGHT_DEVICE_WAIT_S)")
        self.what, self.seconds = what, seconds


def wait_seconds_default() -> float:
    env = os.environ.get("MLIGHT_DEVICE_WAIT_S", "").strip()
    return float(env) if env else WAIT_SECONDS


def poll(done: Callable[[], bool], seconds: float, what: str, cancel: Callable[[], bool] | None = None,
         max_pause: float = 1e-3) -> bool:
    """Wait until `done()`; False if `cancel()` said stop first, DeviceStalled past the deadline. The pause
    grows from 20 µs to `max_pause` (1 ms); `max_pause=0` spins (yielding the GIL), for waits inside a timing."""
    if done():
        return True
    deadline, pause = time.monotonic() + seconds, min(2e-5, max_pause)
    while not done():
        if cancel is not None and cancel():
            return False
        if time.monotonic() > deadline:
            raise DeviceStalled(what, seconds)
        time.sleep(pause)
        pause = min(2 * pause, max_pause)
    return True


def synchronize(what: str, index: int | None = None, seconds: float | None = None, *, event=None,
                stream=None) -> None:
    """torch.cuda.synchronize for GPU `index` within `seconds`; it spins, so a timed probe reads its work's time."""
    import torch

    ev = (event or torch.cuda.Event)()
    ev.record(stream if stream is not None else torch.cuda.current_stream(index))
    poll(ev.query, wait_seconds_default() if seconds is None else seconds, what, max_pause=0.0)
