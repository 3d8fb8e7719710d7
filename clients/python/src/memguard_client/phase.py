"""The trainer's phase, and checkpoint saves put off under host-memory pressure (issue 39, item 3).

Phases (sent with every report, ``memguard_api::phase::TrainerPhase``): ``load`` from
:func:`memguard_client.hf.attach` until training begins, ``step`` while training, ``save`` from
the step end at which the Trainer decided to save until the checkpoint is written, then
``step`` again. The sidecar keeps the last one, and records an OOM kill with it, so the next
admission knows whether the host memory ran out loading, stepping or saving.

Why defer a save rather than halve the micro-batch: a GPU job's host memory peaks when it writes
a checkpoint (the state dict gathered on the host, the serializer's buffers), and a smaller
micro-batch frees device memory, not that. When a save is due while the signal is at ``warn`` or
above, the save waits for the level to fall back to ``ok``, at most
:data:`MAX_SAVE_DEFERRAL_STEPS` steps, and never past the last step.

Every rank decides alike: whether any rank is under pressure is agreed in one collective
(:meth:`memguard_client.distributed.Agreement.any`) at the step ends where a save is due or
pending; those step ends are the same on every rank (the Trainer decides saves from the global
step, and the pending state follows only agreed decisions), so the collective pairs up.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

log = logging.getLogger("memguard_client")

#: The phases, in run order.
PHASES: Tuple[str, ...] = ("load", "step", "save")

#: Most steps a due checkpoint save is put off under pressure: past it the save happens anyway
#: (losing the progress of a long deferral costs more than the pressure risks).
MAX_SAVE_DEFERRAL_STEPS = 50

#: Signal levels at which a due save is put off.
PRESSURE_LEVELS = frozenset({"warn", "downgrade", "critical"})


class SaveDeferral:
    """Whether a due save happens now or waits. Pure: the caller agrees ``pressure`` across
    ranks first.

    Attributes:
        deferred: saves put off so far (each due save counts once, however long it waits).
    """

    def __init__(self, max_steps: int = MAX_SAVE_DEFERRAL_STEPS) -> None:
        self.max_steps = max(0, int(max_steps))
        self.deferred = 0
        self._since: Optional[int] = None

    @property
    def pending(self) -> bool:
        """A save was due and put off, and has not happened yet."""
        return self._since is not None

    def save_now(self, step: int, pressure: bool, last: bool) -> bool:
        """At the end of ``step``, with a save due (by the Trainer or pending): True to save
        now. ``last``: training stops after this step."""
        if not pressure or last:
            self._since = None
            return True
        if self._since is None:
            self._since = step
            self.deferred += 1
            log.warning(
                "memguard: checkpoint save due at step %d put off: host memory under pressure "
                "(saved once the signal is back to ok, within %d steps)",
                step,
                self.max_steps,
            )
            return False
        if step - self._since >= self.max_steps:
            log.warning(
                "memguard: checkpoint save put off since step %d happens at step %d under "
                "pressure: %d steps is the most it waits",
                self._since,
                step,
                self.max_steps,
            )
            self._since = None
            return True
        return False
