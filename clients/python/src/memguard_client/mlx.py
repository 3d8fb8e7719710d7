"""MLX helper: micro-batches that follow the signal, limits from the budget, a leak check, and
the allocator figures reported to the sidecar.

A sidecar cannot see Apple-silicon unified memory per process the way it sees a cgroup, so an
MLX trainer reports its own figures; and it cannot shrink an MLX batch from outside, so the
training step runs through :class:`MicroBatcher`::

    import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim
    from memguard_client import Guard
    from memguard_client.mlx import MicroBatcher

    batcher = MicroBatcher(Guard())            # MLX memory and cache limits from the budget
    for step, (x, y) in enumerate(batches):     # batches of the original size B
        batcher.refresh()                        # picks up a downgrade, clears the MLX cache
        loss, grads = batcher.value_and_grad(model, loss_fn, (x, y))
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
        batcher.end_step(step)                   # report + leak check on their cadence

``loss_fn(model, *batch)`` returns the mean loss over the rows of ``batch``, or, like mlx_lm's
``default_loss``, a tuple ``(loss, ntoks)`` of a per-token mean and its token count. Either way
the loss and the gradient returned are those of the whole batch.

With a budget the constructor also makes freed buffers go back to the kernel on Linux with
glibc (:mod:`memguard_client.allocator`): without that, a downgrade on MLX's CPU backend can
raise the process's peak memory instead of lowering it.

``mlx`` is imported on first use; without it :func:`memory` returns ``None``, the reports and
the leak check do nothing, and only :meth:`MicroBatcher.value_and_grad` needs it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import allocator as _allocator
from . import env as _env
from .batching import micro_batches
from .frameworks import _module, mlx_memory
from .guard import Guard

log = logging.getLogger("memguard_client")

#: ``mx.set_memory_limit`` = this × ``MEMGUARD_BUDGET_BYTES``. MLX's limit is a guideline for
#: graph evaluation (MLX 0.32 has no strict mode: it is what older releases called
#: ``relaxed=True``): past it MLX frees its cache and waits for running work before it
#: allocates more, and fails only when the system itself has no memory left. The 5 % left over
#: is for what is not MLX's: the Python heap, the data pipeline, the runtime.
MEMORY_LIMIT_FRACTION = 0.95
#: ``mx.set_cache_limit`` = this × ``MEMGUARD_BUDGET_BYTES``. Freed buffers MLX keeps for
#: reuse beyond this are returned to the system at the next allocation, so the cache cannot
#: hold on to memory a smaller batch gave back (MLX's default cache limit is the memory limit).
CACHE_LIMIT_FRACTION = 0.10

#: Steps between two reports of the figures to the sidecar (the cadence of the docs' loops).
REPORT_EVERY = 10
#: Steps between two leak checks (each one clears the MLX cache first).
LEAK_CHECK_EVERY = 50
#: Checks a leak must rise through, every one of them, to be reported.
LEAK_WINDOW = 5
#: Growth over the window below which it is noise, not a leak.
LEAK_TOLERANCE_BYTES = 1 << 20


def memory() -> Optional[Dict[str, Any]]:
    """MLX figures as report fields (``allocated_bytes`` = active, ``peak_bytes`` = peak,
    ``reserved_bytes`` = active + cache, ``total_bytes`` when the device says), or ``None``."""
    return mlx_memory(import_missing=True)


def report_memory(guard: Guard, step: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """POST the MLX figures to the sidecar; returns the body, or ``None`` without MLX."""
    return guard.report_figures(memory(), step)


# --- limits from the budget -------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What :func:`set_limits_from_budget` set, in bytes."""

    budget_bytes: int
    memory_limit_bytes: int
    cache_limit_bytes: int


