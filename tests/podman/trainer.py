#!/usr/bin/env python3
"""The trainer of the podman pod tests: the standard library and memguard's client only.

Each step holds ``batch × PER_SAMPLE_MIB`` MiB (touched, so it is resident) for
``grad_accumulation`` micro-batches, as a training step holds its activations; the batch is
the guard's (the webhook's env, else the sidecar's signal file, which carries the sticky
downgrade after an OOM kill). Two shapes:

- ``SHAPE=spike``: the first step allocates it all at once: too fast for any poll; at the
  starting batch it outgrows the limit and is OOM-killed by the kernel.
- ``SHAPE=grow``: the held memory grows by ``GROW_MIB`` every step, so the sidecar sees the
  pressure climb and downgrades before the limit (the survival run).
- ``SHAPE=worker``: each micro-batch runs in a forked worker process, as a data-loader or
  compile worker does; a worker killed by the kernel is survived by the trainer, which reports
  (its client sends its own cgroup's OOM-kill counter), waits for the sidecar's smaller batch
  and runs the step again.

``KILLS=N``: the first N starts (counted in ``LOG``) keep the webhook's starting batch whatever
the signal says, so a spike is OOM-killed N times; later starts follow the guard. Every start, step and the end are JSON lines appended to ``LOG`` (a hostPath file),
with the process's pid in the pod's namespace and its uid/gid.
"""

import json
import os
import sys
import time

from memguard_client import Guard

MIB = 1 << 20


def log(event: str, **fields) -> None:
    line = dict(event=event, pid=os.getpid(), uid=os.getuid(), gid=os.getgid(), t=time.time())
    line.update(fields)
    with open(os.environ["LOG"], "a") as f:
        f.write(json.dumps(line) + "\n")


def main() -> int:
    guard = Guard(background=False)
    if os.environ.get("SHAPE") == "worker":
        return workers(guard)
    try:
        with open(os.environ["LOG"]) as f:
            starts = sum('"event": "start"' in line for line in f)
    except FileNotFoundError:
        starts = 0
    ignore = starts < int(os.environ.get("KILLS", "0"))
    start_batch = int(os.environ["MEMGUARD_BATCH_SIZE"]) if ignore else guard.batch_size
    per_sample = int(os.environ.get("PER_SAMPLE_MIB", "24")) * MIB
    steps = int(os.environ.get("STEPS", "10"))
    grow = int(os.environ.get("GROW_MIB", "0")) * MIB
    pause = float(os.environ.get("STEP_SECONDS", "0.3"))
    shape = os.environ.get("SHAPE", "spike")
    # What a real trainer spends importing torch and loading its model before the first step.
    time.sleep(float(os.environ.get("STARTUP_SECONDS", "1")))
    log("start", batch=start_batch, accumulation=guard.grad_accumulation, seq=guard.seq,
        shape=shape, ignore=ignore, attempt=starts + 1)
    # Chunks, not one growing bytes object: `base += …` would copy it, twice the memory at once.
    held = []
    for step in range(steps):
        guard.refresh()
        batch = start_batch if ignore else guard.batch_size
        accumulation = 1 if ignore else guard.grad_accumulation
        if shape == "grow":
            held.append(b"\x01" * grow)
        for _ in range(accumulation):
            activations = b"\x01" * (batch * per_sample)
            time.sleep(pause / accumulation)
            del activations
        guard.report(step=step, batch_size=batch, allocated_bytes=len(held) * grow + batch * per_sample)
        log("step", step=step, batch=batch, accumulation=accumulation, held_mib=len(held) * grow // MIB)
    log("done", batch=guard.batch_size, accumulation=guard.grad_accumulation)
    return 0


def run_in_worker(nbytes: int, seconds: float) -> bool:
    """Holds ``nbytes`` in a forked worker; False when the worker was killed."""
    pid = os.fork()
    if pid == 0:
        activations = b"\x01" * nbytes
        time.sleep(seconds)
        del activations
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9)


def workers(guard: Guard) -> int:
    per_sample = int(os.environ.get("PER_SAMPLE_MIB", "24")) * MIB
    steps = int(os.environ.get("STEPS", "6"))
    pause = float(os.environ.get("STEP_SECONDS", "0.3"))
    # At train start, as the client's train-start hooks do: the sidecar sees the cgroup's
    # counter before the first step. `REPORT_AT_START=0`: no report before the first kill (one
    # that reached no sidecar), so the first the sidecar gets is the one after it.
    if os.environ.get("REPORT_AT_START", "1") == "1":
        guard.report(step=0, batch_size=guard.batch_size)
    time.sleep(float(os.environ.get("STARTUP_SECONDS", "1")))
    log("start", batch=guard.batch_size, accumulation=guard.grad_accumulation, seq=guard.seq, shape="worker")
    step = 0
    while step < steps:
        guard.refresh()
        batch = guard.batch_size
        if not run_in_worker(batch * per_sample, pause):
            log("worker-killed", step=step, batch=batch)
            guard.report(step=step, batch_size=batch)
            end = time.monotonic() + 20
            while guard.batch_size >= batch and time.monotonic() < end:
                time.sleep(0.1)
                guard.refresh()
            if guard.batch_size >= batch:
                log("failed", why="no smaller batch after the kill")
                return 1
            continue
        guard.report(step=step, batch_size=batch)
        log("step", step=step, batch=batch, accumulation=guard.grad_accumulation)
        step += 1
    log("done", batch=guard.batch_size, accumulation=guard.grad_accumulation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
