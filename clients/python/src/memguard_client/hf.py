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
once per batch. Peak activation memory is that of the micro-batch size; the effective batch
(``B × gradient_accumulation_steps × world size``) and the samples seen are exactly those of the
original run.

The plan at train start
-----------------------
At the first ``training_step``, before the first forward, the adapter reports the config the
trainer really runs at (:mod:`memguard_client.train_config`, the first batch's padded length
included) and waits, bounded, for the sidecar's train-start plan, which it applies like any
signal: every rank runs the planned micro-batch from step 1 (docs/python-client.md).

Every rank, every batch
-----------------------
Each ``training_step`` call is a step boundary: the guard is refreshed and, when
``torch.distributed`` is initialised with several ranks (DDP, FSDP 1/2 through accelerate), the
micro-batch size (smallest wins) and gradient checkpointing (any wins) are agreed in one tiny
collective, so every rank runs the same number of forward/backward passes per batch whatever its
own sidecar says. Gradient checkpointing is turned on when agreed and the model supports it.

FSDP: gradients stay sharded
----------------------------
With FSDP and several ranks, from the step of a run-time downgrade on (or from the start with
``MEMGUARD_GRAD_SYNC=each-batch``, the webhook's ``sync-each-batch`` rung), the adapter sets
Accelerate's ``sync_each_batch`` on ``trainer.accelerator`` (the Trainer reads it before every
micro-batch of its own accumulation) and runs its own micro-batches without ``no_sync``; with
FSDP 2 each also runs under ``set_requires_gradient_sync(True)``, so even the micro-batch during
which the switch happens reduce-scatters. Gradients then stay sharded (``Pt·g/N``) instead of
accumulating unsharded (``Pt·g``); the cost is one reduce-scatter per micro-batch. The switch is
agreed with the step's micro-batch size, so every rank makes it at the same step. With
``MEMGUARD_GRAD_SYNC=each-batch`` the flag is also set at :func:`attach`, whatever the backend.