def set_limits_from_budget(
    env: Optional[Mapping[str, str]] = None,
    *,
    memory_fraction: float = MEMORY_LIMIT_FRACTION,
    cache_fraction: float = CACHE_LIMIT_FRACTION,
) -> Optional[Limits]:
    """``mx.set_memory_limit`` and ``mx.set_cache_limit`` as fractions of the budget.

    The budget is ``MEMGUARD_BUDGET_BYTES`` (written by the webhook). Returns what was set, or
    ``None`` when the variable is unset, when MLX is not installed, or when the value is not a
    positive integer (logged as a warning naming the value: a malformed budget sets nothing
    rather than a guessed limit).
    """
    if not 0.0 < memory_fraction <= 1.0 or not 0.0 <= cache_fraction <= memory_fraction:
        raise ValueError(
            f"fractions must satisfy 0 <= cache ({cache_fraction}) <= memory "
            f"({memory_fraction}) <= 1 and memory > 0"
        )
    environ: Mapping[str, str] = os.environ if env is None else env
    raw = environ.get(_env.BUDGET_BYTES)
    if raw is None:
        return None
    try:
        budget = int(raw.strip())
    except ValueError:
        budget = 0
    if budget <= 0:
        log.warning("memguard: %s=%r is not a positive byte count; MLX limits not set", _env.BUDGET_BYTES, raw)
        return None
    mx = _module("mlx.core", True)
    if mx is None:
        return None
    limits = Limits(budget, int(budget * memory_fraction), int(budget * cache_fraction))
    mx.set_memory_limit(limits.memory_limit_bytes)
    mx.set_cache_limit(limits.cache_limit_bytes)
    log.info(
        "memguard: MLX memory limit %d, cache limit %d (budget %d)",
        limits.memory_limit_bytes,
        limits.cache_limit_bytes,
        budget,
    )
    return limits


# --- leak detection ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Leak:
    """A growth of active memory that rose at every check of the window."""

    #: Least-squares slope over the window, bytes per second (what the sidecar receives).
    bytes_per_second: float
    #: The same slope per training step.
    bytes_per_step: float
    #: Last reading minus the first of the window.
    growth_bytes: int
    #: Step of the window's first reading.
    since_step: int


class LeakDetector:
    """Steady growth of active memory read after ``mx.clear_cache()`` at step boundaries.

    A leak is ``window`` consecutive readings each strictly above the one before, rising by more
    than ``tolerance_bytes`` in all. Readings after clearing the cache at a step boundary are
    exact (a steady loop reads the same bytes every time), so the rule can be this strict: a
    one-off rise (Adam's state allocated at the first update, a larger last batch) is a
    plateau, not a leak. It is the sidecar's rule (at least 90 % of the steps of its window
    non-decreasing and a positive slope, on noisy working-set samples) with a window of checks
    instead of seconds; the slope it reports is fitted the same way (least squares).
    """

    def __init__(self, window: int = LEAK_WINDOW, tolerance_bytes: int = LEAK_TOLERANCE_BYTES) -> None:
        if window < 2:
            raise ValueError(f"leak window must be at least 2 checks, got {window}")
        if tolerance_bytes < 0:
            raise ValueError(f"leak tolerance must be >= 0 bytes, got {tolerance_bytes}")
        self.window = window
        self.tolerance_bytes = tolerance_bytes
        self._points: List[Tuple[int, float, int]] = []
        self.leak: Optional[Leak] = None

    @property
    def readings(self) -> Sequence[Tuple[int, float, int]]:
        """The window's ``(step, seconds, active_bytes)`` readings, oldest first."""
        return tuple(self._points)

    def observe(self, step: int, active_bytes: int, now: Optional[float] = None) -> Optional[Leak]:
        """Add a reading; returns the leak now seen (also kept in :attr:`leak`), or ``None``."""
        t = time.monotonic() if now is None else now
        self._points.append((step, t, int(active_bytes)))
        del self._points[: -self.window]
        self.leak = self._assess()
        return self.leak

    def _assess(self) -> Optional[Leak]:
        pts = self._points
        if len(pts) < self.window:
            return None
        if any(b[2] <= a[2] for a, b in zip(pts, pts[1:])):
            return None
        growth = pts[-1][2] - pts[0][2]
        if growth <= self.tolerance_bytes:
            return None
        per_s = _slope([p[1] for p in pts], [p[2] for p in pts])
        per_step = _slope([float(p[0]) for p in pts], [p[2] for p in pts])
        return Leak(
            bytes_per_second=max(per_s, 0.0),
            bytes_per_step=max(per_step, 0.0),
            growth_bytes=growth,
            since_step=pts[0][0],
        )


def _slope(xs: Sequence[float], ys: Sequence[int]) -> float:
    n = len(xs)
    mx_, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx_) ** 2 for x in xs)
    if sxx <= 0:
        return 0.0
    return sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx


# --- the training step ------------------------------------------------------------------------


