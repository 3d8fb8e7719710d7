"""Rank agreement: every rank of a job applies the same micro-batch size at the same step.

In a multi-pod job each pod has its own sidecar reading its own memory, so ranks see different
signals. If rank 0 ran 4 micro-batches per batch while rank 1 ran 1, the collectives of FSDP or
ZeRO would stop pairing up (a hang, or a silent mix of unrelated tensors). So at each step
boundary the adapters (:class:`memguard_client.torch.MicroBatcher`, :func:`memguard_client.hf.attach`)
agree through ``torch.distributed`` when it is initialised with more than one rank:

* the **smallest** micro-batch size wins (the rank closest to its limit decides);
* **any** rank's gradient checkpointing wins;
* **any** rank's "sync gradients at every micro-batch" wins (FSDP, see
  :mod:`memguard_client.recovery`).

All three ride in one ``all_reduce(MIN)`` of a 3-element int64 tensor per step (the cost is measured
by ``bench/distributed/agree_bench.py`` and recorded in docs/python-client.md). During in-process
OOM recovery the same kind of collective tells every rank whether any rank ran out of memory in
the micro-batch just run (:meth:`Agreement.status`), so all ranks halve together.

Pipelined (the default; ``MEMGUARD_AGREEMENT=blocking`` or ``Agreement(pipelined=False)`` for
the blocking one): the step's collective is started at one step boundary and completed at the
next, so it runs while the step computes; what the ranks proposed at boundary ``k`` is applied by
every rank at boundary ``k + 1`` (the first boundary exchanges at once). Still exact: every rank
applies the same values at the same step, one step later than the blocking agreement. The
collective runs in a daemon thread on a gloo group of its own (created by every rank at the first
boundary), so the training loop pays two queue operations per step, and the group's collectives
keep their own order whatever the trainer's collectives do meanwhile. The OOM-recovery
:meth:`Agreement.status` stays blocking on the default group (it decides the micro-batch being
run).

Exit. A gloo collective outlives the call that waited for it: the process group's worker thread
destroys the finished work (and drops its reference to the tensor) a moment later, and because
the tensor was made in Python, dropping that reference takes the GIL. If the interpreter is
finalizing by then, taking the GIL ends the worker thread with ``pthread_exit``, the unwinding
meets a ``noexcept`` frame of ``ProcessGroupGloo::runLoop``, and a run that finished aborts with
"terminate called without an active exception" (SIGABRT; issue 37, item 8, seen in a core dump:
``runLoop`` → ``~AsyncAllreduceWork`` → ``decref_pyobject`` → ``take_gil`` →
``PyThread_exit_thread``). The pipelined agreement makes it likely, as its last boundary leaves
a collective in flight until exit. So :meth:`Agreement.close` completes the collective in flight,
joins the agreement's thread and waits until no work of gloo's still holds one of the
agreement's tensors (each group reuses one tensor, so its use count says so). The HF adapter
calls it at ``on_train_end``, ``MicroBatcher.close()`` does, and an ``atexit`` handler does it
for whatever is still open, before finalization (reproduced, and its fix checked, by
``tests/test_distributed.py::test_a_collective_in_flight_at_exit_is_completed_before_finalization``).
The trainer's own collectives race the same way (a core dump showed the HF Trainer's
all-gather at train end): their tensors are not the client's to wait for, so the last exit
handler waits :data:`EXIT_GRACE_SECONDS`, the GIL released, while several ranks are up.

Without torch, without ``torch.distributed``, or with one rank, nothing is exchanged and the
local values are returned unchanged. Every rank must call the same methods in the same order:
the adapters call them at fixed points of the step, whatever the signal says.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from . import env as _env

#: How long :meth:`Agreement.close` waits for the peers' side of the collective in flight.
CLOSE_TIMEOUT_SECONDS = 60.0


def _dist() -> Optional[Any]:
    """``torch.distributed`` when torch is imported and a process group with >1 rank is up."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size() <= 1:
            return None
    except Exception:
        return None
    return dist


def world_size() -> int:
    """Ranks that take part in the agreement (1 without an initialised process group)."""
    dist = _dist()
    return 1 if dist is None else int(dist.get_world_size())


def rank() -> int:
    """This process's rank (0 without an initialised process group)."""
    dist = _dist()
    return 0 if dist is None else int(dist.get_rank())


@dataclass(frozen=True)
class Status:
    """What the ranks agreed after a micro-batch phase."""

    #: Some rank ran out of memory in this phase.
    oom: bool
    #: The smallest micro-batch size proposed (the halved size of the rank that failed; 0 when
    #: a rank has nothing smaller to try).
    size: int
    #: Every rank's gradients were untouched (all ``None``) when the batch began.
    fresh: bool


