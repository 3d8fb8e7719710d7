#!/usr/bin/env python3
"""What returning freed buffers to the kernel costs an MLX CPU trainer (memguard_client.allocator).

    python bench/mlx/freed_memory_bench.py [--rounds 3] [--steps 20]

Runs the survival trainer's model (bench/survival/trainer_mlx.py: 32 rows of length 1500,
hidden 256, micro-batches of 16, one SGD update per batch) in fresh processes, alternating
``MicroBatcher(return_freed_memory=True)`` and ``False`` (both with MLX's limits from a 160 MiB
budget), and prints per step: the process's CPU time (user + system, less sensitive to other
load than wall time), wall time, and the peak resident memory of the run. Record the numbers in
docs/python-client.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, resource, sys, time
sys.path[:0] = [sys.argv[3], sys.argv[4]]
import mlx.core as mx, mlx.optimizers as optim
from memguard_client import Guard
from memguard_client.mlx import MicroBatcher
from trainer_mlx import Pooled, loss_fn

steps, returned = int(sys.argv[1]), sys.argv[2] == "1"
batcher = MicroBatcher(Guard(signal_file="", sidecar_url="", env={"MEMGUARD_BATCH_SIZE": "16"}),
                       env={"MEMGUARD_BUDGET_BYTES": str(160 << 20)}, return_freed_memory=returned)
model, opt = Pooled(8, 256, 0), optim.SGD(learning_rate=0.05)
mx.random.seed(0)
x, y = mx.random.normal((32, 1500, 8)), mx.random.normal((32,))
lens = mx.full((32,), 1500)
mx.eval(model.parameters(), x, y, lens)
cpu, wall = [], []
for step in range(steps + 2):  # two warm-up steps
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    loss, grads = batcher.value_and_grad(model, loss_fn, (x, y, lens))
    opt.update(model, grads)
    mx.eval(model.parameters(), opt.state, loss)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if step >= 2:
        cpu.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
        wall.append(t1 - t0)
print(json.dumps({"returned": batcher.freed_memory_returned, "cpu": cpu, "wall": wall,
                  "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    paths = [str(REPO / "clients" / "python" / "src"), str(REPO / "bench" / "survival")]
    runs: "dict[bool, list[dict]]" = {True: [], False: []}
    for _ in range(a.rounds):
        for returned in (True, False):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(a.steps), str(int(returned)), *paths],
                env=env, capture_output=True, text=True, check=True,
            )
            runs[returned].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for returned in (True, False):
        rs = runs[returned]
        cpu = [c for r in rs for c in r["cpu"]]
        wall = [w for r in rs for w in r["wall"]]
        print(
            f"return_freed_memory={returned!s:<5} (took: {rs[0]['returned']}): per step CPU median "
            f"{statistics.median(cpu) * 1000:.0f} ms, wall median {statistics.median(wall) * 1000:.0f} ms; "
            f"peak RSS {statistics.median(r['maxrss_mib'] for r in rs):.0f} MiB "
            f"({a.rounds} processes x {a.steps} steps)"
        )


if __name__ == "__main__":
    main()
