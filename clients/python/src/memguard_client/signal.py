"""The signal schema (version 1), shared with the sidecar's `memguard_api::signal`.

A signal is a JSON object::

    {"version": 1, "seq": 3, "level": "downgrade", "batch_size": 4,
     "grad_accumulation": 8, "grad_checkpointing": true, "reason": "...",
     "pressure": {"memory_ratio": 0.87, ...}, "timestamp": "2026-11-22T22:00:00.000Z"}

:func:`parse_signal` never raises: anything that is not a complete, valid version-1 signal
gives ``None`` and the caller keeps what it had.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

#: Schema version this client understands. A signal with another version is ignored.
SIGNAL_VERSION = 1

#: Levels, from least to most severe.
LEVELS = ("ok", "warn", "downgrade", "critical")

_PRESSURE_FLOATS = ("memory_ratio", "psi_some_avg10", "gpu_ratio", "seconds_to_limit")
_PRESSURE_INTS = ("working_set_bytes", "limit_bytes")


@dataclass(frozen=True)
class Pressure:
    """The figures behind a signal; ``None`` where the sidecar did not know them."""

    memory_ratio: Optional[float] = None
    working_set_bytes: Optional[int] = None
    limit_bytes: Optional[int] = None
    psi_some_avg10: Optional[float] = None
    gpu_ratio: Optional[float] = None
    seconds_to_limit: Optional[float] = None


@dataclass(frozen=True)
class Signal:
    """One signal from the sidecar: what the trainer should run with now, and why."""

    version: int
    seq: int
    level: str
    batch_size: int
    grad_accumulation: int
    grad_checkpointing: bool
    reason: str = ""
    pressure: Pressure = field(default_factory=Pressure)
    timestamp: str = ""

    @property
    def effective_batch(self) -> int:
        """``batch_size * grad_accumulation``: the effective batch the sidecar preserves."""
        return self.batch_size * self.grad_accumulation

    def timestamp_seconds(self) -> Optional[float]:
        """The timestamp as seconds since the epoch, or ``None`` when absent or unparsable."""
        return parse_rfc3339(self.timestamp)


def _as_int(value: Any) -> Optional[int]:
    # bool is a subclass of int; JSON true must not pass as a batch size.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _as_float(value: Any) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _parse_pressure(value: Any) -> Pressure:
    # Pressure is informative only: keep the figures that are well-typed, drop the rest.
    if not isinstance(value, Mapping):
        return Pressure()
    kwargs: Dict[str, Any] = {}
    for key in _PRESSURE_FLOATS:
        f = _as_float(value.get(key))
        if f is not None:
            kwargs[key] = f
    for key in _PRESSURE_INTS:
        n = _as_int(value.get(key))
        if n is not None and n >= 0:
            kwargs[key] = n
    return Pressure(**kwargs)


def signal_from_dict(obj: Any) -> Optional[Signal]:
    """A :class:`Signal` from a decoded JSON value, or ``None`` when it is not a valid v1 signal.

    The fields a trainer acts on (version, seq, level, batch_size, grad_accumulation,
    grad_checkpointing) must be present and well-typed; unknown extra fields are tolerated
    (additive changes keep the version).
    """
    if not isinstance(obj, Mapping):
        return None
    version = _as_int(obj.get("version"))
    if version != SIGNAL_VERSION:
        return None
    seq = _as_int(obj.get("seq"))
    level = obj.get("level")
    batch = _as_int(obj.get("batch_size"))
    accum = _as_int(obj.get("grad_accumulation"))
    ckpt = obj.get("grad_checkpointing")
    if seq is None or seq < 0:
        return None
    if not isinstance(level, str) or level not in LEVELS:
        return None
    if batch is None or batch < 1:
        return None
    if accum is None or accum < 1:
        return None
    if not isinstance(ckpt, bool):
        return None
    reason = obj.get("reason")
    timestamp = obj.get("timestamp")
    return Signal(
        version=SIGNAL_VERSION,
        seq=seq,
        level=level,
        batch_size=batch,
        grad_accumulation=accum,
        grad_checkpointing=ckpt,
        reason=reason if isinstance(reason, str) else "",
        pressure=_parse_pressure(obj.get("pressure")),
        timestamp=timestamp if isinstance(timestamp, str) else "",
    )


def parse_signal(data: "bytes | str") -> Optional[Signal]:
    """Parse the bytes of a signal file or HTTP body. Never raises; ``None`` when invalid."""
    try:
        if isinstance(data, bytes):
            data = data.decode("utf-8")
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return signal_from_dict(obj)


def parse_rfc3339(text: str) -> Optional[float]:
    """Seconds since the epoch of an RFC 3339 timestamp (``Z`` or offset), or ``None``."""
    if not isinstance(text, str) or not text:
        return None
    s = text.strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    # Python 3.9's fromisoformat accepts only 3 or 6 fractional digits: normalise to 6.
    head, sep, frac_and_tz = s.partition(".")
    if sep:
        digits = ""
        rest = frac_and_tz
        while rest and rest[0].isdigit():
            digits += rest[0]
            rest = rest[1:]
        s = head + "." + (digits + "000000")[:6] + rest
    try:
        parsed = _dt.datetime.fromisoformat(s)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=_dt.timezone.utc)
    return parsed.timestamp()
