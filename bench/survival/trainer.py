#!/usr/bin/env python3
"""A real (small) training loop whose memory per step grows with batch × sequence length.

Model: token features x (L × d) → ReLU(x W1 + b1) (L × H) → mean over tokens → · w2 → ŷ, trained
with SGD on a mean squared error against a linear teacher. Everything is float64 numpy, forward
and backward written out, so the memory of a micro-batch of b samples of length L is about
``b · L · (d + 3H) · 8`` bytes (input, pre-activation, activation, its gradient), allocated at
each micro-batch and returned to the kernel afterwards (numpy's large arrays are mmap-backed).

Sequence length grows with the sample index (a length curriculum), so the batch size that fits
at the start of an epoch does not fit at its end. Each optimizer step consumes exactly
``effective_batch`` samples (``MEMGUARD_BATCH_SIZE × MEMGUARD_GRAD_ACCUMULATION`` at start) and
runs them as micro-batches of ``guard.batch_size``, refreshing the guard before every
micro-batch. Micro-batch i's gradient is weighted ``rows_i / rows`` so each step's update is the
full-batch gradient: the run is the same computation at any micro-batch size.

Without memguard env the Guard is a no-op and the batch stays fixed. Logs JSON lines to
``--log`` (events: start, signal, apply, step, done).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, TextIO

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "src"))
from memguard_client import Guard  # noqa: E402


def seq_len(i: int, n: int, min_len: int, max_len: int) -> int:
    """Length of sample i: grows linearly from min_len to max_len over the dataset."""
    return min_len + (max_len - min_len) * i // max(1, n - 1)


class Data:
    """Deterministic synthetic samples: x_i ~ N(0, 1) of shape (L_i, d), y_i = mean(x_i) · u + ε."""

    def __init__(self, n: int, dim: int, min_len: int, max_len: int, seed: int) -> None:
        self.n, self.dim, self.min_len, self.max_len, self.seed = n, dim, min_len, max_len, seed
        self.teacher = np.random.default_rng(seed).normal(size=dim)

    def batch(self, idx: range) -> "tuple[np.ndarray, np.ndarray, np.ndarray]":
        lens = np.array([seq_len(i, self.n, self.min_len, self.max_len) for i in idx])
        x = np.zeros((len(idx), int(lens.max()), self.dim))
        y = np.empty(len(idx))
        for r, i in enumerate(idx):
            xi = np.random.default_rng((self.seed, i)).standard_normal((lens[r], self.dim))
            x[r, : lens[r]] = xi
            y[r] = xi.mean(axis=0) @ self.teacher * 4.0
        return x, y, lens


class Model:
    def __init__(self, dim: int, hidden: int, seed: int) -> None:
        rng = np.random.default_rng(seed + 1)
        self.w1 = rng.normal(scale=1 / np.sqrt(dim), size=(dim, hidden))
        self.b1 = np.zeros(hidden)
        self.w2 = rng.normal(scale=1 / np.sqrt(hidden), size=hidden)
        self.b2 = 0.0

    def params(self) -> Dict[str, Any]:
        return {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": np.array(self.b2)}

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray, lens: np.ndarray, weight: float):
        """Per-sample losses (½ err²) and the gradients of ``weight · Σ losses``."""
        b, L, d = x.shape
        mask = (np.arange(L)[None, :] < lens[:, None]).astype(x.dtype)  # (b, L)
        z = x.reshape(b * L, d) @ self.w1 + self.b1  # (bL, H)
        h = np.maximum(z, 0.0)
        h3 = h.reshape(b, L, -1)
        pooled = (mask[:, None, :] @ h3)[:, 0, :] / lens[:, None]  # (b, H)
        del h, h3
        pred = pooled @ self.w2 + self.b2
        err = pred - y
        losses = 0.5 * err * err
        derr = err * weight  # d(weight Σ ½ err²)/d pred
        g_w2 = pooled.T @ derr
        g_b2 = float(derr.sum())
        dpooled = derr[:, None] * self.w2[None, :] / lens[:, None]  # (b, H)
        dz = (mask[:, :, None] * dpooled[:, None, :]).reshape(b * L, -1)  # (bL, H)
        dz *= z > 0
        del z
        g_w1 = x.reshape(b * L, d).T @ dz
        g_b1 = dz.sum(axis=0)
        return losses, (g_w1, g_b1, g_w2, g_b2)

    def sgd(self, grads, lr: float) -> None:
        g_w1, g_b1, g_w2, g_b2 = grads
        self.w1 -= lr * g_w1
        self.b1 -= lr * g_b1
        self.w2 -= lr * g_w2
        self.b2 -= lr * g_b2


class Log:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def __call__(self, event: str, **fields: Any) -> None:
        fields = {"event": event, "t": time.time(), **fields}
        self.out.write(json.dumps(fields) + "\n")
        self.out.flush()


def file_mtime(path: Optional[str]) -> Optional[float]:
    if not path:
        return None
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except OSError:
        return None


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
    p.add_argument(
        "--no-long-poll",
        action="store_true",
        help="follow the signal file only (reports still go to the sidecar URL)",
    )
    a = p.parse_args(argv)

    out = sys.stdout if a.log == "-" else open(a.log, "a", buffering=1)
    log = Log(out)
    guard = Guard(batch_size=a.batch_size, grad_accumulation=1, background=not a.no_long_poll)
    effective = guard.initial.effective_batch
    data = Data(a.samples, a.dim, a.min_len, a.max_len, a.seed)
    model = Model(a.dim, a.hidden, a.seed)
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
    )

    seen = 0
    step = 0
    reports_ok = reports_total = 0
    applied_batch: Optional[int] = None
    for epoch in range(a.epochs):
        epoch_loss = 0.0
        for start in range(0, a.samples, effective):
            idx = range(start, min(a.samples, start + effective))
            rows = len(idx)
            t0 = time.time()
            grads = None
            step_loss = 0.0
            micro_sizes = []
            pos = 0
            while pos < rows:
                if guard.refresh():
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
                chunk = idx[pos : pos + b]
                if b != applied_batch:
                    log("apply", step=step, batch=b, seq=guard.seq, level=guard.level)
                    applied_batch = b
                x, y, lens = data.batch(chunk)
                losses, g = model.loss_and_grads(x, y, lens, 1.0 / rows)
                del x
                grads = g if grads is None else tuple(ga + gb for ga, gb in zip(grads, g))
                step_loss += float(losses.sum())
                seen += len(chunk)
                micro_sizes.append(len(chunk))
                pos += len(chunk)
            model.sgd(grads, a.lr)
            epoch_loss += step_loss
            if guard.sidecar_url:
                # A GPU trainer would add guard.report_framework(); numpy has no allocator
                # figures the sidecar could use (it counts reported bytes as GPU memory).
                reports_total += 1
                reports_ok += guard.report(step=step, batch_size=max(micro_sizes), framework="numpy")
            log(
                "step",
                step=step,
                epoch=epoch,
                rows=rows,
                micro=micro_sizes,
                batch=guard.batch_size,
                accumulation=guard.grad_accumulation,
                seq_len=seq_len(idx[-1], a.samples, a.min_len, a.max_len),
                samples=seen,
                loss=step_loss / rows,
                t_start=t0,
                seconds=time.time() - t0,
            )
            step += 1
        log("epoch", epoch=epoch, loss=epoch_loss / a.samples)
    if a.weights:
        np.savez(a.weights, **model.params())
    log(
        "done",
        steps=step,
        samples=seen,
        batch=guard.batch_size,
        accumulation=guard.grad_accumulation,
        effective_batch_start=effective,
        effective_batch_end=guard.batch_size * guard.grad_accumulation,
        reports_ok=reports_ok,
        reports_total=reports_total,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
