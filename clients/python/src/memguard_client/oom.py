"""Out-of-memory errors: tell one apart, record it, exit with a code a Job can act on.

The record is ``memguard_api::oom::OomRecord`` (version 1), one JSON line::

    {"version": 1, "kind": "cuda_oom", "outcome": "fatal", "step": 412, "batch_size": 8,
     "grad_accumulation": 4, "grad_checkpointing": true, "allocated_bytes": ...,
     "reserved_bytes": ..., "peak_bytes": ..., "requested_bytes": 2147483648,
     "total_bytes": ..., "message": "CUDA out of memory. Tried to allocate 2.00 GiB. ...",
     "timestamp": "2026-11-22T22:00:00.000Z", "phase": "step"}

``phase`` is the phase the guard last reported (``load``, ``step``, ``save``:
:mod:`memguard_client.phase`), absent when it reported none: a fatal host OOM while saving
tells the next admission what an OOM kill in that phase tells it (``oom_kill_phase``).

:func:`record` is called on every OOM: with ``outcome="recovered"`` by an adapter that shrank
the micro-batch in-process, with ``outcome="fatal"`` when the trainer gives up. It reports the
record to the sidecar (``POST /v1/report`` with ``{"oom": record}``; the sidecar counts it,
applies a sticky downgrade for an in-place restart and carries it in its summary). When fatal it
also writes the record as the container's termination message (``/dev/termination-log`` when the
kubelet created it; ``MEMGUARD_TERMINATION_LOG`` overrides the path) so the profile controller
admits the Job's next pod one step smaller, and exits with :data:`EXIT_OOM`
(:data:`EXIT_OOM_CANNOT_FIT` when the webhook already said the job cannot fit).

An uncaught OOM is recorded by the ``sys.excepthook`` that :class:`~memguard_client.Guard`
installs (``Guard(oom_hook=True)``, the default when a sidecar is configured), or, where
``atexit`` handlers must run, by wrapping the loop in :func:`exit_on_oom`.

Nothing here imports torch: a torch exception can only exist once torch is imported, so
:func:`classify` looks it up in ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import re
import sys
import traceback
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Mapping, Optional, Type, Union

from . import env as _env

if TYPE_CHECKING:  # pragma: no cover
    from .guard import Guard

log = logging.getLogger("memguard_client")

#: Accelerator memory ran out (``torch.OutOfMemoryError``, "CUDA out of memory", HIP).
CUDA_OOM = "cuda_oom"
#: Host memory ran out (``MemoryError``, "DefaultCPUAllocator: can't allocate memory").
CPU_OOM = "cpu_oom"
#: Outcomes of :func:`record`.
OUTCOMES = ("recovered", "fatal")
#: Schema version of the record (``memguard_api::oom::OOM_RECORD_VERSION``).
OOM_RECORD_VERSION = 1
#: Exit code after a fatal OOM: the Job's next pod is admitted smaller (``podFailurePolicy``:
#: count it, or let it retry).
EXIT_OOM = 86
#: Exit code after a fatal OOM in a pod the webhook admitted with "cannot fit"
#: (``MEMGUARD_CANNOT_FIT=true``): retrying cannot help (``podFailurePolicy``: ``FailJob``).
EXIT_OOM_CANNOT_FIT = 87
#: The kubelet's default termination-message path.
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
#: Longest message kept in a record.
MAX_MESSAGE_CHARS = 512
#: Kubernetes keeps at most this many bytes of a termination message.
MAX_TERMINATION_MESSAGE_BYTES = 4096

# Message fragments that mean an allocator ran out, for RuntimeErrors that are not (or, in
# older torch, were not yet) typed as OutOfMemoryError.
_CUDA_TEXTS = (
    "CUDA out of memory",
    "HIP out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
)
_CPU_TEXTS = ("DefaultCPUAllocator: can't allocate memory",)

_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)"
_UNITS = {
    "bytes": 1,
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    # torch writes binary units; an SI-looking unit from another allocator is read the same way.
    "KB": 1 << 10,
    "MB": 1 << 20,
    "GB": 1 << 30,
    "TB": 1 << 40,
}
_REQUESTED = re.compile(r"[Tt]ried to allocate\s+" + _SIZE)
_TOTAL = (
    re.compile(r"total capacity of\s+" + _SIZE),  # torch ≥ 2.1
    re.compile(_SIZE + r"\s+total capacity"),  # older torch
)
_ALLOCATED = (
    re.compile(_SIZE + r"\s+is allocated by PyTorch"),
    re.compile(_SIZE + r"\s+already allocated"),
)
_RESERVED_TOTAL = re.compile(_SIZE + r"\s+reserved in total by PyTorch")
_RESERVED_UNALLOCATED = re.compile(_SIZE + r"\s+is reserved by PyTorch but unallocated")


def classify(exc: BaseException) -> Optional[str]:
    """``"cuda_oom"``, ``"cpu_oom"``, or ``None`` when ``exc`` is not an out-of-memory error.

    Looks at ``exc`` and the exceptions it was raised ``from`` (a framework that wraps an OOM
    keeps it as ``__cause__``).
    """
    seen = 0
    cur: Optional[BaseException] = exc
    while cur is not None and seen < 8:
        kind = _classify_one(cur)
        if kind is not None:
            return kind
        cur = cur.__cause__
        seen += 1
    return None


def _classify_one(exc: BaseException) -> Optional[str]:
    torch = sys.modules.get("torch")
    if torch is not None:
        for cls in (
            getattr(torch, "OutOfMemoryError", None),
            getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
        ):
            if isinstance(cls, type) and isinstance(exc, cls):
                return CUDA_OOM
    if isinstance(exc, MemoryError):
        return CPU_OOM
    if isinstance(exc, RuntimeError):
        text = _text(exc)
        if any(t in text for t in _CPU_TEXTS):
            return CPU_OOM
        if any(t in text for t in _CUDA_TEXTS):
            return CUDA_OOM
    return None


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not hide the OOM
        return ""


def _size(match: "Optional[re.Match[str]]") -> Optional[int]:
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def requested_bytes(message: str) -> Optional[int]:
    """Size of the failed allocation the message gives ("Tried to allocate 2.00 GiB",
    "you tried to allocate 1099511627776 bytes"), else ``None``."""
    return _size(_REQUESTED.search(message))


def message_figures(message: str) -> Dict[str, int]:
    """The allocator's figures a torch OOM message gives: ``requested_bytes``, ``total_bytes``,
    ``allocated_bytes``, ``reserved_bytes`` (only those present)."""
    out: Dict[str, int] = {}
    req = requested_bytes(message)
    if req is not None:
        out["requested_bytes"] = req
    for key, patterns in (("total_bytes", _TOTAL), ("allocated_bytes", _ALLOCATED)):
        for pattern in patterns:
            n = _size(pattern.search(message))
            if n is not None:
                out[key] = n
                break
    reserved = _size(_RESERVED_TOTAL.search(message))
    if reserved is None:
        unallocated = _size(_RESERVED_UNALLOCATED.search(message))
        if unallocated is not None and "allocated_bytes" in out:
            reserved = out["allocated_bytes"] + unallocated
    if reserved is not None:
        out["reserved_bytes"] = reserved
    return out


def build_record(
    exc: BaseException,
    guard: "Optional[Guard]",
    *,
    step: Optional[int],
    outcome: str,
    new_batch_size: Optional[int] = None,
    batch_size: Optional[int] = None,
    grad_accumulation: Optional[int] = None,
    grad_checkpointing: Optional[bool] = None,
    phase: Optional[str] = None,
) -> Dict[str, Any]:
    """The record of ``exc`` as a dict (the JSON object), without reporting or writing it.

    The config in force is the guard's unless given; ``step`` defaults to the guard's last
    reported step, ``phase`` to the phase it last reported (none when it reported none).
    Raises ``ValueError`` when ``exc`` is not an OOM, or ``outcome`` or ``phase`` is unknown.
    """
    from .phase import PHASES

    if phase is None and guard is not None:
        phase = guard.phase
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
    kind = classify(exc)
    if kind is None:
        raise ValueError(f"not an out-of-memory error: {type(exc).__name__}")
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, not {outcome!r}")
    if step is None and guard is not None:
        step = guard.last_step
    rec: Dict[str, Any] = {"version": OOM_RECORD_VERSION, "kind": kind, "outcome": outcome}
    if _env.non_negative_int(step) is not None:
        rec["step"] = _env.non_negative_int(step)
    rec["batch_size"] = max(1, _env.non_negative_int(batch_size) or (guard.batch_size if guard else 1))
    rec["grad_accumulation"] = max(
        1, _env.non_negative_int(grad_accumulation) or (guard.grad_accumulation if guard else 1)
    )
    if grad_checkpointing is None:
        grad_checkpointing = guard.grad_checkpointing if guard else False
    rec["grad_checkpointing"] = bool(grad_checkpointing)
    if _env.non_negative_int(new_batch_size):
        rec["new_batch_size"] = _env.non_negative_int(new_batch_size)
        # A recovery shrinks the micro-batch; one that grows it would raise the memory that just
        # ran out and break batch x accumulation.
        if outcome == "recovered" and rec["new_batch_size"] > rec["batch_size"]:
            raise ValueError(
                f"a recovery shrinks the batch: new_batch_size {rec['new_batch_size']} is "
                f"larger than batch_size {rec['batch_size']}"
            )
    message = _first_oom_message(exc)
    figures = message_figures(message)
    figures.update(_live_figures(kind))
    for key in ("allocated_bytes", "reserved_bytes", "peak_bytes", "requested_bytes", "total_bytes"):
        if key in figures:
            rec[key] = figures[key]
    first_line = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    rec["message"] = first_line[:MAX_MESSAGE_CHARS]
    rec["timestamp"] = _now_rfc3339()
    if phase is not None:
        rec["phase"] = phase
    return rec


def record(
    exc: BaseException,
    guard: "Optional[Guard]",
    *,
    step: Optional[int],
    outcome: str,
    new_batch_size: Optional[int] = None,
    batch_size: Optional[int] = None,
    grad_accumulation: Optional[int] = None,
    grad_checkpointing: Optional[bool] = None,
    phase: Optional[str] = None,
) -> Dict[str, Any]:
    """Record an OOM: report it to the sidecar; when fatal, also write the termination message
    and exit.

    ``outcome="recovered"``: returns the record (reported when a sidecar is configured).
    ``outcome="fatal"``: prints the traceback, writes the termination message and raises
    ``SystemExit`` with :func:`exit_code` (it does not return).
    """
    rec = build_record(
        exc,
        guard,
        step=step,
        outcome=outcome,
        new_batch_size=new_batch_size,
        batch_size=batch_size,
        grad_accumulation=grad_accumulation,
        grad_checkpointing=grad_checkpointing,
        phase=phase,
    )
    if guard is not None:
        guard.report_oom(rec)
    if outcome == "recovered":
        log.warning(
            "memguard: %s at step %s recovered in-process: batch %d -> %s",
            rec["kind"],
            rec.get("step", "?"),
            rec["batch_size"],
            rec.get("new_batch_size", "?"),
        )
        return rec
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    write_termination_message(rec)
    code = exit_code()
    log.error(
        "memguard: fatal %s recorded (phase %s); exiting with %d",
        rec["kind"],
        rec.get("phase", "not reported"),
        code,
    )
    raise SystemExit(code) from exc


def write_termination_message(
    rec: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None
) -> Optional[str]:
    """Write ``rec`` as one JSON line to the termination-message path. Returns the path written,
    or ``None``.

    ``MEMGUARD_TERMINATION_LOG`` names the path; without it ``/dev/termination-log`` is written
    only when it exists (the kubelet creates it), so a run outside Kubernetes leaves ``/dev``
    alone. Never raises.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(_env.TERMINATION_LOG) or None
    if path is None:
        if not os.path.exists(DEFAULT_TERMINATION_LOG):
            return None
        path = DEFAULT_TERMINATION_LOG
    line = termination_line(rec)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(line)
    except OSError as err:
        log.warning("memguard: cannot write the OOM record to %s: %s", path, err)
        return None
    return path


