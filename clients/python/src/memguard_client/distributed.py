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

Without torch, without ``torch.distributed``, or with one rank, nothing is exchanged and the
local values are returned unchanged. Every rank must call the same methods in the same order:
the adapters call them at fixed points of the step, whatever the signal says.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple


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
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        #: Number of collectives issued (each one ``all_reduce`` of a few int64).
        self.collectives = 0

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
        reduced = self._min([batch_size, 0 if checkpointing else 1, 0 if sync_each_batch else 1])
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

    def _min(self, values: "list[int]") -> Optional["list[int]"]:
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
