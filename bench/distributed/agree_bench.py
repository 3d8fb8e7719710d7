#!/usr/bin/env python3
"""Per-step cost of the rank agreement (memguard_client.distributed), measured on real ranks.

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/distributed/agree_bench.py

Times the blocking ``Agreement.step`` (the one collective per step boundary) and ``Agreement.status`` (the
OOM-recovery check after a micro-batch phase) over gloo on CPU, after a warm-up, and prints the
median and 90th percentile in µs from rank 0. Record the numbers in docs/python-client.md.

Then, in the same run, the cost a training loop sees per step, blocking
(``Agreement(pipelined=False)``, ``MEMGUARD_AGREEMENT=blocking``) against pipelined (the default:
started at one boundary, completed at the next): between two
boundaries each rank computes a "step" (single-threaded matrix products, ~``STEP_MS``) and
all-reduces a gradient of ``GRAD_FLOATS`` floats, as DDP does at the end of each step (which also
keeps the ranks in step, as in training); only the time spent inside ``Agreement.step`` is
counted. Record these in docs/performance.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "src"))
from memguard_client.distributed import Agreement  # noqa: E402

N, WARMUP = 2000, 200
#: Boundaries timed per mode with a step of compute between them, and that step's target length.
STEPS, STEP_MS = 600, 5.0
GRAD_FLOATS = 1 << 16


def timed(fn) -> "list[float]":  # type: ignore[no-untyped-def]
    for _ in range(WARMUP):
        fn()
    out = []
    for _ in range(N):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def compute_step(a: torch.Tensor, reps: int, grad: "torch.Tensor | None" = None) -> None:
    for _ in range(reps):
        torch.mm(a, a)
    if grad is not None:
        dist.all_reduce(grad)  # DDP's gradient all-reduce closes every step


def calibrate(a: torch.Tensor) -> int:
    t0 = time.perf_counter()
    compute_step(a, 20)
    per = (time.perf_counter() - t0) / 20
    return max(1, int(STEP_MS / 1000 / per))


def visible(agree: Agreement, rank: int, a: torch.Tensor, reps: int) -> "list[float]":
    """Time inside ``agree.step`` at each boundary, a step of compute between boundaries."""
    out = []
    grad = torch.zeros(GRAD_FLOATS)
    for i in range(WARMUP // 4 + STEPS):
        compute_step(a, reps, grad)
        t0 = time.perf_counter_ns()
        agree.step(8 - rank if i % 7 else 4, rank == 1)
        if i >= WARMUP // 4:
            out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agree = Agreement(pipelined=False)  # the collective itself (pipelined is the default)
    step = timed(lambda: agree.step(8 - rank, rank == 1))
    status = timed(lambda: agree.status(False, 8, True))
    a = torch.randn(192, 192)
    reps = torch.tensor([calibrate(a)])
    dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # the same step length on both ranks
    per_step = {
        "blocking": visible(Agreement(pipelined=False), rank, a, int(reps)),
        "pipelined": visible(Agreement(pipelined=True), rank, a, int(reps)),
    }
    if rank == 0:
        for mode, xs in per_step.items():
            xs.sort()
            print(f"per-step visible cost, {mode}: median {statistics.median(xs):.1f} us, "
                  f"p90 {xs[int(len(xs) * 0.9)]:.1f} us ({STEPS} steps of ~{STEP_MS:.0f} ms compute)")
        for name, xs in (("step", step), ("status", status)):
            xs.sort()
            print(f"agreement.{name}: world {dist.get_world_size()} backend gloo: "
                  f"median {statistics.median(xs):.1f} us, p90 {xs[int(len(xs) * 0.9)]:.1f} us "
                  f"({N} calls)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
