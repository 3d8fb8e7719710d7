"""One rank of the 2-rank torchrun tests (test_distributed.py); also the single-process reference.

    torchrun --standalone --nproc_per_node 2 distributed_worker.py MODE OUT_DIR
    python distributed_worker.py reference OUT_DIR

MODE is ``ddp``, ``fsdp2``, ``ddp-oom`` or ``exit-in-flight`` (below). Each rank follows its own signal file, as each pod of
a multi-pod job follows its own sidecar; only rank 0's signal changes mid-run (batch 8 → 3 at
step 2; → 4 in ``ddp-oom``). In ``ddp-oom`` rank 1 also raises the real
``torch.OutOfMemoryError`` from a forward hook for micro-batches above 2 rows from step 4 on,
and once from a backward hook in the first micro-batch of step 5.
Every rank writes ``rank<r>.json``: the micro-batch sizes it ran at each step and its final
parameters; the reference (one process, the whole global batch) writes ``reference.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from memguard_client import Guard  # noqa: E402
from memguard_client.torch import MicroBatcher  # noqa: E402

STEPS, PER_RANK, WORLD, LR = 7, 8, 2, 0.2


def model_and_data() -> "tuple[torch.nn.Module, torch.Tensor, torch.Tensor]":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, WORLD * PER_RANK, 6, generator=g)
    y = torch.randn(STEPS, WORLD * PER_RANK, 1, generator=g)
    return model, x, y


def signal(seq: int, batch: int) -> Dict[str, Any]:
    return {
        "version": 1, "seq": seq, "level": "ok" if seq == 0 else "downgrade", "batch_size": batch,
        "grad_accumulation": 1, "grad_checkpointing": False, "reason": "test",
        "pressure": {"memory_ratio": 0.5}, "timestamp": "2026-11-23T22:00:00.000Z",
    }


def write_signal(path: Path, seq: int, batch: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(signal(seq, batch)))
    os.replace(tmp, path)


def reference(out: Path) -> None:
    model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        torch.nn.functional.mse_loss(model(x[step]), y[step]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = [p.detach().tolist() for p in model.parameters()]
    (out / "reference.json").write_text(json.dumps({"params": params}))


def rank_main(mode: str, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    model, x, y = model_and_data()
    inner = model
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    sig = out / f"signal-{rank}.json"
    write_signal(sig, 0, PER_RANK)
    batcher = MicroBatcher(Guard(signal_file=str(sig), env={}))
    rows_seen: List[int] = []
    state = {"step": 0, "backward_oom_done": False}

    if mode == "ddp-oom" and rank == 1:
        def forward_hook(_m: Any, args: Any) -> None:
            if state["step"] >= 4 and args[0].shape[0] > 2:
                raise torch.OutOfMemoryError("injected: CUDA out of memory (forward, > 2 rows)")

        def backward_hook(_m: Any, _gin: Any, _gout: Any) -> None:
            if state["step"] == 5 and not state["backward_oom_done"]:
                state["backward_oom_done"] = True
                raise torch.OutOfMemoryError("injected: CUDA out of memory (backward)")

        inner[0].register_forward_pre_hook(forward_hook)
        inner[2].register_full_backward_hook(backward_hook)

    def loss_fn(mb: Any) -> torch.Tensor:
        xb, yb = mb
        rows_seen.append(xb.shape[0])
        return torch.nn.functional.mse_loss(model(xb), yb)

    per_step: List[List[int]] = []
    for step in range(STEPS):
        state["step"] = step
        if step == 2 and rank == 0:
            write_signal(sig, 1, 4 if mode == "ddp-oom" else 3)  # only rank 0's sidecar sees it
        shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        before = len(rows_seen)
        batcher.backward((x[step, shard], y[step, shard]), loss_fn, model=model)
        batcher.step(opt)
        per_step.append(rows_seen[before:])

    params = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params.append(full.detach().tolist())
    result = {
        "rank": rank,
        "micro": per_step,
        "applied": batcher.micro_batch_size,
        "params": params,
        "downgrades": batcher.downgrades,
        "oom_recoveries": batcher.oom_recoveries,
        "skipped_steps": batcher.skipped_steps,
        "collectives": batcher.runner.agreement.collectives,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # Tear down together: a rank that destroys the group while its peer still has gloo work in
    # flight can make the peer abort at exit ("terminate called without an active exception",
    # seen once on a full check).
    dist.barrier()
    dist.destroy_process_group()


class _SlowFinalization:
    """Held in a module global, so its ``__del__`` runs while the interpreter finalizes: it keeps
    that phase open long enough for a collective in flight to complete inside it."""

    def __del__(self, sleep: Any = time.sleep) -> None:  # the time module may be gone by then
        sleep(3.0)


def exit_in_flight(out: Path) -> None:
    """Rank 0 leaves its last pipelined collective in flight and returns; rank 1 issues its side
    only once rank 0 is done, so rank 0's collective completes while rank 0 exits. Without
    ``Agreement.close`` at exit it completes during finalization and rank 0 aborts
    ("terminate called without an active exception")."""
    import torch.distributed as dist

    from memguard_client.distributed import Agreement

    global _keep
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agree = Agreement()  # the default: pipelined
    assert agree.pipelined
    for _ in range(2):
        agree.step(8, False)
    marker = out / "rank0-returned"
    if rank == 0:
        agree.step(8, False)  # in flight until rank 1 issues its side
        marker.write_text("done")
        _keep = _SlowFinalization()
    else:
        while not marker.exists():
            time.sleep(0.01)
        time.sleep(1.0)  # rank 0 is in its exit by now
        agree.step(8, False)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "collectives": agree.collectives}))


_keep: Any = None


if __name__ == "__main__":
    mode_arg, out_arg = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if mode_arg == "reference":
        reference(out_arg)
    elif mode_arg == "exit-in-flight":
        exit_in_flight(out_arg)
    else:
        rank_main(mode_arg, out_arg)
