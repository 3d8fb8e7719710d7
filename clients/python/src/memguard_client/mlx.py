"""MLX helper: report ``mx.get_active_memory/get_peak_memory/get_cache_memory`` to the sidecar.

A sidecar cannot see Apple-silicon unified memory per process the way it sees a cgroup, so an
MLX trainer reports its own figures::

    from memguard_client import Guard
    from memguard_client.mlx import report_memory

    guard = Guard()
    for step, batch in enumerate(batches):
        ...
        if step % 10 == 0:
            report_memory(guard, step=step)

``mlx`` is imported on first use; without it :func:`memory` returns ``None`` and
:func:`report_memory` does nothing.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .frameworks import mlx_memory
from .guard import Guard


def memory() -> Optional[Dict[str, Any]]:
    """MLX figures as report fields (``allocated_bytes`` = active, ``peak_bytes`` = peak,
    ``reserved_bytes`` = active + cache, ``total_bytes`` when the device says), or ``None``."""
    return mlx_memory(import_missing=True)


def report_memory(guard: Guard, step: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """POST the MLX figures to the sidecar; returns the body, or ``None`` without MLX."""
    return guard.report_figures(memory(), step)