def termination_line(rec: Mapping[str, Any]) -> str:
    """``rec`` as one JSON line within Kubernetes' 4096-byte termination message."""
    line = json.dumps(rec, separators=(",", ":"), ensure_ascii=True)
    if len(line) + 1 > MAX_TERMINATION_MESSAGE_BYTES:
        trimmed = dict(rec)
        trimmed["message"] = ""
        line = json.dumps(trimmed, separators=(",", ":"), ensure_ascii=True)
    return line + "\n"


def exit_code(environ: Optional[Mapping[str, str]] = None) -> int:
    """:data:`EXIT_OOM_CANNOT_FIT` when the webhook admitted the pod with "cannot fit", else
    :data:`EXIT_OOM`."""
    environ = os.environ if environ is None else environ
    return EXIT_OOM_CANNOT_FIT if _env.env_bool(environ, _env.CANNOT_FIT, False) else EXIT_OOM


@contextlib.contextmanager
def exit_on_oom(
    guard: "Optional[Guard]", step: Union[None, int, Callable[[], Optional[int]]] = None
) -> Iterator[None]:
    """Run a block; an OOM escaping it is recorded as fatal and the process exits (through
    ``SystemExit``, so ``finally`` blocks and ``atexit`` handlers run). Other exceptions pass.

    ``step``: the step, or a callable giving it at the failure (default: the guard's last
    reported step).
    """
    try:
        yield
    except BaseException as exc:  # noqa: B902 - only OOMs are handled, the rest re-raised
        if isinstance(exc, SystemExit) or classify(exc) is None:
            raise
        at = step() if callable(step) else step
        record(exc, guard, step=at, outcome="fatal")


