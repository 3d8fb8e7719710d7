"""Freed memory back to the kernel (Linux with glibc), so a smaller batch shows in the cgroup.

A framework that allocates its buffers with ``malloc`` (MLX's CPU backend does) frees them to
glibc, not to the kernel. glibc gives a block its own mapping, returned to the kernel at
``free``, only above its ``M_MMAP_THRESHOLD``; and it raises that threshold (up to 32 MiB on
64-bit) to the size of each mapped block freed. After a downgrade the micro-batch's buffers are
smaller than blocks freed before, so they come from the heap and stay resident after ``free``,
spread over holes that the next, differently shaped step cannot reuse. Measured with the MLX
survival trainer: the process's peak resident memory per step went *up* after a downgrade from
32 to 16 rows (154 → 178 MiB) where it should halve, and the sidecar, which sees the cgroup,
kept downgrading while the kernel killed the trainer anyway.

:func:`return_freed_memory` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, glibc's
starting value, which turns the raising off), so every large block stays a mapping of its own
and is unmapped when freed; :func:`trim` (``malloc_trim(0)``) hands back the free pages of the
heap. Elsewhere (macOS, musl) both do nothing and say so by returning False.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any, Optional

log = logging.getLogger("memguard_client")

#: What :func:`return_freed_memory` fixes ``M_MMAP_THRESHOLD`` at: blocks of at least this size
#: are mapped on their own. 128 KiB is glibc's own starting threshold, below any buffer whose
#: size follows the batch; the cost is one ``mmap`` and page faults per such block (the
#: framework's own cache, e.g. MLX's, still reuses buffers first).
MMAP_THRESHOLD_BYTES = 128 << 10

#: mallopt parameter number of ``M_MMAP_THRESHOLD`` in glibc's <malloc.h>.
_M_MMAP_THRESHOLD = -3

_LIBC: Any = None
_LOOKED = False


def _glibc() -> Optional[Any]:
    """glibc, loaded once; ``None`` off Linux or with another C library."""
    global _LIBC, _LOOKED
    if not _LOOKED:
        _LOOKED = True
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL("libc.so.6")
                # Only glibc has this symbol, and mallopt / malloc_trim with these meanings.
                libc.gnu_get_libc_version
                _LIBC = libc
            except (OSError, AttributeError):
                _LIBC = None
    return _LIBC


def return_freed_memory(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes``: blocks of that size or more are mapped
    on their own and go back to the kernel when freed. Process-wide; returns whether it was set
    (False off glibc, or when glibc refuses the value)."""
    if threshold_bytes <= 0:
        raise ValueError(f"mmap threshold must be a positive byte count, got {threshold_bytes}")
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold_bytes)))
    if ok:
        log.info(
            "memguard: glibc M_MMAP_THRESHOLD fixed at %d bytes: freed buffers go back to the kernel",
            threshold_bytes,
        )
    else:
        log.warning("memguard: glibc refused M_MMAP_THRESHOLD=%d", threshold_bytes)
    return ok


def trim() -> bool:
    """``malloc_trim(0)``: the heap's free pages back to the kernel. Returns whether glibc
    released any (False off glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))
