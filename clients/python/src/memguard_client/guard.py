"""`Guard`: the trainer's view of memguard's signal.

Sources, either or both:

* the signal file (``MEMGUARD_SIGNAL_FILE``): :meth:`Guard.refresh` costs one ``os.stat`` when
  nothing changed and re-reads the file only when its (mtime_ns, size, inode, device) changed;
* the sidecar's HTTP API (``MEMGUARD_SIDECAR_URL``): a daemon thread long-polls
  ``GET /v1/signal?after=SEQ&wait=30s`` and hands what it receives to the next
  :meth:`Guard.refresh` (the training loop is never blocked by the network).

A signal is applied only when its ``seq`` is greater than the one applied last, so the two
sources can race without the trainer ever going backwards. Nothing here raises because of the
sidecar: a missing, half-written, garbage or wrong-version file and a dead or slow sidecar all
leave the last good values in place. With no source configured the Guard is a no-op that
returns the starting values, so one training script runs with and without memguard.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Mapping, Optional, Tuple

from . import env as _env
from .frameworks import framework_memory
from .own_cgroup import OwnCgroup
from .signal import Pressure, Signal, parse_signal

log = logging.getLogger("memguard_client")

#: Largest signal file or HTTP body read (a signal is a few hundred bytes).
MAX_SIGNAL_BYTES = 64 * 1024
#: A file read less than this long after its mtime may have been replaced again within the
#: file system's timestamp granularity with the same size and a reused inode number; such a
#: "racy" read is repeated on the next refresh (the racy-git rule).
RACY_WINDOW_NS = 50_000_000

#: Default seconds the first step waits for the sidecar's train-start plan
#: (``MEMGUARD_TRAIN_START_WAIT`` overrides it).
TRAIN_START_WAIT = 2.0

_FileKey = Tuple[int, int, int, int]
#: A config from this process was accepted (the sidecar keeps the last one whole): a reporter
#: that knows less (:mod:`memguard_client.auto`'s) then reports none.
_config_reported = False


def config_reported() -> bool:
    """Whether the sidecar accepted a config from any :class:`Guard` of this process."""
    return _config_reported


class Guard:
    """Follow memguard's signal and report allocator figures to the sidecar.

    Args:
        signal_file: path of the signal file. ``None`` (default) reads ``MEMGUARD_SIGNAL_FILE``;
            ``""`` disables the file source.
        sidecar_url: base URL of the sidecar's trainer API, e.g. ``http://127.0.0.1:9091``.
            ``None`` (default) reads ``MEMGUARD_SIDECAR_URL``; ``""`` disables HTTP.
        batch_size, grad_accumulation, grad_checkpointing: starting values used when the
            corresponding ``MEMGUARD_*`` variable is not set (the webhook's plan wins over the
            script's own defaults).
        grad_sync: ``"each-batch"`` or ``"accumulate"`` (default), used when
            ``MEMGUARD_GRAD_SYNC`` is not set: whether gradients are synced at every
            micro-batch (see :attr:`grad_sync`).
        env: the environment to read (default ``os.environ``); tests pass a dict.
        background: long-poll the sidecar URL in a daemon thread (default). With ``False`` the
            HTTP source is asked only by :meth:`poll_http`.
        poll_wait: seconds the sidecar may hold a long-poll open.
        report_timeout: seconds :meth:`report` waits for the sidecar at most.
        oom_hook: record an uncaught out-of-memory error (``sys.excepthook``, see
            :func:`memguard_client.oom.install_excepthook`): the record goes to the sidecar and
            the termination message, and the process exits 86. ``None`` (default) installs it
            when a source is configured (a pod memguard admitted); ``False`` never does.
    """

    def __init__(
        self,
        signal_file: Optional[str] = None,
        sidecar_url: Optional[str] = None,
        *,
        batch_size: Optional[int] = None,
        grad_accumulation: Optional[int] = None,
        grad_checkpointing: Optional[bool] = None,
        grad_sync: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        background: bool = True,
        poll_wait: float = 30.0,
        report_timeout: float = 0.5,
        oom_hook: Optional[bool] = None,
    ) -> None:
        environ: Mapping[str, str] = os.environ if env is None else env
        if signal_file is None:
            signal_file = environ.get(_env.SIGNAL_FILE, "")
        if sidecar_url is None:
            sidecar_url = environ.get(_env.SIDECAR_URL, "")
        self._signal_file: Optional[str] = signal_file or None
        self._url: Optional[str] = sidecar_url.rstrip("/") if sidecar_url else None
        self._poll_wait = max(0.0, float(poll_wait))
        self._report_timeout = float(report_timeout)
        self._train_start_wait = _env.env_seconds(environ, _env.TRAIN_START_WAIT, TRAIN_START_WAIT)
        # The container's own cgroup, for a sidecar that cannot read it (own_cgroup.py).
        self._own_cgroup = OwnCgroup()
        if self._url is not None:
            self._own_cgroup.start()

        start_batch = _env.env_int(environ, _env.BATCH_SIZE, batch_size if batch_size else 1)
        start_accum = _env.env_int(
            environ, _env.GRAD_ACCUMULATION, grad_accumulation if grad_accumulation else 1
        )
        start_ckpt = _env.env_bool(environ, _env.GRAD_CHECKPOINTING, bool(grad_checkpointing))
        self._grad_sync = _env.env_grad_sync(
            environ, _env.EACH_BATCH if grad_sync == _env.EACH_BATCH else _env.ACCUMULATE
        )
        self._initial = Signal(
            version=1,
            seq=-1,
            level="ok",
            batch_size=max(1, start_batch),
            grad_accumulation=max(1, start_accum),
            grad_checkpointing=start_ckpt,
            reason="starting configuration (no signal received yet)",
            pressure=Pressure(),
            timestamp="",
        )
        self._current: Signal = self._initial
        self._seen_at: Optional[float] = None
        self._source: Optional[str] = None
        self._changed = False
        self._last_step: Optional[int] = None
        # The phase sent with every report once set (phase.py); dropped for good when the
        # sidecar is older than the field (it refuses the whole report).
        self._phase: Optional[str] = None
        self._send_phase = True

        self._file_key: Optional[_FileKey] = None
        self._file_racy = False

        self._lock = threading.Lock()
        self._pending: Optional[Signal] = None
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self._url and background:
            self._thread = threading.Thread(
                target=self._poll_loop, name="memguard-longpoll", daemon=True
            )
            self._thread.start()
        if self._signal_file is not None:
            # Before the first step: a trainer restarted in place starts from the sidecar's
            # (sticky) signal, not from the env it was admitted with. The first refresh()
            # reports it as new.
            first = self._read_file_if_changed(self._signal_file)
            if first is not None:
                self._apply(first, "file")
        if oom_hook or (oom_hook is None and self.enabled):
            from .oom import install_excepthook

            install_excepthook(self)

    # --- what the trainer reads -------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether any source (file or sidecar URL) is configured."""
        return self._signal_file is not None or self._url is not None

    @property
    def signal_file(self) -> Optional[str]:
        """The signal file followed, if any."""
        return self._signal_file

    @property
    def sidecar_url(self) -> Optional[str]:
        """The sidecar base URL used, if any."""
        return self._url

    @property
    def batch_size(self) -> int:
        """Current recommended per-device batch size (≥ 1)."""
        return self._current.batch_size

    @property
    def grad_accumulation(self) -> int:
        """Current recommended gradient accumulation steps (≥ 1)."""
        return self._current.grad_accumulation

    @property
    def grad_checkpointing(self) -> bool:
        """Whether gradient checkpointing is recommended."""
        return self._current.grad_checkpointing

    @property
    def grad_sync(self) -> str:
        """``"each-batch"`` when the webhook's plan (``MEMGUARD_GRAD_SYNC``) asks the trainer
        to sync gradients at every micro-batch, so FSDP keeps them sharded; else
        ``"accumulate"``. Fixed for the run: the adapters also switch to syncing each batch
        by themselves at a run-time downgrade under FSDP."""
        return self._grad_sync

    @property
    def effective_batch(self) -> int:
        """``batch_size * grad_accumulation``."""
        return self._current.effective_batch

    @property
    def level(self) -> str:
        """``"ok"``, ``"warn"``, ``"downgrade"`` or ``"critical"``."""
        return self._current.level

    @property
    def seq(self) -> int:
        """Sequence number of the signal applied last; ``-1`` before any signal."""
        return self._current.seq

    @property
    def signal(self) -> Optional[Signal]:
        """The signal applied last, or ``None`` before any (starting values in use)."""
        return None if self._current.seq < 0 else self._current

    @property
    def initial(self) -> Signal:
        """The starting configuration (``seq == -1``), from env or constructor defaults."""
        return self._initial

    @property
    def source(self) -> Optional[str]:
        """Where the current signal came from: ``"file"``, ``"http"``, or ``None`` before any."""
        return self._source

    @property
    def last_step(self) -> Optional[int]:
        """The step of the last :meth:`report` that gave one (what an OOM record names)."""
        return self._last_step

    @property
    def phase(self) -> Optional[str]:
        """The phase last set by :meth:`report_phase` (``load``, ``step``, ``save``), or
        ``None`` before any."""
        return self._phase

    @property
    def seen_at(self) -> Optional[float]:
        """``time.time()`` when the current signal was applied by :meth:`refresh`."""
        return self._seen_at

    # --- following the signal ---------------------------------------------------------------

    def refresh(self) -> bool:
        """Pick up a newer signal. True when one arrived since the last call.

        Cheap (one ``os.stat`` when nothing changed); never raises because of the sidecar.
        """
        candidates: List[Tuple[Signal, str]] = []
        with self._lock:
            if self._pending is not None:
                candidates.append((self._pending, "http"))
                self._pending = None
        if self._signal_file is not None:
            from_file = self._read_file_if_changed(self._signal_file)
            if from_file is not None:
                candidates.append((from_file, "file"))
        newest: Optional[Tuple[Signal, str]] = None
        for cand in candidates:
            if cand[0].seq > self._current.seq and (newest is None or cand[0].seq > newest[0].seq):
                newest = cand
        if newest is not None:
            self._apply(*newest)
        changed, self._changed = self._changed, False
        return changed

    def wait_for_signal(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a newer signal; True when one was applied."""
        deadline = time.monotonic() + timeout
        while True:
            if self.refresh():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._wakeup.wait(min(left, 0.02))
            self._wakeup.clear()

    def poll_http(self, wait: float = 0.0) -> bool:
        """Ask the sidecar once (``wait`` seconds of long-poll) and apply what is newer.

        For ``background=False``; with the background thread running there is no need.
        Returns what :meth:`refresh` returns.
        """
        if self._url is not None:
            try:
                sig = self._get_signal(self._current.seq, wait)
            except _PollError:
                sig = None
            if sig is not None:
                self._offer(sig)
        return self.refresh()

    def _apply(self, sig: Signal, source: str) -> None:
        prev = self._current
        self._current = sig
        self._source = source
        self._seen_at = time.time()
        self._changed = True
        if (sig.batch_size, sig.grad_accumulation, sig.grad_checkpointing) != (
            prev.batch_size,
            prev.grad_accumulation,
            prev.grad_checkpointing,
        ):
            log.info(
                "memguard signal seq=%d level=%s: batch %d -> %d, accumulation %d -> %d (%s)",
                sig.seq,
                sig.level,
                prev.batch_size,
                sig.batch_size,
                prev.grad_accumulation,
                sig.grad_accumulation,
                sig.reason,
            )

    def _read_file_if_changed(self, path: str) -> Optional[Signal]:
        try:
            st = os.stat(path)
        except OSError:
            self._file_key = None
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
        if key == self._file_key and not self._file_racy:
            return None
        try:
            with open(path, "rb") as f:
                fst = os.fstat(f.fileno())
                data = f.read(MAX_SIGNAL_BYTES + 1)
        except OSError:
            return None
        self._file_key = (fst.st_mtime_ns, fst.st_size, fst.st_ino, fst.st_dev)
        self._file_racy = time.time_ns() - fst.st_mtime_ns < RACY_WINDOW_NS
        if len(data) > MAX_SIGNAL_BYTES:
            return None
        return parse_signal(data)

    def _offer(self, sig: Signal) -> None:
        with self._lock:
            if self._pending is None or sig.seq > self._pending.seq:
                self._pending = sig
        self._wakeup.set()

    def _get_signal(self, after: int, wait: float) -> Optional[Signal]:
        """One `GET /v1/signal`; ``None`` on no news, :class:`_PollError` on a failure."""
        assert self._url is not None
        millis = int(round(wait * 1000))
        query = f"wait={millis // 1000}s" if millis % 1000 == 0 else f"wait={millis}ms"
        if after >= 0:
            query = f"after={after}&{query}"
        req = urllib.request.Request(
            f"{self._url}/v1/signal?{query}", headers={"Accept": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=wait + 5.0) as resp:
                if resp.status != 200:
                    return None
                data = resp.read(MAX_SIGNAL_BYTES + 1)
        except Exception as err:  # URLError, timeouts, resets, HTTP errors: all "no news"
            log.debug("memguard long-poll failed: %s", err)
            raise _PollError() from err
        if len(data) > MAX_SIGNAL_BYTES:
            return None
        return parse_signal(data)

    def _poll_loop(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            with self._lock:
                pending_seq = self._pending.seq if self._pending is not None else -1
            after = max(self._current.seq, pending_seq)
            started = time.monotonic()
            try:
                sig = self._get_signal(after, self._poll_wait)
            except _PollError:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            except Exception:  # never let the thread die on a surprise
                log.exception("memguard long-poll thread error")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = 0.5
            if sig is not None and sig.seq > after:
                self._offer(sig)
            elif time.monotonic() - started < 1.0:
                # Answered at once with nothing new: a sidecar that does not hold the request.
                # Do not spin.
                self._stop.wait(1.0)

    def close(self) -> None:
        """Stop the long-poll thread (it is a daemon thread: closing is optional)."""
        self._stop.set()
        self._wakeup.set()

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reporting --------------------------------------------------------------------------

    def report(
        self,
        *,
        step: Optional[int] = None,
        batch_size: Optional[int] = None,
        allocated_bytes: Optional[int] = None,
        reserved_bytes: Optional[int] = None,
        peak_bytes: Optional[int] = None,
        total_bytes: Optional[int] = None,
        framework: Optional[str] = None,
        leak_bytes_per_second: Optional[int] = None,
    ) -> bool:
        """POST the trainer's figures to ``/v1/report``. True when the sidecar accepted them.

        ``leak_bytes_per_second``: the growth a framework helper's leak check sees (see
        :class:`memguard_client.mlx.LeakDetector`); sent only while a leak is seen.
        Only the given fields are sent (the sidecar rejects unknown ones). Never raises: with
        no sidecar URL it returns False at once; a dead sidecar costs at most
        ``report_timeout`` seconds.
        """
        body: Dict[str, Any] = {}
        for name, value in (
            ("allocated_bytes", allocated_bytes),
            ("reserved_bytes", reserved_bytes),
            ("peak_bytes", peak_bytes),
            ("total_bytes", total_bytes),
            ("step", step),
            ("batch_size", batch_size),
            ("leak_bytes_per_second", leak_bytes_per_second),
        ):
            n = _env.non_negative_int(value)
            if n is not None:
                body[name] = n
        if "step" in body:
            self._last_step = body["step"]
        if isinstance(framework, str) and framework:
            body["framework"] = framework[:64]
        return self._post_report(body)

    def report_step(
        self, *, step: int, batch_size: int, figures: Optional[Mapping[str, Any]] = None
    ) -> bool:
        """POST the step the trainer runs and its micro-batch, with the device's figures when
        it has an accelerator (``report()`` keyword names plus ``reserved_peak_bytes``): what
        the sidecar grows the micro-batch back on (:mod:`memguard_client.peaks` sends it in the
        background). Never raises; True when accepted."""
        body: Dict[str, Any] = {}
        items = dict(figures or {})
        items.update(step=step, batch_size=batch_size)
        for name in (
            "allocated_bytes",
            "reserved_bytes",
            "peak_bytes",
            "reserved_peak_bytes",
            "total_bytes",
            "step",
            "batch_size",
        ):
            n = _env.non_negative_int(items.get(name))
            if n is not None:
                body[name] = n
        framework = items.get("framework")
        if isinstance(framework, str) and framework:
            body["framework"] = framework[:64]
        if "step" in body:
            self._last_step = body["step"]
        return self._post_report(body)

    def report_config(self, config: Mapping[str, float]) -> bool:
        """POST the config the trainer runs at (knob → number, a bool as 0 or 1) to
        ``/v1/report`` as ``config``: the sidecar exports it beside what admission planned.
        Never raises; True when accepted."""
        global _config_reported
        body = {"config": {str(k): float(v) for k, v in config.items()}}
        accepted = self._post_report(body)
        _config_reported = _config_reported or accepted
        return accepted

    def plan_at_train_start(
        self, config: Mapping[str, float], timeout: Optional[float] = None
    ) -> Optional[Dict[str, Any]]:
        """POST the config the trainer runs at and wait, at most ``timeout`` seconds
        (default ``MEMGUARD_TRAIN_START_WAIT``, else :data:`TRAIN_START_WAIT`), for the
        sidecar's train-start decision; the signal that comes with it is applied at once, so
        the first step runs the plan. Returns the decision (``planned``, ``reason``,
        ``batch_size``, …), or ``None`` when none came in time (logged; the trainer goes on
        unplanned and follows the signal as usual). Never raises."""
        if self._url is None:
            return None
        global _config_reported
        wait = self._train_start_wait if timeout is None else max(0.0, float(timeout))
        body: Dict[str, Any] = {"config": {str(k): float(v) for k, v in config.items()}}
        req = urllib.request.Request(
            f"{self._url}/v1/report",
            data=json.dumps(body).encode("utf-8"),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=wait) as resp:
                status = int(resp.status)
                _config_reported = True  # accepted, whatever the decision
                data = resp.read(MAX_SIGNAL_BYTES + 1)
        except urllib.error.HTTPError as err:
            log.warning("memguard: the sidecar refused the train-start config: %s", err)
            return None
        except Exception as err:
            log.warning(
                "memguard: no train-start plan within %.1fs (%s); going on unplanned", wait, err
            )
            return None
        if status != 200 or len(data) > MAX_SIGNAL_BYTES:
            log.warning(
                "memguard: no train-start plan within %.1fs (HTTP %d); going on unplanned",
                time.monotonic() - started,
                status,
            )
            return None
        try:
            reply = json.loads(data.decode("utf-8"))
            decision = reply["train_start"]
            sig = parse_signal(json.dumps(reply["signal"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            log.warning("memguard: the sidecar's train-start reply is not one; going on unplanned")
            return None
        if not isinstance(decision, dict):
            return None
        if sig is not None:
            self._offer(sig)
            self.refresh()
        log.info("memguard: %s", decision.get("reason", ""))
        return decision

    def report_phase(self, phase: str, **counters: int) -> bool:
        """Enter ``phase`` (one of :data:`memguard_client.phase.PHASES`) and POST it at once,
        with the last step and any ``counters`` given (``saves_deferred``); every later report
        carries it too, so the sidecar knows the phase an OOM kill comes in. Raises
        ``ValueError`` for an unknown phase; otherwise never raises; True when accepted."""
        from .phase import PHASES

        if phase not in PHASES:
            raise ValueError(f"memguard: unknown phase {phase!r} (known: {', '.join(PHASES)})")
        self._phase = phase
        body: Dict[str, Any] = {}
        if self._last_step is not None:
            body["step"] = self._last_step
        for name, value in counters.items():
            n = _env.non_negative_int(value)
            if n is not None:
                body[name] = n
        return self._post_report(body)

    def report_oom(self, record: Mapping[str, Any]) -> bool:
        """POST an OOM record (:func:`memguard_client.oom.build_record`) to ``/v1/report``.

        The sidecar counts it and applies a sticky downgrade. Never raises; True when accepted.
        """
        body: Dict[str, Any] = {"oom": dict(record)}
        for name in ("step", "batch_size"):
            if name in record:
                body[name] = record[name]
        return self._post_report(body)

    def report_framework(self, step: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """Report the figures of the framework in use (torch.cuda, MLX, mxnet).

        Returns the body sent (or that would have been sent with no sidecar), or ``None`` when
        no framework had figures.
        """
        return self.report_figures(framework_memory(), step)

    def report_figures(
        self, figures: Optional[Mapping[str, Any]], step: Optional[int] = None
    ) -> Optional[Dict[str, Any]]:
        """Report framework figures (``report()`` keyword names) with the step and the current
        batch size; returns the body, or ``None`` when there were no figures."""
        if figures is None:
            return None
        body: Dict[str, Any] = dict(figures)
        if step is not None:
            body["step"] = step
        body.setdefault("batch_size", self.batch_size)
        self.report(**body)
        return body

    def _post_report(self, body: Dict[str, Any]) -> bool:
        if self._url is None:
            return False
        if self._phase is not None and self._send_phase:
            ok = self._post_report_as_is(dict(body, phase=self._phase))
            if ok is not False:
                return ok is True
            # Refused: if it goes through without the phase, the sidecar is older than the
            # field (it refuses every report that has it), and none is sent from now on.
            bare = {k: v for k, v in body.items() if k != "saves_deferred"}
            accepted = self._post_report_as_is(bare) is True
            if accepted:
                self._send_phase = False
            return accepted
        return self._post_report_as_is(body) is True

    def _post_report_as_is(self, body: Dict[str, Any]) -> Optional[bool]:
        """True when accepted, False when refused (400), None when not accepted otherwise."""
        memory = self._own_cgroup.due()
        status = None
        if memory is not None:
            status = self._send_report(dict(body, container_memory=memory))
        if memory is None or status == 400:
            refused_with_memory = status == 400
            status = self._send_report(body)
            if refused_with_memory and status is not None and 200 <= status < 300:
                # A sidecar older than `container_memory` refuses the whole report: the
                # figures are sent again without it, and from now on (only when the report
                # goes through without them: another field may be the one refused).
                self._own_cgroup.stop()
        if status == 400:
            return False
        return True if status is not None and 200 <= status < 300 else None

    def _send_report(self, body: Dict[str, Any]) -> Optional[int]:
        """POSTs ``body``: the HTTP status, None when no answer came."""
        req = urllib.request.Request(
            f"{self._url}/v1/report",
            data=json.dumps(body).encode("utf-8"),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self._report_timeout) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            log.debug("memguard report refused: %s", err)
            return int(err.code)
        except Exception as err:
            log.debug("memguard report failed: %s", err)
            return None


class _PollError(Exception):
    pass
