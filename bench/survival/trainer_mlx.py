#!/usr/bin/env python3
"""The survival trainer in MLX: trainer.py's model, data and log, trained through
``memguard_client.mlx.MicroBatcher`` on MLX's CPU backend.

Model: token features x (L × d) → ReLU(x W1 + b1) (L × H) → mean over tokens → · w2 → ŷ, a mean
squared error (½ err²) against trainer.py's linear teacher, plain SGD, float32. Autodiff is
MLX's (``mlx.nn.value_and_grad``); the memory of a micro-batch of b samples of length L is
about ``b · L · H · 4`` bytes per live activation, and on the CPU backend it is ordinary process
memory, inside the cgroup. Sequence length grows with the sample index, so the batch that fits at
the start of an epoch does not fit at its end.

The loop follows the signal before each micro-batch (``batcher.refresh()`` at the step,
``follow=True`` within it, as trainer.py does: one process, so no rank agreement is needed),
runs each batch of ``effective_batch`` samples as micro-batches of ``guard.batch_size`` rows,
makes one SGD update per batch and reports MLX's figures after every
step. Without memguard env it is plain MLX training at a fixed batch. Logs the same JSON lines as
trainer.py (start, signal, apply, step, epoch, done); each step also carries MLX's active, peak
and cache figures and the process's resident memory (``rss``) and its peak during the step
(``rss_peak``, VmHWM reset at the step's start), the figure the cgroup charges.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "src"))
from memguard_client import Guard  # noqa: E402
from memguard_client.mlx import MicroBatcher  # noqa: E402
from trainer import Data, Log, file_mtime, seq_len  # noqa: E402


class Pooled(nn.Module):
    def __init__(self, dim: int, hidden: int, seed: int) -> None:
        super().__init__()
        mx.random.seed(seed + 1)
        self.l1 = nn.Linear(dim, hidden)
        self.l2 = nn.Linear(hidden, 1)

    def __call__(self, x: mx.array, lens: mx.array) -> mx.array:
        mask = (mx.arange(x.shape[1])[None, :] < lens[:, None]).astype(x.dtype)
        h = nn.relu(self.l1(x)) * mask[:, :, None]
        pooled = h.sum(axis=1) / lens[:, None].astype(x.dtype)
        return self.l2(pooled).squeeze(-1)


class Resident:
    """This process's resident memory (anonymous memory plus the mapped libraries), from
    /proc: ``now()`` is VmRSS, ``peak()`` VmHWM since the last ``reset_peak()`` (which writes 5
    to /proc/self/clear_refs). ``None`` where /proc does not have them."""

    def __init__(self) -> None:
        self.can_reset = self.reset_peak()

    @staticmethod
    def _status(key: str) -> Optional[int]:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def reset_peak(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def now(self) -> Optional[int]:
        return self._status("VmRSS")

    def peak(self) -> Optional[int]:
        return self._status("VmHWM") if self.can_reset else None


def loss_fn(model: Pooled, x: mx.array, y: mx.array, lens: mx.array) -> mx.array:
    err = model(x, lens) - y
    return (0.5 * err * err).mean()


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1536)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="starting batch without MEMGUARD_BATCH_SIZE")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default="-", help="JSON-lines log file, '-' for stdout")
    p.add_argument("--weights", help="write final parameters here (.npz)")
    p.add_argument("--no-long-poll", action="store_true", help="follow the signal file only")
    a = p.parse_args(argv)

    out = sys.stdout if a.log == "-" else open(a.log, "a", buffering=1)
    log = Log(out)
    guard = Guard(batch_size=a.batch_size, grad_accumulation=1, background=not a.no_long_poll)
    # Limits from MEMGUARD_BUDGET_BYTES when set; every step reported; the leak check every 20.
    batcher = MicroBatcher(guard, report_every=1, leak_every=20)
    resident = Resident()
    effective = guard.initial.effective_batch
    data = Data(a.samples, a.dim, a.min_len, a.max_len, a.seed)
    model = Pooled(a.dim, a.hidden, a.seed)
    opt = optim.SGD(learning_rate=a.lr)
    mx.eval(model.parameters())
    log(
        "start",
        pid=os.getpid(),
        batch=guard.batch_size,
        accumulation=guard.grad_accumulation,
        effective_batch=effective,
        samples=a.samples,
        epochs=a.epochs,
        memguard=guard.enabled,
        signal_file=guard.signal_file,
        sidecar_url=guard.sidecar_url,
        limits=batcher.limits.__dict__ if batcher.limits else None,
        freed_memory_returned=batcher.freed_memory_returned,
    )

    seen = step = 0
    applied_batch: Optional[int] = None
    for epoch in range(a.epochs):
        epoch_loss = 0.0
        for start in range(0, a.samples, effective):
            idx = range(start, min(a.samples, start + effective))
            rows = len(idx)
            t0 = time.time()
            mx.reset_peak_memory()  # the step's own peaks, logged below
            resident.reset_peak()
            if batcher.refresh():
                sig = guard.signal
                log(
                    "signal",
                    seq=guard.seq,
                    level=guard.level,
                    batch=guard.batch_size,
                    accumulation=guard.grad_accumulation,
                    source=guard.source,
                    seen_at=guard.seen_at,
                    signal_time=sig.timestamp_seconds() if sig else None,
                    file_mtime=file_mtime(guard.signal_file),
                    reason=sig.reason if sig else "",
                )
            b = guard.batch_size
            if b != applied_batch:
                log("apply", step=step, batch=b, seq=guard.seq, level=guard.level)
                applied_batch = b
            x, y, lens = data.batch(idx)
            batch = (mx.array(x, dtype=mx.float32), mx.array(y, dtype=mx.float32), mx.array(lens))
            del x
            loss, grads = batcher.value_and_grad(model, loss_fn, batch, follow=True)
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state, loss)
            del batch, grads
            step_loss = float(loss.item()) * rows
            epoch_loss += step_loss
            seen += rows
            micro = batcher.last_micro
            if guard.batch_size != applied_batch:
                log("apply", step=step, batch=guard.batch_size, seq=guard.seq, level=guard.level)
                applied_batch = guard.batch_size
            batcher.end_step(step)
            log(
                "step",
                step=step,
                epoch=epoch,
                rows=rows,
                micro=micro,
                batch=guard.batch_size,
                accumulation=guard.grad_accumulation,
                seq_len=seq_len(idx[-1], a.samples, a.min_len, a.max_len),
                samples=seen,
                loss=step_loss / rows,
                t_start=t0,
                seconds=time.time() - t0,
                active=mx.get_active_memory(),
                peak=mx.get_peak_memory(),
                cache=mx.get_cache_memory(),
                rss=resident.now(),
                rss_peak=resident.peak(),
            )
            step += 1
        log("epoch", epoch=epoch, loss=epoch_loss / a.samples)
    if a.weights:
        np.savez(
            a.weights,
            w1=np.array(model.l1.weight),
            b1=np.array(model.l1.bias),
            w2=np.array(model.l2.weight),
            b2=np.array(model.l2.bias),
        )
    log(
        "done",
        steps=step,
        samples=seen,
        batch=guard.batch_size,
        accumulation=guard.grad_accumulation,
        effective_batch_start=effective,
        effective_batch_end=guard.batch_size * guard.grad_accumulation,
        reports_ok=batcher.reports_accepted,
        reports_total=batcher.reports_sent if guard.sidecar_url else 0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