class Agreement:
    """The collectives of the agreement, or their one-rank identity.

    Args:
        enabled: ``False`` skips every exchange (each rank keeps its own values: only for a
            job whose ranks train independently).
        pipelined: overlap the per-step collective with the step (see the module doc);
            ``None`` (default) reads ``MEMGUARD_AGREEMENT``: ``blocking`` for the blocking one,
            anything else (unset, ``pipelined``) for the pipelined one.
    """

    def __init__(self, enabled: bool = True, pipelined: Optional[bool] = None) -> None:
        self.enabled = enabled
        if pipelined is None:
            pipelined = os.environ.get(_env.AGREEMENT, "").strip().lower() != _env.BLOCKING
        self.pipelined = pipelined
        #: Number of collectives issued (each one ``all_reduce`` of a few int64).
        self.collectives = 0
        self._pipeline: Optional[_Pipeline] = None
        #: One reused tensor per device for the blocking collectives (see :meth:`close`).
        self._buffers: Dict[str, Any] = {}
        self._retired: List[Any] = []  # the tensors of closed pipelines
        self._at_exit = False

    def world_size(self) -> int:
        """Ranks this agreement spans (1 when disabled or not distributed)."""
        return world_size() if self.enabled else 1

    def step(self, batch_size: int, checkpointing: bool) -> Tuple[int, bool]:
        """Agree on the micro-batch size (min) and gradient checkpointing (any) for a step."""
        size, ckpt, _ = self.step_sync(batch_size, checkpointing, False)
        return size, ckpt

    def step_sync(
        self, batch_size: int, checkpointing: bool, sync_each_batch: bool
    ) -> Tuple[int, bool, bool]:
        """Agree on the micro-batch size (min), gradient checkpointing (any) and syncing
        gradients at every micro-batch (any) for a step: one collective."""
        batch_size = max(1, int(batch_size))
        values = [batch_size, 0 if checkpointing else 1, 0 if sync_each_batch else 1]
        reduced = self._min_pipelined(values) if self.pipelined else self._min(values)
        if reduced is None:
            return batch_size, bool(checkpointing), bool(sync_each_batch)
        return max(1, reduced[0]), reduced[1] == 0, reduced[2] == 0

    def status(self, oom: bool, size: int, fresh: bool) -> Status:
        """Agree after a micro-batch phase: did any rank run out of memory, the smallest
        proposed size, and whether every rank began the batch with untouched gradients."""
        size = max(0, int(size))  # 0: "nothing smaller to try", every rank gives up
        reduced = self._min([0 if oom else 1, size, 1 if fresh else 0])
        if reduced is None:
            return Status(oom=oom, size=size, fresh=fresh)
        return Status(oom=reduced[0] == 0, size=max(0, reduced[1]), fresh=reduced[2] == 1)

    def any(self, flag: bool) -> bool:
        """Whether any rank's ``flag`` is set: one blocking collective, for decisions taken
        at step ends every rank reaches alike (a checkpoint save put off, phase.py)."""
        reduced = self._min([0 if flag else 1])
        return bool(flag) if reduced is None else reduced[0] == 0

    def _min(self, values: List[int]) -> Optional[List[int]]:
        dist = _dist() if self.enabled else None
        if dist is None:
            return None
        import torch  # imported already: _dist() found it in sys.modules

        device = "cpu"
        backend = str(dist.get_backend())
        if backend == "nccl" and torch.cuda.is_available():  # NCCL reduces device tensors only
            device = f"cuda:{torch.cuda.current_device()}"
        if not self._at_exit:
            # Registered after torch's import and init_process_group, so it runs before any exit
            # handler torch registers (atexit is last in, first out): the grace first
            # registered runs last.
            _register_exit_grace()
            atexit.register(self.close)
            self._at_exit = True
        t = _fill(self._buffers, torch, device, values)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        self.collectives += 1
        return [int(v) for v in t.tolist()]

    def _min_pipelined(self, values: List[int]) -> Optional[List[int]]:
        """Take the result of the collective the previous boundary started (its proposals are
        this step's), then start this boundary's. The first boundary exchanges at once."""
        if self._pipeline is None:
            reduced = self._min(values)
            if reduced is None:
                return None
            dist = _dist()
            assert dist is not None
            # Every rank is at its first boundary: creating the group is collective too.
            self._pipeline = _Pipeline(dist, dist.new_group(backend="gloo"))
        else:
            reduced = self._pipeline.result()
        self._pipeline.start(values)
        self.collectives += 1
        return reduced

    def close(self, timeout: float = CLOSE_TIMEOUT_SECONDS) -> bool:
        """End of training: complete the pipelined collective still in flight (its result is
        dropped: no step follows), join the agreement's thread, and wait until gloo's workers
        have let go of the agreement's tensors (module doc, "Exit"). Every rank must call it at
        the same point, as every rank ran the same boundaries; a later :meth:`step_sync` starts
        afresh (first boundary blocking, a new group). Returns False when a peer did not answer
        within ``timeout`` seconds (the thread is then left to the interpreter). Idempotent."""
        deadline = time.monotonic() + timeout
        pipeline, self._pipeline = self._pipeline, None
        ok = pipeline.close(timeout) if pipeline is not None else True
        if pipeline is not None:
            # Kept, not dropped: a tensor gloo still held (a timeout) is settled again at exit.
            self._retired.extend(pipeline.buffers())
        return _settle(list(self._buffers.values()) + self._retired, deadline) and ok


