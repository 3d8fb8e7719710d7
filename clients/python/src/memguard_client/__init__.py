"""memguard_client: the trainer side of memguard.

>>> from memguard_client import Guard
>>> guard = Guard()          # MEMGUARD_* env; a no-op with the starting values without them
>>> guard.refresh()          # True when the sidecar sent a newer signal
>>> guard.batch_size, guard.grad_accumulation, guard.grad_checkpointing, guard.level

Standard library only. Framework adapters import their framework lazily:
:mod:`memguard_client.hf` (Hugging Face Trainer), :mod:`memguard_client.torch` (micro-batching
with accumulation), :mod:`memguard_client.mlx` (MLX memory report).
"""

from .guard import Guard
from .signal import LEVELS, SIGNAL_VERSION, Pressure, Signal, parse_signal

__all__ = ["Guard", "Signal", "Pressure", "parse_signal", "LEVELS", "SIGNAL_VERSION"]
__version__ = "0.1.0"
