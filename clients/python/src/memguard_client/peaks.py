"""Step reports for the growth back toward the configured micro-batch (issue 37, item 5).

The sidecar grows the micro-batch back only on peaks measured while the trainer runs the
recommended one, over several steps. So at every step boundary the adapters (through
:class:`memguard_client.recovery.StepRunner`) tell it which step runs at which micro-batch, and,
on CUDA, the highest memory the caching allocator reserved on the most loaded device
(``torch.cuda.max_memory_reserved``) with that device's size. On a CPU the sidecar reads the
cgroup's peak itself; only the step and the micro-batch are sent.

The training loop pays for reading the peaks and handing them over (a lock and an event,
measured in docs/performance.md); a daemon thread posts the latest figures at most every
``min_interval`` seconds, so a slow or dead sidecar never slows a step. The allocator's peak
statistics are read, never reset: the trainer's own logging may read them too.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Dict, Optional, Tuple

from .guard import Guard

log = logging.getLogger("memguard_client")

#: Least seconds between two step reports (the sidecar samples every 100 ms by default).
DEFAULT_MIN_INTERVAL = 0.2

_DevicePeak = Tuple[int, int]


def cuda_reserved_peak() -> Optional[_DevicePeak]:
    """``(max_memory_reserved, total_memory)`` of the visible CUDA device whose reserved peak is
    the largest share of its size; ``None`` without torch, without CUDA initialised in this
    process, or when a figure cannot be read. Never raises."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return None
        best: Optional[_DevicePeak] = None
        for dev in range(cuda.device_count()):
            total = int(_device_total(cuda, dev))
            peak = int(cuda.max_memory_reserved(dev))
            if total <= 0 or peak < 0:
                continue
            if best is None or peak / total > best[0] / best[1]:
                best = (peak, total)
        return best
    except Exception:
        return None


_TOTALS: Dict[int, int] = {}


def _device_total(cuda: Any, dev: int) -> int:
    # A device's size does not change: read it once (get_device_properties is not free).
    total = _TOTALS.get(dev)
    if total is None:
        total = _TOTALS[dev] = int(cuda.get_device_properties(dev).total_memory)
    return total


class StepReporter:
    """Posts ``(step, micro-batch, device peak)`` to the sidecar in the background.

    Args:
        guard: the guard whose sidecar URL receives the reports (none: nothing is sent and
            :meth:`step` returns at once).
        min_interval: least seconds between two posts; the latest step wins.
    """

    def __init__(self, guard: Guard, min_interval: float = DEFAULT_MIN_INTERVAL) -> None:
        self.guard = guard
        self.min_interval = max(0.0, float(min_interval))
        self._lock = threading.Lock()
        self._latest: Optional[Tuple[int, int, Optional[_DevicePeak]]] = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: Reports the sidecar accepted.
        self.sent = 0

    @property
    def active(self) -> bool:
        """Whether reports go anywhere (the guard has a sidecar URL)."""
        return self.guard.sidecar_url is not None

    def step(self, step: int, batch_size: int) -> None:
        """The trainer runs ``step`` at micro-batch ``batch_size``: read the device peak and
        hand it to the sender. Never raises, never blocks on the network."""
        if not self.active or self._stop.is_set():
            return
        figures = (int(step), int(batch_size), cuda_reserved_peak())
        with self._lock:
            self._latest = figures
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="memguard-steps", daemon=True)
            self._thread.start()
        self._wake.set()

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                latest, self._latest = self._latest, None
            if latest is None:
                continue
            step, batch, device = latest
            try:
                if self.guard.report_step(
                    step=step,
                    batch_size=batch,
                    reserved_peak_bytes=device[0] if device else None,
                    total_bytes=device[1] if device else None,
                ):
                    self.sent += 1
            except Exception as err:  # the sender must outlive any surprise
                log.debug("memguard: step report failed: %s", err)
            self._stop.wait(self.min_interval)

    def close(self) -> None:
        """Stop sending (the thread is a daemon: closing is optional)."""
        self._stop.set()
        self._wake.set()