#: At exit, how long the interpreter waits, the GIL released, before it finalizes while a
#: process group of several ranks is up: gloo's worker threads then destroy the works of the
#: trainer's own last collectives (the HF Trainer's all-gathers at train end, whose tensors the
#: client never holds) while Python can still take their references (module doc, "Exit").
EXIT_GRACE_SECONDS = 0.25

_exit_grace_registered = False


def _exit_grace() -> None:
    dist = _dist()
    try:
        if dist is not None and dist.is_initialized() and dist.get_world_size() > 1:
            time.sleep(EXIT_GRACE_SECONDS)
    except Exception:  # a torch that cannot say: nothing to wait for
        pass


def _register_exit_grace() -> None:
    global _exit_grace_registered
    if not _exit_grace_registered:
        atexit.register(_exit_grace)
        _exit_grace_registered = True


class _Pipeline:
    """A daemon thread that runs ``all_reduce(MIN)`` of each request on ``group``, in order."""

    def __init__(self, dist: Any, group: Any) -> None:
        self._dist, self._group = dist, group
        self._requests: "queue.SimpleQueue[Optional[List[int]]]" = queue.SimpleQueue()
        self._results: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        #: Requests started whose result was not taken yet (0 or 1 in the adapters' use).
        self._in_flight = 0
        self._buffers: Dict[str, Any] = {}  # the thread's reused tensor
        # Daemon, so that a peer that never answers cannot hang the exit; close() is what
        # keeps it from being inside a collective when the interpreter finalizes.
        self._thread = threading.Thread(target=self._run, name="memguard-agreement", daemon=True)
        self._thread.start()

    def start(self, values: List[int]) -> None:
        self._in_flight += 1
        self._requests.put(values)

    def result(self) -> List[int]:
        out = self._results.get()
        self._in_flight -= 1
        if isinstance(out, BaseException):
            raise out
        return list(out)

    def close(self, timeout: float) -> bool:
        """Wait for the results in flight, then stop and join the thread."""
        deadline = time.monotonic() + timeout
        while self._in_flight > 0:
            try:
                self._results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False  # a peer is gone or stuck: joining would hang
            self._in_flight -= 1
        self._requests.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def buffers(self) -> List[Any]:
        return list(self._buffers.values())

    def _run(self) -> None:
        import torch

        while True:
            values = self._requests.get()
            if values is None:
                return
            try:
                t = _fill(self._buffers, torch, "cpu", values)
                self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
                self._results.put([int(v) for v in t.tolist()])
            except BaseException as exc:  # noqa: BLE001 - handed to the training loop
                self._results.put(exc)


def _fill(buffers: Dict[str, Any], torch: Any, device: str, values: List[int]) -> Any:
    """``values`` in the int64 tensor reused for ``device``. Reused, not made anew: a tensor made
    in Python and dropped while a gloo worker still holds it is freed by that worker, which then
    needs the GIL (module doc, "Exit"); one tensor kept alive here is one use count to watch."""
    t = buffers.get(device)
    if t is None or t.numel() != len(values):
        t = torch.zeros(len(values), dtype=torch.int64, device=device)
        buffers[device] = t  # lengths never change in practice (3), so nothing is dropped
    t.copy_(torch.tensor(values, dtype=torch.int64))
    return t


def _settle(tensors: List[Any], deadline: float) -> bool:
    """Wait until nothing but this module holds ``tensors``: the gloo workers have destroyed the
    works that used them. Sleeping releases the GIL, which those workers need to do so."""
    for t in tensors:
        use_count = getattr(t, "_use_count", None)
        if use_count is None:  # a torch without it: give the workers a moment
            time.sleep(0.05)
            return True
        while use_count() > 1:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
    return True
