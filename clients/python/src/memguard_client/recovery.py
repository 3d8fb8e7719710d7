"""Running one batch as micro-batches, agreed across ranks, recovering from OOM in-process.

Shared by :class:`memguard_client.torch.MicroBatcher` and :func:`memguard_client.hf.attach`.

At each step boundary (:meth:`StepRunner.begin_step`) the micro-batch size and gradient
checkpointing are agreed across ranks (:mod:`memguard_client.distributed`: smallest size, any
checkpointing). Then :meth:`StepRunner.run` runs the batch's rows as micro-batches of that size.

In-process OOM recovery
-----------------------
A micro-batch that raises ``torch.OutOfMemoryError`` (CUDA) or the CPU allocator's
out-of-memory ``RuntimeError`` is not the end of the run:

* **in the forward pass** nothing was accumulated yet: the CUDA cache is released, the
  micro-batch size is halved, and the rest of the batch (this micro-batch included) runs again.
  Exact.
* **in the backward pass** some parameters may already hold part of this micro-batch's gradient,
  which cannot be subtracted. If every parameter's gradient was ``None`` when the batch began
  (the usual case: ``zero_grad(set_to_none=True)`` before each step), the gradients are reset
  and the whole batch runs again at the halved size: exact. Otherwise the gradients are reset
  and the optimizer step of this batch is **skipped and counted** (``skipped_steps``), never
  silently wrong.

With several ranks every phase ends in one tiny agreement (``all_reduce`` MIN of three int64:
"did any rank run out of memory", the smallest proposed size, "were all gradients fresh"), so
all ranks halve together and run the same number of micro-batches. The phases are chosen so that
no rank can be inside another collective at that moment:

* after each forward (DDP runs no collective in forward after its buffer broadcast);
* after each backward except the last micro-batch's, which runs outside ``no_sync`` and so
  all-reduces gradients: an OOM there cannot be recovered in a multi-rank job and propagates.

FSDP (1 and 2) gathers parameters inside forward and backward, so a rank that runs out of memory
mid-pass leaves its peers blocked in a collective it will never join: with FSDP and more than
one rank, OOM recovery is off and the error propagates (the micro-batch size agreement still
works). Retries are bounded (``max_oom_retries`` per batch) and at micro-batch size 1 the error
propagates with a note saying so.

FSDP: gradients stay sharded when the micro-batch shrinks
--------------------------------------------------------
Running a batch as several micro-batches is gradient accumulation. Under ``no_sync()`` (FSDP 1)
or ``set_requires_gradient_sync(False)`` (FSDP 2) every rank would hold its units' full,
unsharded gradients until the last micro-batch: ``Pt·g`` instead of ``Pt·g/N``, more memory
right when the rank is under pressure. So with FSDP and several ranks, from the step whose agreed
micro-batch size falls below the first step's (a run-time downgrade), or from the start when the
webhook's plan says so (``MEMGUARD_GRAD_SYNC=each-batch``, :attr:`memguard_client.Guard.grad_sync`),
:attr:`StepRunner.sync_each_batch` is on: every micro-batch reduce-scatters its gradients (FSDP 2:
``set_requires_gradient_sync(True)`` around it, which also overrides an enclosing ``no_sync`` of
the trainer's own accumulation), and the adapters set Accelerate's ``sync_each_batch`` so the
trainer's own accumulation does the same (:func:`sync_each_batch_on`). The decision rides in the
step's agreement, so every rank switches at the same step. It costs one reduction per
micro-batch, not quality, and stays on for the rest of the run.

Each recovery is recorded with :func:`memguard_client.oom.record` (``outcome="recovered"``, the
failing and the new micro-batch size), which reports it to the sidecar (``POST /v1/report``) so
its metrics and its summary count it. An OOM given up on is re-raised unchanged (with a note):
the OOM hook of :mod:`memguard_client.oom` records it as fatal.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, List, Optional

from . import oom
from .batching import batch_rows, slice_batch
from .distributed import Agreement, Status
from .guard import Guard
from .peaks import StepReporter

log = logging.getLogger("memguard_client")

#: Default bound on OOM retries within one batch (halving 1024 to 1 takes 10).
DEFAULT_MAX_OOM_RETRIES = 12


def classify_oom(exc: BaseException) -> Optional[str]:
    """``"cuda_oom"``, ``"cpu_oom"`` or ``None`` (:func:`memguard_client.oom.classify`)."""
    return oom.classify(exc)


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


def record_recovery(
    exc: BaseException, guard: Guard, *, step: int, batch_size: Optional[int], new_batch_size: int
) -> None:
    """Record a recovered OOM (:func:`memguard_client.oom.record`, ``outcome="recovered"``):
    the sidecar counts it and learns the new micro-batch size. Never raises."""
    try:
        oom.record(
            exc,
            guard,
            step=step,
            outcome="recovered",
            batch_size=batch_size,
            new_batch_size=new_batch_size,
        )
    except Exception as err:  # reporting must never end a run that just recovered
        log.debug("memguard: OOM report failed: %s", err)


class _Retry(Exception):
    """Raised inside a micro-batch when the agreement says some rank ran out of memory."""

    def __init__(self, status: Status) -> None:
        super().__init__("memguard: a rank ran out of memory; running the micro-batch again")
        self.status = status


@dataclass
class RunResult:
    """What :meth:`StepRunner.run` did with one batch."""

    #: The value each micro-batch's ``micro`` returned (losses), in order.
    outputs: List[Any]
    #: The batch's optimizer step must be skipped (an OOM in backward after gradients had
    #: accumulated); the gradients were reset.
    skipped: bool


class StepRunner:
    """The micro-batch loop with rank agreement and OOM recovery (see the module doc).

    Args:
        guard: the signal followed.
        agreement: the collectives (default: agree when ``torch.distributed`` is initialised).
        recover_oom: recover from OOM in-process (default True).
        max_oom_retries: OOM retries allowed within one batch.
        release_cache: release the CUDA cache after a downgrade.
        sync_each_batch: with FSDP on several ranks, sync gradients at every micro-batch:
            ``None`` (default) from a run-time downgrade on, or from the start when the guard
            says ``each-batch``; ``True`` always; ``False`` never (the micro-batches then hold
            unsharded gradients under ``no_sync``).
    """

    def __init__(
        self,
        guard: Guard,
        agreement: Optional[Agreement] = None,
        *,
        recover_oom: bool = True,
        max_oom_retries: int = DEFAULT_MAX_OOM_RETRIES,
        release_cache: bool = True,
        sync_each_batch: Optional[bool] = None,
    ) -> None:
        self.guard = guard
        self.sync_policy = sync_each_batch
        #: Gradients are synced at every micro-batch (agreed; FSDP with several ranks only).
        self.sync_each_batch = False
        self._first_size: Optional[int] = None
        self.agreement = agreement if agreement is not None else Agreement()
        self.recover_oom = recover_oom
        self.max_oom_retries = max(0, int(max_oom_retries))
        self.release_cache = release_cache
        #: Micro-batch size applied now (agreed); ``None`` before the first step.
        self.size: Optional[int] = None
        #: Gradient checkpointing applied now (agreed).
        self.checkpointing = False
        #: Cap left by the last OOM recovery (agreed, kept for the rest of the run).
        self.oom_cap: Optional[int] = None
        self.steps = 0
        self.downgrades = 0
        self.micro_batches = 0
        self.cache_releases = 0
        self.ooms = 0
        self.oom_recoveries = 0
        self.skipped_steps = 0
        self._fresh = False
        #: Tells the sidecar each step's micro-batch (and device peak) for the growth back.
        self.step_reports = StepReporter(guard)

    # --- step boundary --------------------------------------------------------------------

    def begin_step(
        self, grads_fresh: Optional[Callable[[], bool]] = None, *, fsdp: bool = False
    ) -> bool:
        """Follow the guard and agree on this step's size, checkpointing and gradient sync (one
        collective when distributed). ``fsdp``: the model is sharded by FSDP (same on every
        rank). Returns True when the applied size or checkpointing changed."""
        self.guard.refresh()
        want = self.guard.batch_size
        if self.oom_cap is not None:
            want = min(want, self.oom_cap)
        want_sync = self.sync_policy is True or (
            self.sync_policy is None and getattr(self.guard, "grad_sync", None) == "each-batch"
        )
        size, ckpt, sync = self.agreement.step_sync(want, self.guard.grad_checkpointing, want_sync)
        if self.oom_cap is not None:
            # The cap was agreed by every rank (Agreement.status) when it was set; the pipelined
            # agreement may hand back proposals made before it, so it is applied again here.
            size = min(size, self.oom_cap)
        if self._first_size is None:
            self._first_size = size
        # Agreed values only, so every rank decides alike at the same step.
        downgraded = self.sync_policy is None and size < self._first_size
        if fsdp and self.agreement.world_size() > 1 and self.sync_policy is not False:
            self.sync_each_batch = self.sync_each_batch or sync or downgraded
        changed = (size, ckpt) != (self.size, self.checkpointing)
        if self.size is not None and size < self.size:
            self.downgrades += 1
            self._release()
        self.size, self.checkpointing = size, ckpt
        self._fresh = bool(grads_fresh()) if (self.recover_oom and grads_fresh is not None) else False
        self.steps += 1
        self.step_reports.step(self.steps, size)
        return changed

    def _release(self) -> None:
        if self.release_cache and empty_cache():
            self.cache_releases += 1

    # --- the batch --------------------------------------------------------------------------

    def run(
        self,
        batch: Any,
        micro: Callable[[Any, float, Callable[[], None]], Any],
        *,
        no_sync: Callable[[], Optional[ContextManager[Any]]],
        zero_grads: Optional[Callable[[], None]],
        recover: bool = True,
        force_sync: Optional[Callable[[], Optional[ContextManager[Any]]]] = None,
    ) -> RunResult:
        """Run ``batch`` as micro-batches of the agreed size.

        ``micro(data, weight, after_forward)`` runs one micro-batch: forward, then
        ``after_forward()`` (the agreement point; it raises to abandon the micro-batch when
        some rank ran out of memory), then backward; it returns the (detached) loss. ``weight``
        is ``rows / B``. ``no_sync()`` gives the context that defers gradient synchronisation
        (DDP's ``no_sync``) or ``None``. ``zero_grads()`` resets the gradients to ``None``
        (needed to recover from an OOM in backward). ``recover=False`` lets OOM propagate
        (FSDP with several ranks). While :attr:`sync_each_batch` is on, no micro-batch runs
        under ``no_sync()``, and each runs under ``force_sync()`` when given (FSDP 2:
        synchronise even inside the trainer's own ``no_sync``).
        """
        if self.size is None:
            self.begin_step()
        assert self.size is not None
        recover = recover and self.recover_oom
        multi = self.agreement.world_size() > 1
        rows = batch_rows(batch)
        outputs: List[Any] = []
        retries = 0
        pos = 0
        total = rows if rows is not None else 1
        while pos < total:
            size = self.size
            stop = total if rows is None else min(rows, pos + size)
            last = stop == total
            whole = pos == 0 and last
            data = batch if whole or rows is None else slice_batch(batch, pos, stop, rows)
            weight = 1.0 if rows is None else (stop - pos) / rows
            phase = ["forward"]

            def after_forward() -> None:
                if recover and multi:
                    st = self.agreement.status(False, self.size or 1, self._fresh)
                    if st.oom:
                        raise _Retry(st)
                phase[0] = "backward"

            if self.sync_each_batch:
                ctx = (force_sync() if force_sync is not None else None) or contextlib.nullcontext()
            else:
                ctx = (None if last else no_sync()) or contextlib.nullcontext()
            try:
                with ctx:
                    out = micro(data, weight, after_forward)
            except _Retry as r:  # a peer ran out of memory in this forward; this rank did not
                retries += 1
                self._recovered(None, r.status, retries, forward=True)
                continue
            except BaseException as exc:  # noqa: B902 - classified below, re-raised otherwise
                kind = classify_oom(exc) if recover else None
                if kind is None:
                    raise
                if rows is None or (phase[0] == "backward" and (zero_grads is None or (multi and last))):
                    # No batch dimension to halve, no way to reset gradients, or a backward that
                    # synchronises gradients across ranks: nothing exact is possible here.
                    _note(exc, "memguard: this out-of-memory error cannot be recovered in-process here")
                    raise
                self.ooms += 1
                retries += 1
                proposal = size // 2 if size > 1 and retries <= self.max_oom_retries else 0
                st = self.agreement.status(True, proposal, self._fresh)
                forward = phase[0] == "forward"
                self._recovered(exc, st, retries, forward=forward)
                if forward:
                    continue
                if self._backward_oom(st, zero_grads):
                    pos, outputs = 0, []
                    continue
                return RunResult(outputs, skipped=True)
            if phase[0] == "backward" and recover and multi and not last:
                # Did a peer run out of memory in this micro-batch's backward?
                st = self.agreement.status(False, self.size, self._fresh)
                if st.oom:
                    retries += 1
                    self._recovered(None, st, retries, forward=False)
                    if self._backward_oom(st, zero_grads):
                        pos, outputs = 0, []
                        continue
                    return RunResult(outputs, skipped=True)
            outputs.append(out)
            self.micro_batches += 1
            pos = stop
        return RunResult(outputs, skipped=False)

    def _backward_oom(self, st: Status, zero_grads: Optional[Callable[[], None]]) -> bool:
        """Reset gradients after an OOM in backward; True to rerun the batch (exact), False
        when the step must be skipped."""
        assert zero_grads is not None
        zero_grads()
        if st.fresh:
            return True
        self.skipped_steps += 1
        log.warning(
            "memguard: out of memory in backward after gradients had accumulated: "
            "this optimizer step is skipped (skipped so far: %d)",
            self.skipped_steps,
        )
        return False

    def _recovered(self, exc: Optional[BaseException], st: Status, retries: int, *, forward: bool) -> None:
        """Apply the agreed halved size, or give up (re-raise) when none is left."""
        if st.size < 1:
            msg = (
                f"memguard: out of memory at micro-batch size {self.size} "
                f"after {retries} retr{'y' if retries == 1 else 'ies'} in this batch; "
                "nothing smaller to try (lower the batch size, enable gradient checkpointing, "
                "or give the job more memory)"
            )
            log.error(msg)
            if exc is not None:
                _note(exc, msg)
                raise exc
            raise RuntimeError(msg + " (another rank ran out of memory)")
        if exc is not None:
            traceback.clear_frames(exc.__traceback__)  # drop the failed pass's tensors
        old = self.size
        self.size = st.size
        self.oom_cap = st.size
        self.oom_recoveries += 1
        self._release()
        log.warning(
            "memguard: out of memory in %s%s; micro-batch %s -> %d",
            "forward" if forward else "backward",
            "" if exc is not None else " on another rank",
            old,
            st.size,
        )
        if exc is not None:
            record_recovery(
                exc, self.guard, step=self.steps, batch_size=old, new_batch_size=st.size
            )


def _note(exc: BaseException, msg: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if callable(add_note):
        add_note(msg)


def grads_fresh(model: Any) -> bool:
    """True when no parameter of ``model`` holds a gradient (all ``None``)."""
    params = getattr(model, "parameters", None)
    if not callable(params):
        return False
    return all(p.grad is None for p in params())


def zero_grads(model: Any) -> Callable[[], None]:
    """A function resetting ``model``'s gradients to ``None``."""

    def reset() -> None:
        zero = getattr(model, "zero_grad", None)
        if callable(zero):
            zero(set_to_none=True)

    return reset


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` (or a submodule) is sharded by FSDP 1 or 2 (``fully_shard``)."""
    modules = getattr(model, "modules", None)
    candidates = modules() if callable(modules) else [model]
    for m in candidates:
        for cls in type(m).__mro__:
            if cls.__name__ in ("FSDPModule", "FullyShardedDataParallel"):
                return True
    return False


def no_sync_of(model: Any) -> Callable[[], Optional[ContextManager[Any]]]:
    """The context deferring gradient synchronisation, as a factory: ``model.no_sync()``
    (DDP, FSDP 1), FSDP 2's ``set_requires_gradient_sync(False)``, or ``None``."""

    def make() -> Optional[ContextManager[Any]]:
        fn = getattr(model, "no_sync", None)
        if callable(fn):
            return fn()  # type: ignore[no-any-return]
        if callable(getattr(model, "set_requires_gradient_sync", None)):
            return _fsdp2_no_sync(model)
        return None

    return make


def force_sync_of(model: Any) -> Callable[[], Optional[ContextManager[Any]]]:
    """The context making a micro-batch reduce its gradients even inside an enclosing
    ``no_sync`` (the trainer's own accumulation), as a factory: FSDP 2's
    ``set_requires_gradient_sync(True)``; ``None`` for other models (FSDP 1 and DDP keep the
    enclosing context, which the trainer leaves once Accelerate's ``sync_each_batch`` is set)."""

    def make() -> Optional[ContextManager[Any]]:
        if callable(getattr(model, "set_requires_gradient_sync", None)):
            return _fsdp2_sync(model)
        return None

    return make


@contextlib.contextmanager
def _fsdp2_sync(model: Any) -> Iterator[None]:
    # Left on afterwards: an enclosing no_sync() turns it back on at its exit anyway, and from
    # now on every micro-batch is to sync.
    model.set_requires_gradient_sync(True)
    yield


def sync_each_batch_on(accelerator: Any) -> bool:
    """Set HF Accelerate's ``sync_each_batch`` on ``accelerator``: its ``accumulate()`` and the
    HF Trainer read ``accelerator.gradient_state.plugin_kwargs["sync_each_batch"]`` at every
    micro-batch, so the change applies from the next one. Returns True when it was set now
    (False: already on, or not an Accelerator)."""
    state = getattr(accelerator, "gradient_state", None)
    kwargs = getattr(state, "plugin_kwargs", None)
    if not isinstance(kwargs, dict) or kwargs.get("sync_each_batch"):
        return False
    kwargs["sync_each_batch"] = True
    log.info("memguard: gradients synced at every micro-batch (Accelerate sync_each_batch)")
    return True


@contextlib.contextmanager
def _fsdp2_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def unwrap(model: Any) -> Any:
    """The module inside DDP / FSDP 1 wrappers (``.module``), else ``model``."""
    inner = getattr(model, "module", None)
    return inner if inner is not None and hasattr(inner, "parameters") else model


def enable_checkpointing(model: Any) -> bool:
    """Turn on gradient checkpointing where the model supports it (HF ``PreTrainedModel``)."""
    model = unwrap(model)
    # transformers 5 renamed these (the old names warn and go away in v6).
    new_api = callable(getattr(model, "activation_checkpointing_enable", None))
    on = "is_activation_checkpointing" if new_api else "is_gradient_checkpointing"
    if getattr(model, on, False):
        return False
    enable = getattr(
        model, "activation_checkpointing_enable" if new_api else "gradient_checkpointing_enable", None
    )
    if not callable(enable):
        return False
    try:
        enable()
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False
        log.info("memguard: gradient checkpointing enabled")
        return True
    except Exception as err:
        log.warning("memguard: could not enable gradient checkpointing: %s", err)
        return False


def follow(guard: Optional[Guard], agree: bool = True, **options: Any) -> "tuple[Guard, StepRunner]":
    """``guard`` (default: ``Guard()`` from the env) and a :class:`StepRunner` following it,
    agreeing with the other ranks when ``agree``; ``options`` are the runner's."""
    guard = guard if guard is not None else Guard()
    return guard, StepRunner(guard, Agreement(agree), **options)


def _runner_counter(name: str, doc: str) -> Any:
    return property(lambda self: getattr(self.runner, name), doc=doc)


class RunnerCounters:
    """The counters of a :class:`StepRunner`, read through the object that runs it (its
    ``runner`` attribute): what :class:`~memguard_client.torch.MicroBatcher` and the HF
    callback report."""

    runner: StepRunner

    downgrades = _runner_counter(
        "downgrades", "Steps whose agreed micro-batch size was smaller than the step before's."
    )
    micro_batches = _runner_counter("micro_batches", "Micro-batches run to completion.")
    sync_each_batch = _runner_counter(
        "sync_each_batch", "Gradients are reduced at every micro-batch (FSDP with several ranks; agreed)."
    )
    cache_releases = _runner_counter(
        "cache_releases", "Times the CUDA cache was released (downgrades and OOM recoveries)."
    )
    oom_recoveries = _runner_counter(
        "oom_recoveries", "Out-of-memory errors recovered in-process (this rank's or a peer's)."
    )
    skipped_steps = _runner_counter(
        "skipped_steps", "Optimizer steps skipped because an OOM hit after gradients had accumulated."
    )
