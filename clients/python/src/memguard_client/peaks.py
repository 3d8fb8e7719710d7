"""Step reports for the growth back toward the configured micro-batch (issue 37, item 5).

The sidecar grows the micro-batch back only on peaks measured while the trainer runs the
recommended one, over several steps. So at every step boundary the adapters (through
:class:`memguard_client.recovery.StepRunner`) tell it which step runs at which micro-batch, and,
on CUDA, the highest memory the caching allocator reserved on the process's device
(``torch.cuda.max_memory_reserved``, one device per rank) with the device's current figures. On a
CPU the sidecar reads the cgroup's peak itself; only the step and the micro-batch are sent.

The training loop pays for handing ``(step, micro-batch)`` over (a lock and an event, measured
in docs/performance.md); a daemon thread reads the device figures and posts the latest at most
every ``min_interval`` seconds, so neither the reads nor a slow or dead sidecar slow a step. The
allocator's peak statistics are read, never reset: the trainer's own logging may read them too.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Dict, Optional, Tuple

from .frameworks import framework_memory
from .guard import Guard

log = logging.getLogger("memguard_client")

#: Least seconds between two step reports (the sidecar samples every 100 ms by default).
DEFAULT_MIN_INTERVAL = 0.2

def device_figures() -> Dict[str, Any]:
    """The report fields of the framework in use (:func:`memguard_client.frameworks.framework_memory`:
    allocated, reserved, peak and total of the current CUDA device) plus
    ``reserved_peak_bytes`` (``torch.cuda.max_memory_reserved``) when CUDA is initialised in this
    process; ``{}`` on a CPU. Never raises."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return {}
        body: Dict[str, Any] = dict(framework_memory(import_missing=False) or {})
        peak = int(torch.cuda.max_memory_reserved(torch.cuda.current_device()))
        total = body.get("total_bytes")
        if peak >= 0 and (not isinstance(total, int) or peak <= total):
            body["reserved_peak_bytes"] = peak
        return body
    except Exception:
        return {}


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
        self._latest: Optional[Tuple[int, int]] = None
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
        """The trainer runs ``step`` at micro-batch ``batch_size``: hand it to the sender, which
        reads the device figures (peaks so far: read a moment later, they still cover this
        step). Never raises, never blocks on the network."""
        if not self.active or self._stop.is_set():
            return
        with self._lock:
            self._latest = (int(step), int(batch_size))
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
            step, batch = latest
            try:
                if self.guard.report_step(step=step, batch_size=batch, figures=device_figures()):
                    self.sent += 1
            except Exception as err:  # the sender must outlive any surprise
                log.debug("memguard: step report failed: %s", err)
            self._stop.wait(self.min_interval)

    def close(self) -> None:
        """Stop sending (the thread is a daemon: closing is optional)."""
        self._stop.set()
        self._wake.set()
