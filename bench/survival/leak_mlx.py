#!/usr/bin/env python3
"""An MLX training loop that leaks (or not), for the leak path end to end (test_leak_mlx.py).

A small MLP trained with Adam through ``memguard_client.mlx.MicroBatcher`` (leak check and
report every step, window of 5 checks). With ``--leak-mib`` it keeps an evaluated array of that
size every step, as a loop that appends its outputs to a list would. It imports MLX and builds
the model first, prints ``ready``, and starts training (and reads the memguard env) only once a
line arrives on stdin, so the harness can start the sidecar with the trainer already warm.

Logs JSON lines: ``start``, ``signal`` (a newer signal: seq, level, batch, reason), ``step``
(MLX active memory, the report's ``leak_bytes_per_second`` when it carried one, whether the
sidecar accepted it), ``downgraded`` (the first step at a smaller batch; the loop stops there),
``done``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "src"))
from memguard_client import Guard  # noqa: E402
from memguard_client.mlx import MicroBatcher  # noqa: E402


def loss_fn(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.mse_loss(model(x).squeeze(-1), y, reduction="mean")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--leak-mib", type=float, default=0.0, help="MiB kept alive every step")
    p.add_argument("--steps", type=int, default=40, help="most steps to run")
    p.add_argument("--step-pause", type=float, default=0.1,
                   help="seconds between steps (a data loader's wait): the sidecar, which acts "
                   "every 100 ms, has steps left to deliver its signal to on any machine")
    p.add_argument("--log", required=True)
    a = p.parse_args(argv)
    out = open(a.log, "a", buffering=1)

    def log(event: str, **fields: Any) -> None:
        out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")

    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = optim.Adam(learning_rate=1e-3)
    x, y = mx.random.normal((32, 16)), mx.random.normal((32,))
    mx.eval(model.parameters(), x, y)
    print("ready", flush=True)
    sys.stdin.readline()

    guard = Guard(background=False)  # MEMGUARD_SIGNAL_FILE, MEMGUARD_SIDECAR_URL, MEMGUARD_BATCH_SIZE
    batcher = MicroBatcher(guard, report_every=1, leak_every=1, leak_window=5)
    initial = guard.batch_size
    log("start", batch=initial, signal_file=guard.signal_file, sidecar_url=guard.sidecar_url)
    held: List[mx.array] = []
    n = int(a.leak_mib * (1 << 20)) // 4
    for step in range(a.steps):
        if batcher.refresh():
            sig = guard.signal
            log("signal", seq=guard.seq, level=guard.level, batch=guard.batch_size,
                reason=sig.reason if sig else "")
        if guard.batch_size < initial:
            log("downgraded", step=step, batch=guard.batch_size)
            break
        loss, grads = batcher.value_and_grad(model, loss_fn, (x, y))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if n:
            held.append(mx.full((n,), 1.0))  # written, so resident
            mx.eval(held[-1])
        accepted = batcher.reports_accepted
        body = batcher.end_step(step) or {}
        log("step", step=step, active=mx.get_active_memory(),
            leak_bytes_per_second=body.get("leak_bytes_per_second"),
            report_accepted=batcher.reports_accepted > accepted)
        time.sleep(a.step_pause)
    log("done", held_mib=len(held) * n * 4 / (1 << 20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
