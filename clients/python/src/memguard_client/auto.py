"""Automatic attachment: a stock trainer follows memguard with no change to its code.

The webhook injects this client into a pod whose trainer runs Python: an init container writes it
into an ``emptyDir`` first on ``PYTHONPATH``, whose ``sitecustomize`` calls :func:`install` at
interpreter start-up. :func:`install` imports nothing but ``sys`` and ``os`` and does two things:

* it puts a one-shot finder on ``sys.meta_path`` that lets ``transformers.trainer`` load and then
  wraps ``Trainer.train``: when any ``transformers.Trainer`` (TRL's, axolotl's and
  LLaMA-Factory's trainers are subclasses) starts training, :func:`memguard_client.hf.attach`
  attaches it to a :class:`~memguard_client.Guard` read from the pod's ``MEMGUARD_*`` env:
  the signal, in-process OOM recovery and the rank agreement, exactly as an explicit
  ``attach()``. A script that never imports transformers pays for nothing more.
* when torch is imported (its ``torch.optim.optimizer``), it registers a global optimizer post-step hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``): after every optimizer step of
  any loop (Lightning Fabric, torchtune, LitGPT, plain torch, the Trainer too) the step count and
  the allocator figures (``torch.cuda``, read in the training thread, on its device) are handed
  to a daemon thread that posts them to the sidecar, at most once every
  :data:`REPORT_EVERY_SECONDS`. These loops own their batches, so nothing outside them can
  re-chunk one; they are reported, not steered. At the first step it also reports what the
  loop's objects say for sure (:func:`memguard_client.train_config.loop_config`: the process
  group's world size, the ranks in this container, the optimizer's parameters and kind),
  unless an adapter of the process reported a config already or the process imported
  ``transformers.trainer`` (its Trainer reports more when it trains).
* it installs a ``sys.excepthook`` that, for an uncaught out-of-memory error in any script,
  writes the OOM record and exits 86 (87 when the pod "cannot fit"), as
  :func:`memguard_client.oom.install_excepthook` does for an explicit ``Guard``. Everything it
  needs is imported only when an exception reaches it.

Attachment happens once: at ``train()``, so a script that called ``attach(trainer)`` itself
(after constructing the trainer, before training) keeps its own. ``MEMGUARD_AUTO_ATTACH=0``
turns the whole hook off. Any failure (a broken copy, an unsupported backend) is one line on
stderr, once, and the trainer runs as if memguard were absent.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping, Optional

#: The module whose import triggers the patch (``transformers.Trainer`` lives there; the lazy
#: ``transformers`` package imports it on first access to ``Trainer``).
TRAINER_MODULE = "transformers.trainer"
#: The module whose import starts the optimizer-step reports (``import torch`` imports it).
OPTIMIZER_MODULE = "torch.optim.optimizer"
#: Least time between two optimizer-step reports.
REPORT_EVERY_SECONDS = 1.0
#: Variable that turns the hook off (``memguard_client.env.AUTO_ATTACH``; not imported from
#: there, so :func:`install` stays this module alone).
AUTO_ATTACH = "MEMGUARD_AUTO_ATTACH"

_installed = False
_warned = False
_previous_excepthook: Optional[Callable[..., Any]] = None


def enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """False when ``MEMGUARD_AUTO_ATTACH`` is ``0``/``false``/``no``/``off``."""
    raw = (os.environ if environ is None else environ).get(AUTO_ATTACH, "")
    return raw.strip().lower() not in ("0", "false", "no", "off")


def install() -> bool:
    """Install the import hook and the OOM hook (once). Returns True when installed now."""
    global _installed, _previous_excepthook
    if _installed or not enabled():
        return False
    _installed = True
    hooks = {TRAINER_MODULE: patch_trainer, OPTIMIZER_MODULE: report_optimizer_steps}
    for name, hook in list(hooks.items()):
        module = sys.modules.get(name)
        if module is not None:
            hooks.pop(name)
            hook(module)
    if hooks:
        sys.meta_path.insert(0, _AfterImport(hooks))
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    return True


def warn_once(what: str, exc: BaseException) -> None:
    """The one line a failure of the hook gets; the trainer carries on."""
    global _warned
    if _warned:
        return
    _warned = True
    sys.stderr.write(
        f"memguard: {what}; training goes on without memguard ({type(exc).__name__}: {exc})\n"
    )


class _AfterImport:
    """Finds nothing itself: when a module of ``hooks`` is imported, it asks the finders after it
    and wraps the loader so that the module's hook runs once the module has executed. Each hook
    fires once; the finder leaves ``sys.meta_path`` after the last."""

    def __init__(self, hooks: "dict[str, Callable[[Any], None]]") -> None:
        self._hooks = dict(hooks)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        hook = self._hooks.pop(name, None)
        if hook is None:
            return None
        if not self._hooks:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                if find is not None:
                    spec = find(name, path, target)
                    if spec is not None:
                        break
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            spec.loader = _PatchingLoader(spec.loader, hook)
            return spec
        except Exception as exc:  # noqa: BLE001
            warn_once(f"could not hook {name}", exc)
            return None


class _PatchingLoader:
    """The real loader, then the module's hook."""

    def __init__(self, inner: Any, hook: "Callable[[Any], None]") -> None:
        self._inner, self._hook = inner, hook

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        self._hook(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, … for tracebacks
        return getattr(self._inner, name)


def patch_trainer(module: Any) -> None:
    """Wrap ``module.Trainer.train`` so each trainer is attached when it starts training."""
    try:
        trainer_cls = module.Trainer
        inner = trainer_cls.train
        if getattr(inner, "_memguard_auto", False):
            return

        def train(self: Any, *args: Any, **kwargs: Any) -> Any:
            attach_once(self)
            return inner(self, *args, **kwargs)

        train.__wrapped__ = inner  # type: ignore[attr-defined]
        train.__doc__ = inner.__doc__
        train.__name__ = getattr(inner, "__name__", "train")
        train._memguard_auto = True  # type: ignore[attr-defined]
        trainer_cls.train = train
    except Exception as exc:  # noqa: BLE001
        warn_once("could not hook transformers.Trainer", exc)


def report_optimizer_steps(optimizer_module: Any) -> None:
    """Register the optimizer post-step hook that reports each step (see the module doc)."""
    if not os.environ.get("MEMGUARD_SIDECAR_URL"):
        return  # nowhere to report to
    try:
        optimizer_module.register_optimizer_step_post_hook(_StepReporter())
    except Exception as exc:  # noqa: BLE001
        warn_once("could not hook torch's optimizer steps", exc)


class _StepReporter:
    """Counts optimizer steps; at most every :data:`REPORT_EVERY_SECONDS` reads the allocator
    figures (here, in the training thread) and hands them to a daemon thread that posts them."""

    def __init__(self) -> None:
        import time

        self._clock = time.monotonic
        self._steps = 0
        self._last = float("-inf")
        self._queue: Any = None
        self._config_sent = False

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps += 1
        now = self._clock()
        if now - self._last < REPORT_EVERY_SECONDS:
            return
        self._last = now
        try:
            if self._queue is None:
                self._start()
            from .frameworks import framework_memory

            body = dict(framework_memory(import_missing=False) or {})
            body["step"] = self._steps - 1
            if not self._config_sent:
                self._config_sent = True
                config = self._config(optimizer)
                if config:
                    self._queue.put(("config", config))
            self._queue.put(("step", body))
        except Exception as exc:  # noqa: BLE001
            warn_once("could not report the optimizer step", exc)

    @staticmethod
    def _config(optimizer: Any) -> "dict[str, float]":
        """What this loop's objects say at its first step (the world size, the ranks here, the
        optimizer's parameters and kind), unless an adapter of this process (``attach``,
        ``MicroBatcher``) reported more, or a ``transformers.Trainer`` may still: the sidecar
        decides the train-start plan once, on the first config, and this one has no
        micro-batch to plan."""
        from .guard import config_reported
        from .train_config import loop_config

        if config_reported() or TRAINER_MODULE in sys.modules:
            return {}
        return loop_config(optimizer=optimizer)

    def _start(self) -> None:
        import queue
        import threading

        from .guard import Guard

        guard = Guard(background=False, oom_hook=False)
        self._queue = queue.SimpleQueue()

        def post() -> None:
            while True:
                kind, body = self._queue.get()
                # Neither raises; a dead sidecar costs this thread only.
                if kind == "config":
                    guard.report_config(body)
                else:
                    guard.report(**body)

        threading.Thread(target=post, name="memguard-report", daemon=True).start()


def attach_once(trainer: Any) -> Any:
    """Attach ``trainer`` unless something (the script, an earlier ``train()``) did. Returns the
    callback, or None when the pod has no memguard env or attaching failed."""
    existing = getattr(trainer, "_memguard_callback", None)
    if existing is not None:
        return existing
    try:
        from .guard import Guard
        from .hf import attach

        guard = Guard()
        if not guard.enabled:
            return None  # no signal file and no sidecar URL: nothing to follow
        cb = attach(trainer, guard)
        sys.stderr.write(
            f"memguard: {type(trainer).__name__} follows the sidecar's signal (attached automatically)\n"
        )
        return cb
    except Exception as exc:  # noqa: BLE001
        warn_once(f"could not attach to {type(trainer).__name__}", exc)
        return None


def _excepthook(etype: Any, value: BaseException, tb: Any) -> None:
    previous = _previous_excepthook or sys.__excepthook__
    oom = sys.modules.get("memguard_client.oom")
    if oom is not None and getattr(oom, "_previous_hook", None) is not None:
        # A Guard's own OOM hook is installed and calls this one to print the traceback.
        previous(etype, value, tb)
        return
    try:
        from . import oom as oom_module

        if oom_module.classify(value) is None:
            previous(etype, value, tb)
            return
        from .guard import Guard

        guard = Guard(background=False, oom_hook=False)
        oom_module.install_excepthook(guard)  # chains back to this hook for the traceback
    except Exception as exc:  # noqa: BLE001
        warn_once("could not record the out-of-memory error", exc)
        previous(etype, value, tb)
        return
    sys.excepthook(etype, value, tb)  # records, writes the termination message, exits
