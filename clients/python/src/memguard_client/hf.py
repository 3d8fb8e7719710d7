"""Hugging Face ``Trainer`` adapter: apply memguard's batch size where the Trainer really uses it.

Why not change ``args.per_device_train_batch_size``
---------------------------------------------------
``Trainer.train()`` builds its train ``DataLoader`` once, from ``self._train_batch_size``
(copied from ``args.per_device_train_batch_size`` before training), and fixes
``args.gradient_accumulation_steps``, the number of update steps per epoch and the learning-rate
schedule from it. Writing a new value into ``args`` mid-run changes nothing the loop reads again:
the batches keep their size and the job dies anyway.

What this adapter does instead: re-chunk inside ``training_step``
-----------------------------------------------------------------
The data loader keeps yielding batches of the original size ``B``; the Trainer's loop, its step
count, schedule, logging and checkpoints are untouched. :func:`attach` wraps the trainer's
``training_step`` so that each batch runs as micro-batches of ``guard.batch_size`` rows, each
through the Trainer's own ``training_step`` (so ``_prepare_inputs``, autocast, the loss and
``accelerator.backward`` are the Trainer's), and wraps ``compute_loss`` to scale each
micro-batch's loss:

* when the Trainer divides the loss by the number of accumulated batches itself (a per-batch
  mean loss), each micro-batch loss is multiplied by ``rows / B``, so the gradient of the batch
  equals the full-batch gradient;
* when the loss is already normalised by ``num_items_in_batch`` over the whole accumulated
  batch (models that accept loss kwargs, ``compute_loss_func``), micro-batch losses already add
  up to the batch loss, and nothing is scaled.

Every micro-batch but the last runs inside ``accelerator.no_sync(model)`` so DDP all-reduces
once per batch. Peak activation memory is that of ``guard.batch_size`` rows; the effective
batch (``B × gradient_accumulation_steps × world size``) and the samples seen are exactly those
of the original run. The callback picks up new signals at every step boundary
(``on_step_begin``, ``on_substep_end``), releases the CUDA cache after a downgrade, and turns on
gradient checkpointing when the signal asks for it and the model supports it.

Not supported: DeepSpeed (its engine counts micro-steps itself) and SageMaker model parallel;
there the adapter logs a warning once and leaves batches whole.

Usage::

    from memguard_client import Guard
    from memguard_client.hf import attach

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    attach(trainer, Guard())      # adds the callback and wraps training_step / compute_loss
    trainer.train()

``transformers`` is imported when this module is imported; without it the callback still works
on any Trainer-shaped object (a plain base class stands in for ``TrainerCallback``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional

from .batching import MicroBatch, split_batch
from .guard import Guard
from .torch import empty_cache

log = logging.getLogger("memguard_client.hf")


class _CallbackBase:
    """Stand-in for ``transformers.TrainerCallback`` when transformers is not installed."""

    def _noop(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        return None

    on_init_end = on_train_begin = on_train_end = on_epoch_begin = on_epoch_end = _noop
    on_step_begin = on_pre_optimizer_step = on_optimizer_step = on_substep_end = _noop
    on_step_end = on_evaluate = on_predict = on_save = on_log = on_prediction_step = _noop
    on_push_begin = _noop


def _callback_base() -> type:
    try:
        from transformers import TrainerCallback  # type: ignore[import-not-found,unused-ignore]
    except Exception:
        return _CallbackBase
    return TrainerCallback  # type: ignore[no-any-return,unused-ignore]


class MemguardCallback(_callback_base()):  # type: ignore[misc]
    """The Trainer callback. Create it through :func:`attach` (which also wraps the trainer).

    Attributes:
        guard: the :class:`~memguard_client.Guard` followed.
        downgrades: number of signals that lowered the micro-batch size.
        micro_batches: number of micro-batches run so far.
        cache_releases: times the CUDA cache was released after a downgrade.
    """

    def __init__(self, guard: Optional[Guard] = None) -> None:
        self.guard = guard if guard is not None else Guard()
        self.downgrades = 0
        self.micro_batches = 0
        self.cache_releases = 0
        self.attached = False
        self._local = threading.local()
        self._warned = False

    # --- callback events ------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.attached:
            log.warning(
                "memguard: MemguardCallback was added without memguard_client.hf.attach(trainer); "
                "batch size changes cannot be applied"
            )
        self._follow(kwargs.get("model"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._follow(kwargs.get("model"))

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._follow(kwargs.get("model"))

    def _follow(self, model: Any) -> bool:
        before = self.guard.batch_size
        if not self.guard.refresh():
            return False
        if self.guard.batch_size < before:
            self.downgrades += 1
            if empty_cache():
                self.cache_releases += 1
        if self.guard.grad_checkpointing and model is not None:
            _enable_checkpointing(model)
        return True

    # --- the wrappers ---------------------------------------------------------------------

    def wrap(self, trainer: Any) -> None:
        """Wrap ``trainer.training_step`` and ``trainer.compute_loss`` (instance attributes)."""
        if getattr(trainer, "_memguard_callback", None) is self:
            return
        inner_step: Callable[..., Any] = trainer.training_step
        inner_loss: Callable[..., Any] = trainer.compute_loss
        local = self._local

        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            out = inner_loss(model, inputs, *args, **kwargs)
            scale = getattr(local, "scale", 1.0)
            if scale == 1.0:
                return out
            if isinstance(out, tuple):
                return (out[0] * scale,) + tuple(out[1:])
            return out * scale

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None, **kw: Any) -> Any:
            # A step boundary for the Trainer's prefetching loop too: follow the signal here.
            self._follow(model)
            micro = self._split(trainer, inputs)
            if len(micro) == 1:
                self.micro_batches += 1
                return inner_step(model, inputs, num_items_in_batch, **kw)
            scaled_for_ga = _loss_is_scaled_for_ga(trainer, num_items_in_batch)
            total = None
            try:
                for i, mb in enumerate(micro):
                    local.scale = 1.0 if scaled_for_ga else mb.weight
                    ctx = _no_sync(trainer, model) if i < len(micro) - 1 else None
                    if ctx is not None:
                        with ctx:
                            loss = inner_step(model, mb.data, num_items_in_batch, **kw)
                    else:
                        loss = inner_step(model, mb.data, num_items_in_batch, **kw)
                    self.micro_batches += 1
                    total = loss if total is None else total + loss
            finally:
                local.scale = 1.0
            return total

        trainer.compute_loss = compute_loss
        trainer.training_step = training_step
        trainer._memguard_callback = self
        self.attached = True

    def _split(self, trainer: Any, inputs: Any) -> List[MicroBatch[Any]]:
        if _unsupported(trainer):
            if not self._warned:
                log.warning("memguard: DeepSpeed/SageMaker MP training: batches are not re-chunked")
                self._warned = True
            return split_batch(inputs, 1 << 62)
        return split_batch(inputs, self.guard.batch_size)


def attach(trainer: Any, guard: Optional[Guard] = None) -> MemguardCallback:
    """Make ``trainer`` follow memguard: add the callback and wrap its training step.

    Returns the callback (its ``downgrades`` and ``micro_batches`` counters are useful in logs).
    """
    cb = MemguardCallback(guard)
    cb.wrap(trainer)
    add = getattr(trainer, "add_callback", None)
    if callable(add):
        add(cb)
    return cb


def _loss_is_scaled_for_ga(trainer: Any, num_items_in_batch: Any) -> bool:
    # Mirrors Trainer.training_step (transformers ≥ 4.46; `loss_is_scaled_for_ga` in 5.x).
    flag = getattr(trainer, "loss_is_scaled_for_ga", None)
    if flag is not None:
        return bool(flag)
    return bool(
        (getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
        or getattr(trainer, "compute_loss_func", None) is not None
    )


def _no_sync(trainer: Any, model: Any) -> Any:
    accelerator = getattr(trainer, "accelerator", None)
    no_sync = getattr(accelerator, "no_sync", None)
    if callable(no_sync):
        return no_sync(model=model)
    model_no_sync = getattr(model, "no_sync", None)
    if callable(model_no_sync):
        return model_no_sync()
    return None


def _unsupported(trainer: Any) -> bool:
    accelerator = getattr(trainer, "accelerator", None)
    kind = str(getattr(accelerator, "distributed_type", ""))
    return kind.endswith("DEEPSPEED") or kind.endswith("SAGEMAKER_MP")


def _enable_checkpointing(model: Any) -> None:
    if getattr(model, "is_gradient_checkpointing", False):
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable):
        return
    try:
        enable()
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False
        log.info("memguard: gradient checkpointing enabled")
    except Exception as err:
        log.warning("memguard: could not enable gradient checkpointing: %s", err)
