"""memguard_client: the trainer side of memguard.

>>> from memguard_client import Guard
>>> guard = Guard()          # MEMGUARD_* env; a no-op with the starting values without them
>>> guard.refresh()          # True when the sidecar sent a newer signal
>>> guard.batch_size, guard.grad_accumulation, guard.grad_checkpointing, guard.level

Standard library only. Framework adapters import their framework lazily:
:mod:`memguard_client.hf` (Hugging Face Trainer), :mod:`memguard_client.torch` (micro-batching
with accumulation), :mod:`memguard_client.mlx` (MLX memory report). :mod:`memguard_client.auto`
attaches the client to a stock ``transformers.Trainer`` when the webhook injected it.

The names below are imported on first use: the injected start-up hook imports
:mod:`memguard_client.auto` in every Python process of the pod, and must not pay for
``urllib.request`` there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .guard import Guard
    from .signal import LEVELS, SIGNAL_VERSION, Pressure, Signal, parse_signal

__all__ = ["Guard", "Signal", "Pressure", "parse_signal", "LEVELS", "SIGNAL_VERSION"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Guard":
        from .guard import Guard

        return Guard
    if name in __all__:
        from . import signal

        return getattr(signal, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
