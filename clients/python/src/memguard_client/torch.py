"""PyTorch helper: run each batch as micro-batches of the recommended size, agreed by every rank.

The data loader keeps yielding batches of the original size ``B``; :class:`MicroBatcher` splits
each into micro-batches of the agreed size and scales each micro-batch's loss by ``rows / B``
before ``backward()``, so the accumulated gradient is the full-batch gradient and the optimizer
step, schedule and effective batch are unchanged::

    from memguard_client import Guard
    from memguard_client.torch import MicroBatcher

    batcher = MicroBatcher(Guard())
    for batch in loader:                         # batches of the original size
        loss = batcher.backward(batch, lambda mb: loss_fn(model(mb["x"]), mb["y"]), model=model)
        batcher.step(optimizer)                  # optimizer.step() + zero_grad(), unless skipped

Each :meth:`MicroBatcher.backward` call is a step boundary: the guard is refreshed and, when
``torch.distributed`` is initialised with several ranks, the micro-batch size (smallest wins)
and gradient checkpointing (any wins) are agreed in one tiny collective, so DDP and FSDP ranks
run the same number of forward/backward passes. Every rank must call ``backward`` once per
batch. An out-of-memory error inside a micro-batch is recovered in-process (halve, run the rest
again, exact or the step skipped and counted; see :mod:`memguard_client.recovery`).

With FSDP and several ranks, a downgrade (or ``MEMGUARD_GRAD_SYNC=each-batch``) makes every
micro-batch reduce-scatter its gradients instead of running under ``no_sync``, so they stay
sharded (:attr:`MicroBatcher.sync_each_batch`); pass ``accelerator=`` to set Accelerate's
``sync_each_batch`` at the same step for a loop that accumulates with ``accelerator.accumulate``.

``torch`` is imported only when a function needs it; without torch (or without CUDA) the cache
release is a no-op and :meth:`MicroBatcher.backward` works with any loss object that supports
``* float`` and ``.backward()``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

from .batching import MicroBatch, split_batch
from .guard import Guard
from .recovery import (
    DEFAULT_MAX_OOM_RETRIES,
    RunnerCounters,
    empty_cache,
    enable_checkpointing,
    follow,
    grads_fresh,
    is_fsdp,
    force_sync_of,
    no_sync_of,
    sync_each_batch_on,
    unwrap,
    zero_grads,
)
from .train_config import loop_config

log = logging.getLogger("memguard_client")

__all__ = ["MicroBatcher", "empty_cache"]


class MicroBatcher(RunnerCounters):
    """Splits batches by the agreed micro-batch size, with loss scaling and OOM recovery.

    Args:
        guard: the :class:`~memguard_client.Guard` to follow (default: ``Guard()`` from env).
        release_cache: call :func:`empty_cache` after a downgrade (default True).
        agree: agree with the other ranks through ``torch.distributed`` (default True).
        recover_oom: recover from out-of-memory errors in-process (default True).
        max_oom_retries: OOM retries allowed within one batch.
        sync_each_batch: FSDP with several ranks: ``None`` (default) syncs gradients at every
            micro-batch from a downgrade on (or from the start with
            ``MEMGUARD_GRAD_SYNC=each-batch``), ``True`` always, ``False`` never.
        accelerator: an HF ``Accelerator`` whose ``sync_each_batch`` is set at the same step.
    """

    def __init__(
        self,
        guard: Optional[Guard] = None,
        *,
        release_cache: bool = True,
        sync_each_batch: Optional[bool] = None,
        agree: bool = True,
        recover_oom: bool = True,
        max_oom_retries: int = DEFAULT_MAX_OOM_RETRIES,
        accelerator: Any = None,
    ) -> None:
        self.release_cache = release_cache
        self.accelerator = accelerator
        self.guard, self.runner = follow(
            guard,
            release_cache=release_cache,
            agree=agree,
            recover_oom=recover_oom,
            max_oom_retries=max_oom_retries,
            sync_each_batch=sync_each_batch,
        )
        #: The last :meth:`backward` ran out of memory after gradients had accumulated: its
        #: optimizer step must be skipped (:meth:`step` does).
        self.skip_step = False
        self._fresh_step = False
        self._fsdp: Optional[bool] = None
        self._config_reported = False

    @property
    def micro_batch_size(self) -> int:
        """Rows per micro-batch now (agreed across ranks; the guard's before the first step)."""
        return self.runner.size if self.runner.size is not None else self.guard.batch_size

    @property
    def grad_checkpointing(self) -> bool:
        """Gradient checkpointing as agreed across ranks."""
        return self.runner.checkpointing

    def refresh(self, model: Any = None) -> bool:
        """Step boundary: follow the guard and agree with the other ranks (a collective when
        distributed: every rank must call it at the same point). :meth:`backward` calls it
        itself when it was not called for this batch. Returns True when the applied micro-batch
        size or checkpointing changed."""
        if self._fsdp is None and model is not None:
            self._fsdp = is_fsdp(model)
        changed = self.runner.begin_step(
            (lambda: grads_fresh(model)) if model is not None else None, fsdp=bool(self._fsdp)
        )
        if self.runner.sync_each_batch and self.accelerator is not None:
            sync_each_batch_on(self.accelerator)
        self._fresh_step = True
        if self.runner.checkpointing and model is not None:
            enable_checkpointing(model)
        return changed

    def split(self, batch: Any) -> List[MicroBatch[Any]]:
        """Micro-batches of ``batch`` at the current size, weighted rows / B (no agreement)."""
        return split_batch(batch, self.micro_batch_size)

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
        ``model`` has ``no_sync`` (DDP, FSDP 1), every micro-batch but the last runs inside it,
        so gradients are synchronised once per batch. Pass ``model`` so that an OOM in backward
        can reset the gradients, and so FSDP is recognised.
        """
        if not self._config_reported:
            self._config_reported = True
            self._report_config(model)
        if not self._fresh_step:
            self.refresh(model)
        self._fresh_step = False
        if self._fsdp is None:
            self._fsdp = model is not None and is_fsdp(model)
        # FSDP gathers parameters inside forward/backward: a rank that fails mid-pass cannot
        # rejoin its peers, so with several ranks its OOM errors propagate.
        recover = not (self._fsdp and self.runner.agreement.world_size() > 1)

        def micro(data: Any, weight: float, after_forward: Callable[[], None]) -> float:
            loss = loss_fn(data) * weight
            after_forward()
            loss.backward()
            return _item(loss)

        result = self.runner.run(
            batch,
            micro,
            no_sync=no_sync_of(model),
            zero_grads=zero_grads(model) if model is not None else None,
            recover=recover,
            force_sync=force_sync_of(model) if model is not None else None,
        )
        self.skip_step = result.skipped
        return float(sum(result.outputs))

    def _report_config(self, model: Any) -> None:
        """At the first batch: report what the loop's objects say (the world size, the ranks
        here; with ``model``, its shape and parameters; not the batch's length, which says
        nothing of later batches). The loop owns its batch size, so no micro-batch is reported
        and the sidecar plans nothing."""
        try:
            config = loop_config(model=unwrap(model) if model is not None else None)
        except Exception as exc:  # reading the objects must never stop training
            log.warning("memguard: the loop's config could not be read: %s", exc)
            return
        if config:
            self.guard.report_config(config)

    def step(self, optimizer: Any, *, zero_grad: bool = True) -> bool:
        """``optimizer.step()`` (then ``zero_grad(set_to_none=True)``) unless the last batch's
        step must be skipped. Returns True when the optimizer stepped."""
        stepped = not self.skip_step
        if stepped:
            optimizer.step()
        self.skip_step = False
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        return stepped

    def close(self) -> bool:
        """End of training, on every rank at the same point (before ``destroy_process_group``):
        complete the pipelined agreement's collective still in flight and join its thread
        (:meth:`memguard_client.distributed.Agreement.close`; an ``atexit`` handler does it
        otherwise). Returns False when a peer did not answer."""
        return self.runner.agreement.close()


def _item(loss: Any) -> float:
    item = getattr(loss, "item", None)
    try:
        return float(item() if callable(item) else loss)
    except Exception:
        return float("nan")