_ExcHook = Callable[[Type[BaseException], BaseException, Optional[TracebackType]], Any]
_hook_guard: "Optional[Guard]" = None
_previous_hook: Optional[_ExcHook] = None


def install_excepthook(guard: "Guard") -> None:
    """Record an uncaught OOM as fatal: the previous hook prints the traceback, then the record
    is reported and written and the process ends with :func:`exit_code`.

    The interpreter is already unwinding, so the exit is ``os._exit`` (after flushing stdout and
    stderr): ``atexit`` handlers do not run. Use :func:`exit_on_oom` where they must. Installing
    again only changes the guard the hook uses.
    """
    global _hook_guard, _previous_hook
    _hook_guard = guard
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def uninstall_excepthook() -> None:
    """Put the hook that was there before :func:`install_excepthook` back."""
    global _hook_guard, _previous_hook
    if _previous_hook is not None and sys.excepthook is _excepthook:
        sys.excepthook = _previous_hook
    _previous_hook = None
    _hook_guard = None


def _excepthook(
    etype: Type[BaseException], value: BaseException, tb: Optional[TracebackType]
) -> None:
    previous = _previous_hook or sys.__excepthook__
    if classify(value) is None:
        previous(etype, value, tb)
        return
    previous(etype, value, tb)
    try:
        rec = build_record(value, _hook_guard, step=None, outcome="fatal")
        if _hook_guard is not None:
            _hook_guard.report_oom(rec)
        write_termination_message(rec)
    except Exception:  # the hook must still exit with the documented code
        log.exception("memguard: recording the OOM failed")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(exit_code())


def _first_oom_message(exc: BaseException) -> str:
    cur: Optional[BaseException] = exc
    for _ in range(8):
        if cur is None:
            break
        if _classify_one(cur) is not None:
            return _text(cur)
        cur = cur.__cause__
    return _text(exc)


def _live_figures(kind: str) -> Dict[str, int]:
    """Figures read from the allocator now, where it can say: torch.cuda for a CUDA OOM, the
    process's peak RSS for a host OOM."""
    out: Dict[str, int] = {}
    if kind == CUDA_OOM:
        from .frameworks import torch_memory

        mem = torch_memory(import_missing=False)
        if mem is not None and mem.get("framework") == "torch":
            for key in ("allocated_bytes", "reserved_bytes", "peak_bytes", "total_bytes"):
                n = _env.non_negative_int(mem.get(key))
                if n is not None:
                    out[key] = n
        return out
    try:
        import resource

        maxrss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        # Linux reports KiB, macOS bytes.
        out["peak_bytes"] = maxrss if sys.platform == "darwin" else maxrss * 1024
    except Exception:
        pass
    return out


def _now_rfc3339() -> str:
    now = _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"
