"""One rank of the 2-rank gradient-sync tests (test_grad_sync.py): real FSDP2 (``fully_shard``)
over gloo on CPU, and the real HF Accelerator.

    torchrun --standalone --nproc_per_node 2 gradsync_worker.py MODE OUT_DIR

MODE ``fsdp2``: measures the bytes of gradient storage every rank holds after the first of two
accumulating micro-batches, (a) under ``set_requires_gradient_sync(False)`` (what Accelerate's
``accumulate``, the HF Trainer and LitGPT do), (b) syncing each micro-batch, and through
:class:`memguard_client.torch.MicroBatcher` at a run-time downgrade (batch 8 → 4 on rank 0's
signal only) (c) with ``sync_each_batch=False`` and (d) by default, and (e) from the start with
``MEMGUARD_GRAD_SYNC=each-batch``. Each also records its final parameters, to compare with a
single-process run.

MODE ``accelerate``: the real ``Accelerator`` (MULTI_CPU: accelerate only shards with FSDP on
accelerators, so the model is DDP-wrapped here): whether ``accumulate()`` syncs the first of two
micro-batches before and after :func:`memguard_client.recovery.sync_each_batch_on`; and whether
``MicroBatcher(accelerator=…)`` with an FSDP2 model sets the flag at the step of a downgrade.

Every rank writes ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from memguard_client import Guard  # noqa: E402
from memguard_client.recovery import sync_each_batch_on  # noqa: E402
from memguard_client.torch import MicroBatcher  # noqa: E402

# Four steps: rank 0's downgrade seen at step 1 is applied at step 2 by the (default) pipelined
# agreement, and step 3 shows it stays.
STEPS, PER_RANK, WORLD, LR = 4, 8, 2, 0.1


def data() -> "tuple[torch.Tensor, torch.Tensor]":
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, WORLD * PER_RANK, 32, generator=g)
    y = torch.randn(STEPS, WORLD * PER_RANK, 1, generator=g)
    return x, y


def plain_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
        torch.nn.Linear(256, 1),
    )


def sharded_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = plain_model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages holding gradients on this rank: the sharded gradients
    (``param.grad``, a DTensor's local shard) and the unsharded ones FSDP2 accumulates under
    ``set_requires_gradient_sync(False)`` (its unsharded parameters' ``.grad``)."""
    storages: Dict[int, int] = {}

    def add(g: Any) -> None:
        if g is None:
            return
        local = getattr(g, "_local_tensor", g)
        s = local.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p.grad)
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is None:
            continue
        for group in state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                add(getattr(getattr(fp, "_unsharded_param", None), "grad", None))
    return sum(storages.values())


def signal(seq: int, batch: int) -> Dict[str, Any]:
    return {
        "version": 1, "seq": seq, "level": "ok" if seq == 0 else "downgrade", "batch_size": batch,
        "grad_accumulation": 1, "grad_checkpointing": False, "reason": "test",
        "pressure": {"memory_ratio": 0.5}, "timestamp": "2026-11-24T10:00:00.000Z",
    }


def write_signal(path: Path, seq: int, batch: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(signal(seq, batch)))
    os.replace(tmp, path)


def full_params(model: torch.nn.Module) -> List[Any]:
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().tolist())
    return out


def raw(rank: int, sync_first: bool) -> Dict[str, Any]:
    """Two micro-batches of 4 rows by hand; the first syncs or not."""
    x, y = data()
    model = sharded_model()
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    xb, yb = x[0, shard], y[0, shard]
    model.set_requires_gradient_sync(sync_first)
    torch.nn.functional.mse_loss(model(xb[:4]), yb[:4]).mul(0.5).backward()
    after_first = grad_bytes(model)
    model.set_requires_gradient_sync(True)
    torch.nn.functional.mse_loss(model(xb[4:]), yb[4:]).mul(0.5).backward()
    return {"after_first": after_first, "after_last": grad_bytes(model)}