Out of memory inside a step
---------------------------
A ``torch.OutOfMemoryError`` (or the CPU allocator's out-of-memory ``RuntimeError``) raised by a
micro-batch is recovered in-process: the micro-batch size is halved (agreed across ranks) and the
rest of the batch runs again (see :mod:`memguard_client.recovery`). When the OOM hits in backward
after gradients of the accumulation window had built up, the gradients are reset and that
optimizer step is skipped and counted (``skipped_steps``); the learning-rate scheduler does not
advance for it, as with an AMP overflow. With FSDP and several ranks recovery is off (a rank
failing mid-pass cannot rejoin its peers' collectives) and the error propagates.

Refused: DeepSpeed and SageMaker model parallel. DeepSpeed's engine counts micro-steps and
decides gradient-accumulation boundaries itself (``engine.backward`` / ``engine.step``, driven
by accelerate from ``sync_gradients``); re-chunking inside ``training_step`` would need those
boundaries overridden per micro-batch and cannot be verified here (DeepSpeed does not run on this
CPU-only CI), so :func:`attach` raises instead of risking a silent desync. Before it raises it still reports
the trainer's config to the sidecar (issue 37), which exports it and decides on it.

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

import functools
import logging
import threading
from typing import Any, Callable, Dict, Optional

from .guard import Guard
from .phase import PRESSURE_LEVELS, SaveDeferral
from .train_config import run_sequence, trainer_config
from .recovery import (
    DEFAULT_MAX_OOM_RETRIES,
    RunnerCounters,
    enable_checkpointing,
    follow,
    force_sync_of,
    grads_fresh,
    is_fsdp,
    sync_each_batch_on,
    unwrap,
    zero_grads,
)

log = logging.getLogger("memguard_client.hf")


class UnsupportedTrainerError(RuntimeError):
    """:func:`attach` refuses a Trainer whose backend it cannot keep exact."""


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


class MemguardCallback(RunnerCounters, _callback_base()):  # type: ignore[misc]
    """The Trainer callback. Create it through :func:`attach` (which also wraps the trainer).

    Attributes:
        guard: the :class:`~memguard_client.Guard` followed.
        runner: the micro-batch loop (agreement, OOM recovery) and its counters.
    """

    def __init__(
        self,
        guard: Optional[Guard] = None,
        *,
        agree: bool = True,
        recover_oom: bool = True,
        max_oom_retries: int = DEFAULT_MAX_OOM_RETRIES,
        sync_each_batch: Optional[bool] = None,
    ) -> None:
        self.guard, self.runner = follow(
            guard,
            agree,
            recover_oom=recover_oom,
            max_oom_retries=max_oom_retries,
            sync_each_batch=sync_each_batch,
        )
        self.attached = False
        self._local = threading.local()
        self._skip_pending = False
        self._wrapped_optimizer: Any = None
        #: Checkpoint saves put off under host-memory pressure (phase.py).
        self.save_deferral = SaveDeferral()
        #: The sidecar's train-start decision (``None`` before the first step, or when none
        #: came in time).
        self.train_start: Optional[Dict[str, Any]] = None
        self._train_start_asked = False

    @property
    def saves_deferred(self) -> int:
        """Checkpoint saves put off under host-memory pressure so far."""
        return self.save_deferral.deferred

    # --- callback events ------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.attached:
            log.warning(
                "memguard: MemguardCallback was added without memguard_client.hf.attach(trainer); "
                "batch size changes cannot be applied"
            )
            return
        self._wrap_optimizer(kwargs.get("optimizer"))
        # The config is reported at the first training step, with the first batch's sequence
        # (plan_at_train_start).
        self.guard.report_phase("step")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Added after the Trainer's own callbacks: `should_save` is what they decided.
        if not self.attached:
            return
        if not (getattr(control, "should_save", False) or self.save_deferral.pending):
            return
        step = int(getattr(state, "global_step", 0))
        max_steps = int(getattr(state, "max_steps", 0) or 0)
        last = bool(getattr(control, "should_training_stop", False)) or (0 < max_steps <= step)
        pressure = self.runner.agreement.any(self.guard.level in PRESSURE_LEVELS)
        deferred_before = self.saves_deferred
        save = self.save_deferral.save_now(step, pressure, last)
        control.should_save = save
        if save:
            self.guard.report_phase("save", saves_deferred=self.saves_deferred)
        elif self.saves_deferred != deferred_before:
            self.guard.report_phase("step", saves_deferred=self.saves_deferred)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attached and self.guard.phase == "save":
            self.guard.report_phase("step", saves_deferred=self.saves_deferred)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Every rank ends training here: complete the pipelined agreement's last collective and
        # join its thread now, not while the interpreter finalizes (module doc of
        # memguard_client.distributed).
        if self.attached:
            self.runner.agreement.close()
            self.runner.step_reports.close()

    def plan_at_train_start(self, trainer: Any, model: Any, inputs: Any) -> None:
        """Before the first forward (issue 37): report the config the trainer really runs at,
        this rank's first batch included, and apply the sidecar's train-start plan (the step's
        agreement then makes every rank run the same micro-batch from step 1). Once."""
        if self._train_start_asked:
            return
        self._train_start_asked = True
        try:
            # The model itself, not its DDP/FSDP wrapper: its config says its shape.
            inner = getattr(trainer, "model", None)
            config = trainer_config(
                getattr(trainer, "args", None),
                inner if inner is not None else unwrap(model),
                getattr(trainer, "accelerator", None),
            )
            # The longest sequence of the run, not of this first batch (run_sequence): a
            # trainer whose data grows longer must not be planned on its first rows.
            config.pop("seq-length", None)
            config.update(run_sequence(trainer, inputs))
        except Exception as exc:  # reading the objects must never stop training
            log.warning("memguard: the trainer's config could not be read: %s", exc)
            return
        if config:
            self.train_start = self.guard.plan_at_train_start(config)

    def _wrap_optimizer(self, optimizer: Any) -> None:
        """Make ``optimizer.step`` skip the step an OOM in backward spoiled."""
        if optimizer is None or optimizer is self._wrapped_optimizer:
            return
        inner = optimizer.step
        cb = self

        @functools.wraps(inner)  # keeps the LR scheduler's marker on the step function
        def step(*args: Any, **kwargs: Any) -> Any:
            if cb._skip_pending:
                cb._skip_pending = False
                # accelerate reads this flag (optimizer_step_was_skipped) and then does not
                # advance the LR scheduler, as for an AMP overflow.
                if hasattr(optimizer, "_is_overflow"):
                    optimizer._is_overflow = True
                return None
            if getattr(optimizer, "_is_overflow", False) and getattr(optimizer, "scaler", None) is None:
                optimizer._is_overflow = False
            return inner(*args, **kwargs)

        optimizer.step = step
        self._wrapped_optimizer = optimizer

    # --- the wrappers ---------------------------------------------------------------------

    def wrap(self, trainer: Any) -> None:
        """Wrap ``trainer.training_step`` and ``trainer.compute_loss`` (instance attributes)."""
        if getattr(trainer, "_memguard_callback", None) is self:
            return
        inner_step: Callable[..., Any] = trainer.training_step
        inner_loss: Callable[..., Any] = trainer.compute_loss
        local = self._local
        runner = self.runner
        fsdp_seen: "dict[int, bool]" = {}

        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            out = inner_loss(model, inputs, *args, **kwargs)
            scale = getattr(local, "scale", 1.0)
            if scale != 1.0:
                out = (out[0] * scale,) + tuple(out[1:]) if isinstance(out, tuple) else out * scale
            after_forward = getattr(local, "after_forward", None)
            if after_forward is not None:
                local.after_forward = None
                after_forward()  # the agreement point between forward and backward
            return out

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None, **kw: Any) -> Any:
            self.plan_at_train_start(trainer, model, inputs)
            fsdp = fsdp_seen.get(id(model))
            if fsdp is None:
                fsdp = fsdp_seen[id(model)] = _is_fsdp_trainer(trainer, model)
            runner.begin_step(lambda: grads_fresh(model), fsdp=fsdp)
            if runner.sync_each_batch:
                # Before this step's micro-batches: the Trainer reads it from the next one on.
                sync_each_batch_on(getattr(trainer, "accelerator", None))
            if runner.checkpointing:
                enable_checkpointing(model)
            if self._skip_pending:
                # This accumulation window's step is already lost: do not spend memory on it.
                return _zero_like_loss(trainer)
            scaled_for_ga = _loss_is_scaled_for_ga(trainer, num_items_in_batch)

            def micro(data: Any, weight: float, after_forward: Callable[[], None]) -> Any:
                local.scale = 1.0 if scaled_for_ga else weight
                local.after_forward = after_forward
                try:
                    return inner_step(model, data, num_items_in_batch, **kw)
                finally:
                    local.scale = 1.0
                    local.after_forward = None

            result = runner.run(
                inputs,
                micro,
                no_sync=lambda: _no_sync(trainer, model),
                zero_grads=zero_grads(model),
                recover=not (fsdp and runner.agreement.world_size() > 1),
                force_sync=force_sync_of(model),
            )
            if result.skipped:
                self._skip_pending = True
            total = None
            for loss in result.outputs:
                total = loss if total is None else total + loss
            return total if total is not None else _zero_like_loss(trainer)

        trainer.compute_loss = compute_loss
        trainer.training_step = training_step
        trainer._memguard_callback = self
        self.attached = True


def attach(
    trainer: Any,
    guard: Optional[Guard] = None,
    *,
    agree: bool = True,
    recover_oom: bool = True,
    max_oom_retries: int = DEFAULT_MAX_OOM_RETRIES,
    sync_each_batch: Optional[bool] = None,
) -> MemguardCallback:
    """Make ``trainer`` follow memguard: add the callback and wrap its training step.

    ``sync_each_batch`` (FSDP with several ranks): ``None`` (default) syncs gradients at every
    micro-batch from a run-time downgrade on, or from the start with
    ``MEMGUARD_GRAD_SYNC=each-batch``; ``True`` always; ``False`` never (see the module doc).

    Raises :class:`UnsupportedTrainerError` for DeepSpeed and SageMaker model parallel (see the
    module doc). Returns the callback (its counters are useful in logs).
    """
    kind = _unsupported(trainer)
    if kind is not None:
        # Not re-chunked, but the sidecar still learns the config it runs at (issue 37).
        reporter = guard if guard is not None else Guard(background=False, oom_hook=False)
        try:
            config = trainer_config(
                getattr(trainer, "args", None),
                getattr(trainer, "model", None),
                getattr(trainer, "accelerator", None),
            )
            if config:
                reporter.plan_at_train_start(config)
        except Exception as exc:  # noqa: BLE001 - the refusal below is what matters
            log.debug("memguard: config not reported: %s", exc)
        raise UnsupportedTrainerError(
            f"memguard: attach() does not support {kind} training: its engine counts micro-steps "
            "and gradient-accumulation boundaries itself, so re-chunking batches inside "
            "training_step could desynchronise it. Run without attach() (the webhook's starting "
            "batch size still applies), or use DDP/FSDP; see docs/python-client.md"
        )
    cb = MemguardCallback(
        guard,
        agree=agree,
        recover_oom=recover_oom,
        max_oom_retries=max_oom_retries,
        sync_each_batch=sync_each_batch,
    )
    # Until training begins the host memory holds what loading builds (phase.py).
    cb.guard.report_phase("load")
    if sync_each_batch is not False and cb.guard.grad_sync == "each-batch":
        # The webhook's plan counted on sharded gradients from the first micro-batch.
        sync_each_batch_on(getattr(trainer, "accelerator", None))
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


def _distributed_type(trainer: Any) -> str:
    return str(getattr(getattr(trainer, "accelerator", None), "distributed_type", ""))


def _unsupported(trainer: Any) -> Optional[str]:
    kind = _distributed_type(trainer)
    if kind.endswith("DEEPSPEED"):
        return "DeepSpeed"
    if kind.endswith("SAGEMAKER_MP"):
        return "SageMaker model parallel"
    return None


def _is_fsdp_trainer(trainer: Any, model: Any) -> bool:
    return _distributed_type(trainer).endswith("FSDP") or is_fsdp(model)


def _zero_like_loss(trainer: Any) -> Any:
    try:
        import torch

        device = getattr(getattr(trainer, "args", None), "device", "cpu")
        return torch.tensor(0.0, device=device)
    except Exception:
        return 0.0
