"""Allocator figures from the training framework in use (torch, MLX, mxnet).

Nothing here imports a framework at module import. :func:`framework_memory` prefers a framework
the process has already imported (cheap, and the one actually training) and only then tries to
import one. Every probe is wrapped: a missing framework, a CPU-only build or an API that moved
gives ``None``, never an exception.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Callable, Dict, Optional, Set

#: Report fields as sent to `POST /v1/report` (see memguard_api::signal::Report).
FrameworkMemory = Dict[str, object]


_MISSING: Set[str] = set()


def _module(name: str, import_missing: bool) -> Optional[ModuleType]:
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    if not import_missing or name in _MISSING:
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or a broken install raising anything else
        _MISSING.add(name)  # do not search sys.path again on every report
        return None


def _int(value: object) -> Optional[int]:
    try:
        n = int(value)  # type: ignore[call-overload]
    except Exception:
        return None
    return n if n >= 0 else None


def _call(fn: Optional[Callable[[], object]]) -> Optional[int]:
    if fn is None:
        return None
    try:
        return _int(fn())
    except Exception:
        return None


def torch_memory(import_missing: bool = False) -> Optional[FrameworkMemory]:
    """``torch.cuda`` figures of the current device (or ``torch.mps`` on Apple), else ``None``."""
    torch = _module("torch", import_missing)
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if cuda.is_available():
            dev = cuda.current_device()
            total = None
            try:
                total = _int(cuda.get_device_properties(dev).total_memory)
            except Exception:
                pass
            return _clean(
                {
                    "framework": "torch",
                    "allocated_bytes": _int(cuda.memory_allocated(dev)),
                    "reserved_bytes": _int(cuda.memory_reserved(dev)),
                    "peak_bytes": _int(cuda.max_memory_allocated(dev)),
                    "total_bytes": total,
                }
            )
        mps = getattr(torch, "mps", None)
        backends_mps = getattr(getattr(torch, "backends", None), "mps", None)
        if mps is not None and backends_mps is not None and backends_mps.is_available():
            return _clean(
                {
                    "framework": "torch",
                    "allocated_bytes": _call(getattr(mps, "current_allocated_memory", None)),
                    "reserved_bytes": _call(getattr(mps, "driver_allocated_memory", None)),
                }
            )
    except Exception:
        return None
    return None


def mlx_memory(import_missing: bool = False) -> Optional[FrameworkMemory]:
    """MLX figures: ``mx.get_active_memory/get_peak_memory/get_cache_memory``.

    Falls back to the older ``mx.metal.*`` names. ``reserved_bytes`` is active + cache.
    """
    mx = _module("mlx.core", import_missing)
    if mx is None:
        return None

    def pick(name: str) -> Optional[Callable[[], object]]:
        fn = getattr(mx, name, None)
        if fn is None:
            fn = getattr(getattr(mx, "metal", None), name, None)
        return fn

    try:
        active = _call(pick("get_active_memory"))
        peak = _call(pick("get_peak_memory"))
        cache = _call(pick("get_cache_memory"))
        if active is None and peak is None and cache is None:
            return None
        total = None
        info = getattr(mx, "device_info", None) or getattr(
            getattr(mx, "metal", None), "device_info", None
        )
        if info is not None:
            try:
                total = _int(info().get("memory_size"))
            except Exception:
                total = None
        reserved = active + cache if active is not None and cache is not None else None
        return _clean(
            {
                "framework": "mlx",
                "allocated_bytes": active,
                "reserved_bytes": reserved,
                "peak_bytes": peak,
                "total_bytes": total,
            }
        )
    except Exception:
        return None


def mxnet_memory(import_missing: bool = False) -> Optional[FrameworkMemory]:
    """mxnet figures of GPU 0 from ``mx.context.gpu_memory_info`` (used = total − free)."""
    mx = _module("mxnet", import_missing)
    if mx is None:
        return None
    try:
        ctx = getattr(mx, "context", None)
        if ctx is None or ctx.num_gpus() < 1:
            return None
        free, total = ctx.gpu_memory_info(0)
        used = _int(total - free)
        return _clean(
            {"framework": "mxnet", "reserved_bytes": used, "total_bytes": _int(total)}
        )
    except Exception:
        return None


_PROBES = (("torch", torch_memory), ("mlx.core", mlx_memory), ("mxnet", mxnet_memory))


def framework_memory(import_missing: bool = True) -> Optional[FrameworkMemory]:
    """Figures of the first framework with something to say, or ``None``.

    Frameworks already imported are asked first; with ``import_missing`` the others are then
    imported (once per process, by Python's module cache) and asked.
    """
    for name, probe in _PROBES:
        if name in sys.modules:
            found = probe(False)
            if found is not None:
                return found
    if import_missing:
        for name, probe in _PROBES:
            if name not in sys.modules:
                found = probe(True)
                if found is not None:
                    return found
    return None


def _clean(d: FrameworkMemory) -> FrameworkMemory:
    return {k: v for k, v in d.items() if v is not None}
