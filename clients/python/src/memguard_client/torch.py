"""PyTorch helper: run each batch as micro-batches of the recommended size.

The data loader keeps yielding batches of the original size ``B``; :class:`MicroBatcher` splits
each into micro-batches of ``guard.batch_size`` rows and scales each micro-batch's loss by
``rows / B`` before ``backward()``, so the accumulated gradient is the full-batch gradient and
the optimizer step, schedule and effective batch are unchanged::

    from memguard_client import Guard
    from memguard_client.torch import MicroBatcher

    batcher = MicroBatcher(Guard())
    for batch in loader:                         # batches of the original size
        batcher.refresh()                        # picks up a downgrade, frees the CUDA cache
        loss = batcher.backward(batch, lambda mb: loss_fn(model(mb["x"]), mb["y"]), model=model)
        optimizer.step(); optimizer.zero_grad()

``torch`` is imported only when a function needs it; without torch (or without CUDA) the cache
release is a no-op and :meth:`MicroBatcher.backward` works with any loss object that supports
``* float`` and ``.backward()``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, ContextManager, List, Optional

from .batching import MicroBatch, split_batch
from .guard import Guard


def empty_cache() -> bool:
    """``torch.cuda.empty_cache()`` when torch is imported and CUDA is available.

    Returns True when the cache was released. Never raises.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            return True
    except Exception:
        return False
    return False


class MicroBatcher:
    """Splits batches by the guard's recommended batch size, with loss scaling.

    Args:
        guard: the :class:`~memguard_client.Guard` to follow (default: ``Guard()`` from env).
        release_cache: call :func:`empty_cache` after a downgrade (default True).
    """

    def __init__(self, guard: Optional[Guard] = None, *, release_cache: bool = True) -> None:
        self.guard = guard if guard is not None else Guard()
        self.release_cache = release_cache
        self.cache_releases = 0

    @property
    def micro_batch_size(self) -> int:
        """Rows per micro-batch now (the guard's batch size)."""
        return self.guard.batch_size

    def refresh(self) -> bool:
        """Follow the guard; after a downgrade (smaller batch) release the CUDA cache.

        Returns True when a newer signal arrived.
        """
        before = self.guard.batch_size
        changed = self.guard.refresh()
        if changed and self.guard.batch_size < before and self.release_cache:
            if empty_cache():
                self.cache_releases += 1
        return changed

    def split(self, batch: Any) -> List[MicroBatch[Any]]:
        """Micro-batches of ``batch`` at the current recommended size, weighted rows / B."""
        return split_batch(batch, self.guard.batch_size)

    def backward(
        self,
        batch: Any,
        loss_fn: Callable[[Any], Any],
        *,
        model: Any = None,
    ) -> float:
        """Forward and backward ``batch`` as micro-batches; returns the full-batch loss value.

        ``loss_fn(micro_batch)`` returns a scalar loss that is a mean over the micro-batch's
        rows. Each loss is multiplied by the micro-batch's weight before ``backward()``. When
        ``model`` has ``no_sync`` (DistributedDataParallel), every micro-batch but the last runs
        inside it, so gradients are all-reduced once per batch.
        """
        micro = self.split(batch)
        total = 0.0
        for i, mb in enumerate(micro):
            ctx = _no_sync(model) if i < len(micro) - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(mb.data) * mb.weight
                loss.backward()
            total += _item(loss)
        return total


def _no_sync(model: Any) -> ContextManager[Any]:
    no_sync = getattr(model, "no_sync", None)
    if callable(no_sync):
        return no_sync()  # type: ignore[no-any-return]
    return contextlib.nullcontext()


def _item(loss: Any) -> float:
    item = getattr(loss, "item", None)
    try:
        return float(item() if callable(item) else loss)
    except Exception:
        return float("nan")
