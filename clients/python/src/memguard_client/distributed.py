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

Pipelined (``Agreement(pipelined=True)``, or ``MEMGUARD_AGREEMENT=pipelined`` in the env): the
step's collective is started at one step boundary and completed at the next, so it runs while
the step computes; what the ranks proposed at boundary ``k`` is applied by every rank at boundary
``k + 1`` (the first boundary exchanges at once). Still exact: every rank applies the same values
at the same step, one step later than the blocking default. The collective runs in a daemon
thread on a gloo group of its own (created by every rank at the first boundary), so the training
loop pays two queue operations per step, and the group's collectives keep their own order
whatever the trainer's collectives do meanwhile. The OOM-recovery :meth:`Agreement.status` stays
blocking on the default group (it decides the micro-batch being run).

Without torch, without ``torch.distributed``, or with one rank, nothing is exchanged and the
local values are returned unchanged. Every rank must call the same methods in the same order:
the adapters call them at fixed points of the step, whatever the signal says.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from . import env as _env


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
            ``None`` (default) reads ``MEMGUARD_AGREEMENT`` (``pipelined`` or ``blocking``).
    """

    def __init__(self, enabled: bool = True, pipelined: Optional[bool] = None) -> None:
        self.enabled = enabled
        if pipelined is None:
            pipelined = os.environ.get(_env.AGREEMENT, "").strip().lower() == _env.PIPELINED
        self.pipelined = pipelined
        #: Number of collectives issued (each one ``all_reduce`` of a few int64).
        self.collectives = 0
        self._pipeline: Optional[_Pipeline] = None

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

    def _min(self, values: List[int]) -> Optional[List[int]]:
        dist = _dist() if self.enabled else None
        if dist is None:
            return None
        import torch  # imported already: _dist() found it in sys.modules

        device = "cpu"
        backend = str(dist.get_backend())
        if backend == "nccl" and torch.cuda.is_available():  # NCCL reduces device tensors only
            device = f"cuda:{torch.cuda.current_device()}"
        t = torch.tensor(values, dtype=torch.int64, device=device)
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


class _Pipeline:
    """A daemon thread that runs ``all_reduce(MIN)`` of each request on ``group``, in order."""

    def __init__(self, dist: Any, group: Any) -> None:
        self._dist, self._group = dist, group
        self._requests: "queue.SimpleQueue[List[int]]" = queue.SimpleQueue()
        self._results: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        threading.Thread(target=self._run, name="memguard-agreement", daemon=True).start()

    def start(self, values: List[int]) -> None:
        self._requests.put(values)

    def result(self) -> List[int]:
        out = self._results.get()
        if isinstance(out, BaseException):
            raise out
        return list(out)

    def _run(self) -> None:
        import torch

        while True:
            values = self._requests.get()
            try:
                t = torch.tensor(values, dtype=torch.int64)
                self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
                self._results.put([int(v) for v in t.tolist()])
            except BaseException as exc:  # noqa: BLE001 - handed to the training loop
                self._results.put(exc)