def client(rank: int, out: Path, name: str, **kw: Any) -> Dict[str, Any]:
    """:data:`STEPS` steps through MicroBatcher; rank 0's signal drops 8 → 4 at step 1 (unless the
    env already starts at 4), applied by both ranks at step 2 (pipelined agreement). Measures gradient bytes when each micro-batch after the first begins."""
    x, y = data()
    model = sharded_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    env = kw.pop("env", None)
    sig = out / f"signal-{name}-{rank}.json"
    if env is None:
        write_signal(sig, 0, PER_RANK)
    # With an env, no sidecar: the webhook's MEMGUARD_* values are the starting point.
    batcher = MicroBatcher(Guard(signal_file="" if env else str(sig), env=env or {}), **kw)
    seen: List[List[int]] = []
    rows: List[List[int]] = []

    def loss_fn(mb: Any) -> torch.Tensor:
        xb, yb = mb
        if rows[-1]:  # a micro-batch before this one already ran its backward
            seen[-1].append(grad_bytes(model))
        rows[-1].append(xb.shape[0])
        return torch.nn.functional.mse_loss(model(xb), yb)

    sync: List[bool] = []
    for step in range(STEPS):
        if step == 1 and rank == 0 and env is None:
            write_signal(sig, 1, 4)
        seen.append([])
        rows.append([])
        shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        batcher.backward((x[step, shard], y[step, shard]), loss_fn, model=model)
        sync.append(batcher.sync_each_batch)
        batcher.step(opt)
    return {"between": seen, "rows": rows, "sync": sync, "params": full_params(model)}


def reference() -> List[Any]:
    x, y = data()
    model = plain_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        torch.nn.functional.mse_loss(model(x[step]), y[step]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return full_params(model)


def fsdp2(rank: int, out: Path) -> Dict[str, Any]:
    full = sum(p.numel() * p.element_size() for p in plain_model().parameters())
    return {
        "full_grad_bytes": full,
        "no_sync": raw(rank, sync_first=False),
        "each_batch": raw(rank, sync_first=True),
        "client_never": client(rank, out, "never", sync_each_batch=False),
        "client": client(rank, out, "default"),
        "client_env": client(
            rank, out, "env", env={"MEMGUARD_GRAD_SYNC": "each-batch", "MEMGUARD_BATCH_SIZE": "4"}
        ),
        "reference": reference() if rank == 0 else None,
    }


def accelerate(rank: int, out: Path) -> Dict[str, Any]:
    from accelerate import Accelerator

    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = acc.prepare(plain_model())
    x, y = data()

    def first_micro_syncs() -> bool:
        """Whether accumulate() lets the first of two micro-batches synchronise (DDP's flag)."""
        with acc.accumulate(model):
            syncs = bool(model.require_backward_grad_sync)
            model(x[0, :2]).sum().backward()
        with acc.accumulate(model):
            model(x[0, 2:4]).sum().backward()
        model.zero_grad(set_to_none=True)
        return syncs

    before = first_micro_syncs()
    set_now = sync_each_batch_on(acc)
    set_again = sync_each_batch_on(acc)
    after = first_micro_syncs()
    acc.gradient_state.plugin_kwargs.pop("sync_each_batch")

    # Through the client, with an FSDP2 model beside the Accelerator (accelerate does not shard
    # on CPU): the flag is set at the step the downgrade applies (the one after rank 0 saw it),
    # on every rank.
    sharded = sharded_model()
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    sig = out / f"signal-acc-{rank}.json"
    write_signal(sig, 0, PER_RANK)
    batcher = MicroBatcher(Guard(signal_file=str(sig), env={}), accelerator=acc)
    flags = []
    for step in range(STEPS):
        if step == 1 and rank == 0:
            write_signal(sig, 1, 4)
        shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        batch = (x[step, shard], y[step, shard])
        batcher.backward(
            batch, lambda mb: torch.nn.functional.mse_loss(sharded(mb[0]), mb[1]), model=sharded
        )
        batcher.step(opt)
        flags.append(bool(acc.gradient_state.plugin_kwargs.get("sync_each_batch", False)))
    return {
        "distributed_type": str(acc.distributed_type),
        "before": before,
        "set_now": set_now,
        "set_again": set_again,
        "after": after,
        "client_flags": flags,
    }


def main(mode: str, out: Path) -> None:
    import torch.distributed as dist

    if mode == "accelerate":
        result = accelerate(int(os.environ["RANK"]), out)
        rank = int(os.environ["RANK"])
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        result = fsdp2(rank, out)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], Path(sys.argv[2]))
