"""Re-chunking a batch into micro-batches, framework-agnostic.

The trainer keeps loading batches of its *original* size ``B`` (so the data order, the number
of optimizer steps, the learning-rate schedule and the effective batch ``B × accumulation`` do
not change) and runs each batch as micro-batches of the recommended size ``b``. Micro-batch
``i`` with ``n_i`` rows gets the weight ``n_i / B``: for a loss that is a mean over rows,
``Σ_i (n_i / B) · mean_i = mean over the whole batch``, so the accumulated gradient equals the
full-batch gradient (up to floating-point rounding), whatever ``b`` is and even when ``b`` does
not divide ``B``.

A batch may be a tensor/array (anything with ``.shape`` and slicing), a mapping of such (HF
``BatchEncoding``, dicts), a tuple/list of such (``(inputs, labels)``), or a plain list of
samples. Values whose first dimension is not the batch dimension (scalars, 0-d tensors, a
``num_items_in_batch`` count) are passed to every micro-batch unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, List, Mapping, Optional, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class MicroBatch(Generic[T]):
    """One micro-batch: rows ``[start, stop)`` of the batch, and its loss weight."""

    data: T
    start: int
    stop: int
    weight: float

    @property
    def rows(self) -> int:
        """Number of rows in this micro-batch."""
        return self.stop - self.start


def _leading_dim(value: Any) -> Optional[int]:
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        if len(shape) == 0:
            return None
        return int(shape[0])
    except Exception:
        return None


def _is_structure(seq: Any) -> bool:
    # A tuple/list of tensors (or of tensors and mappings of tensors) is a collated structure,
    # e.g. (inputs, labels); anything else, a list of dicts included, is a list of samples.
    if not isinstance(seq, (tuple, list)) or len(seq) == 0:
        return False
    tensors = [_leading_dim(v) is not None for v in seq]
    return any(tensors) and all(t or isinstance(v, Mapping) for t, v in zip(tensors, seq))


def batch_rows(batch: Any) -> Optional[int]:
    """Number of rows of ``batch``, or ``None`` when it has no batch dimension."""
    n = _leading_dim(batch)
    if n is not None:
        return n
    if isinstance(batch, Mapping):
        for value in batch.values():
            n = batch_rows(value)
            if n is not None:
                return n
        return None
    if _is_structure(batch):
        for value in batch:
            n = batch_rows(value)
            if n is not None:
                return n
        return None
    if isinstance(batch, (list, tuple)):
        return len(batch)
    return None


def slice_batch(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``[start, stop)`` of ``batch`` (whose batch dimension is ``rows``)."""
    if _leading_dim(batch) is not None:
        return batch[start:stop] if _leading_dim(batch) == rows else batch
    if isinstance(batch, Mapping):
        sliced = {k: slice_batch(v, start, stop, rows) for k, v in batch.items()}
        try:
            return type(batch)(sliced)  # type: ignore[call-arg]
        except Exception:
            return sliced
    if _is_structure(batch):
        parts = [slice_batch(v, start, stop, rows) for v in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*parts)
        return type(batch)(parts)
    if isinstance(batch, (list, tuple)) and len(batch) == rows:
        return batch[start:stop]
    return batch


def micro_batches(batch: T, size: Callable[[], int]) -> Iterator[MicroBatch[T]]:
    """The micro-batches of ``batch``, each of at most ``size()`` rows, weighted rows / B: the one
    micro-batching core of the torch and MLX adapters.

    ``size`` is read before the first micro-batch and again before each next one, so a
    downgrade may apply within the batch (and only then is the next micro-batch sliced: one is
    alive at a time). A batch with no batch dimension, or no larger than the first size, is one
    micro-batch of weight 1 (the object itself, not a copy).
    """
    rows = batch_rows(batch)
    step = max(1, int(size()))
    if rows is None or rows <= step:
        yield MicroBatch(batch, 0, rows or 0, 1.0)
        return
    start = 0
    while start < rows:
        stop = min(rows, start + step)
        yield MicroBatch(slice_batch(batch, start, stop, rows), start, stop, (stop - start) / rows)
        start = stop
        if start < rows:
            step = max(1, int(size()))


def split_batch(batch: T, micro_size: int) -> List[MicroBatch[T]]:
    """Split ``batch`` into micro-batches of at most ``micro_size`` rows, weighted rows / B.

    A batch with no batch dimension, or no larger than ``micro_size``, is one micro-batch of
    weight 1 (the object itself, not a copy).
    """
    return list(micro_batches(batch, lambda: micro_size))