class MicroBatcher:
    """Runs each batch as micro-batches of the guard's batch size; MLX's limits and cache.

    Args:
        guard: the :class:`~memguard_client.Guard` to follow (default: ``Guard()`` from env).
        env: where ``MEMGUARD_BUDGET_BYTES`` is read (default ``os.environ``).
        set_limits: set the MLX memory and cache limits from the budget now (default True).
        return_freed_memory: when the limits were set (a budget, so a memguard pod), also make
            freed buffers go back to the kernel on Linux with glibc (see
            :mod:`memguard_client.allocator`; default True). Without it a downgrade on MLX's CPU
            backend can raise the process's peak memory instead of lowering it.
        release_cache: after a downgrade, ``mx.clear_cache()`` and, on glibc,
            ``malloc_trim(0)``, so the cache leaves the process and not only MLX (default True).
        report_every: :meth:`end_step` reports the figures every this many steps (0: never).
        leak_every: :meth:`end_step` runs the leak check every this many steps (0: never).
        leak_window, leak_tolerance_bytes: see :class:`LeakDetector`.
    """

    def __init__(
        self,
        guard: Optional[Guard] = None,
        *,
        env: Optional[Mapping[str, str]] = None,
        set_limits: bool = True,
        return_freed_memory: bool = True,
        release_cache: bool = True,
        report_every: int = REPORT_EVERY,
        leak_every: int = LEAK_CHECK_EVERY,
        leak_window: int = LEAK_WINDOW,
        leak_tolerance_bytes: int = LEAK_TOLERANCE_BYTES,
    ) -> None:
        if report_every < 0 or leak_every < 0:
            raise ValueError("report_every and leak_every must be >= 0")
        self.guard = guard if guard is not None else Guard()
        self.release_cache = release_cache
        self.report_every = report_every
        self.leak_every = leak_every
        self.leaks = LeakDetector(leak_window, leak_tolerance_bytes)
        self.cache_releases = 0
        #: Reports sent to the sidecar, and how many it accepted (none without a sidecar URL).
        self.reports_sent = 0
        self.reports_accepted = 0
        self.limits: Optional[Limits] = set_limits_from_budget(env) if set_limits else None
        #: Whether freed buffers now go back to the kernel (glibc's mmap threshold fixed).
        self.freed_memory_returned = bool(
            self.limits is not None and return_freed_memory and _allocator.return_freed_memory()
        )
        self._vg: Optional[Tuple[Any, Any, Any]] = None
        #: Micro-batch sizes of the last :meth:`value_and_grad`.
        self.last_micro: List[int] = []

    @property
    def micro_batch_size(self) -> int:
        """Rows per micro-batch now (the guard's batch size)."""
        return self.guard.batch_size

    def refresh(self) -> bool:
        """Follow the guard; after a downgrade (smaller batch) clear MLX's cache and hand the
        freed pages back to the kernel (``malloc_trim``, glibc only).

        Returns True when a newer signal arrived.
        """
        before = self.guard.batch_size
        changed = self.guard.refresh()
        if changed and self.guard.batch_size < before and self.release_cache:
            mx = _module("mlx.core", False)
            if mx is not None:
                mx.clear_cache()
                _allocator.trim()
                self.cache_releases += 1
        return changed

    def value_and_grad(
        self, model: Any, loss_fn: Callable[..., Any], batch: Any, *, follow: bool = False
    ) -> Tuple[Any, Any]:
        """``(loss, grads)`` of the whole ``batch``, computed in micro-batches.

        ``batch`` is a tuple of arrays whose first axis is rows (one array alone is taken as a
        1-tuple). Micro-batch ``i`` of ``n_i`` of the ``B`` rows goes through
        ``mlx.nn.value_and_grad(model, loss_fn)`` and its gradient is accumulated with weight
        ``n_i / B``; when ``loss_fn`` returns ``(loss, ntoks)`` (mlx_lm's losses: a mean over
        tokens) the weight is ``ntoks_i / Σ ntoks`` instead and ``(loss, Σ ntoks)`` is returned.
        The loss and gradients equal the full batch's up to rounding. Each micro-batch is
        evaluated (``mx.eval``) before the next is built, so only one micro-batch's activations
        are alive at a time. With ``follow`` the signal is also followed between micro-batches
        (:meth:`refresh`), so a downgrade applies within the step (one process only: ranks
        would no longer agree on where the step changes size). :attr:`last_micro` holds the
        micro-batch sizes of the last call.
        """
        nn, mx, tree_map = self._mlx()
        parts = batch if isinstance(batch, tuple) else (batch,)
        rows = _rows(parts)
        size = max(1, self.guard.batch_size)
        vg = nn.value_and_grad(model, loss_fn)
        if rows <= size and not follow:
            self.last_micro = [rows]
            return vg(model, *parts)  # type: ignore[no-any-return]
        grads: Any = None
        loss_sum: Any = 0.0
        tokens = 0.0
        by_tokens: Optional[bool] = None
        self.last_micro = []
        started = False

        def next_size() -> int:
            # With ``follow``, the signal is read again before every micro-batch but the first.
            nonlocal started
            if follow and started:
                self.refresh()
            started = True
            return max(1, self.guard.batch_size)

        for micro in micro_batches(parts, next_size):
            self.last_micro.append(micro.rows)
            value, g = vg(model, *micro.data)
            counted = isinstance(value, (tuple, list))
            if by_tokens is None:
                by_tokens = counted
            elif by_tokens != counted:
                raise TypeError("loss_fn returned a (loss, count) tuple for some micro-batches only")
            if counted:
                loss, count = value[0], value[1]
                mx.eval(count)
                weight = float(count.item() if hasattr(count, "item") else count)
                tokens += weight
            else:
                loss, weight = value, micro.weight
            g = tree_map(lambda x, w=weight: x * w, g)
            grads = g if grads is None else tree_map(lambda a, b: a + b, grads, g)
            loss_sum = loss_sum + loss * weight
            mx.eval(grads, loss_sum)  # the boundary: this micro-batch's graph is freed here
        if by_tokens:
            if tokens <= 0:
                raise ValueError("loss_fn counted no tokens in the whole batch")
            grads = tree_map(lambda x: x / tokens, grads)
            return (loss_sum / tokens, mx.array(tokens)), grads
        return loss_sum, grads

    def end_step(self, step: int) -> Optional[Dict[str, Any]]:
        """Call once per optimizer step, after it: the leak check and the report, each on its
        cadence (``step % leak_every == 0``, ``step % report_every == 0``).

        The leak check clears the MLX cache and reads active memory. The report carries active
        (``allocated_bytes``), peak, active + cache (``reserved_bytes``) and, while a leak is
        seen, ``leak_bytes_per_second``. Returns the report body when one was due.
        """
        if self.leak_every and step % self.leak_every == 0:
            self.check_leak(step)
        if self.report_every and step % self.report_every == 0:
            return self.report(step)
        return None

    def check_leak(self, step: int) -> Optional[Leak]:
        """``mx.clear_cache()``, then one reading of active memory for the leak detector."""
        mx = _module("mlx.core", False)
        if mx is None:
            return None
        mx.clear_cache()
        leak = self.leaks.observe(step, int(mx.get_active_memory()))
        if leak is not None:
            log.warning(
                "memguard: MLX active memory rose at each of the last %d checks: +%d bytes "
                "since step %d (%.0f bytes/step)",
                self.leaks.window,
                leak.growth_bytes,
                leak.since_step,
                leak.bytes_per_step,
            )
        return leak

    def report(self, step: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """POST the MLX figures (and the leak, while one is seen); returns the body."""
        figures = memory()
        if figures is None:
            return None
        body: Dict[str, Any] = dict(figures)
        leak = self.leaks.leak
        if leak is not None:
            body["leak_bytes_per_second"] = int(round(leak.bytes_per_second))
        if step is not None:
            body["step"] = step
        body["batch_size"] = self.guard.batch_size
        self.reports_sent += 1
        if self.guard.report(**body):
            self.reports_accepted += 1
        return body

    def _mlx(self) -> Tuple[Any, Any, Any]:
        if self._vg is None:
            import mlx.core as mx
            import mlx.nn as nn
            from mlx.utils import tree_map

            self._vg = (nn, mx, tree_map)
        return self._vg


def _rows(parts: Tuple[Any, ...]) -> int:
    if not parts:
        raise ValueError("batch is an empty tuple")
    dims = []
    for i, a in enumerate(parts):
        shape = getattr(a, "shape", None)
        if not shape:
            raise ValueError(f"batch[{i}] has no first axis (shape {shape!r}): every part is sliced by rows")
        dims.append(int(shape[0]))
    if len(set(dims)) != 1:
        raise ValueError(f"batch parts disagree on the number of rows: {dims}")
    return dims[0]
