#!/usr/bin/env python3
"""Per-step cost of the rank agreement (memguard_client.distributed), measured on real ranks.

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/distributed/agree_bench.py

Times ``Agreement.step`` (the one collective per step boundary) and ``Agreement.status`` (the
OOM-recovery check after a micro-batch phase) over gloo on CPU, after a warm-up, and prints the
median and 90th percentile in µs from rank 0. Record the numbers in docs/python-client.md.
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


def timed(fn) -> "list[float]":  # type: ignore[no-untyped-def]
    for _ in range(WARMUP):
        fn()
    out = []
    for _ in range(N):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agree = Agreement()
    step = timed(lambda: agree.step(8 - rank, rank == 1))
    status = timed(lambda: agree.status(False, 8, True))
    if rank == 0:
        for name, xs in (("step", step), ("status", status)):
            xs.sort()
            print(f"agreement.{name}: world {dist.get_world_size()} backend gloo: "
                  f"median {statistics.median(xs):.1f} us, p90 {xs[int(len(xs) * 0.9)]:.1f} us "
                  f"({N} calls)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
