#!/usr/bin/env python3
"""A real transformers causal LM trained two ways, for the survival proof (survival.py).

The model is a small Llama-style ``LlamaForCausalLM`` built from a config with random weights
(nothing from a hub). Sample ``i`` is a sequence of random tokens whose length grows with ``i``
(a length curriculum, like trainer.py's), and batches are taken in order, so the memory of a
step grows through the run: the batch size that fits at the start does not fit at the end.

* ``--mode hf``: Hugging Face ``Trainer`` (sequential sampler), with
  ``memguard_client.hf.attach`` when memguard env is set;
* ``--mode loop``: a raw PyTorch loop with ``memguard_client.torch.MicroBatcher`` (always used:
  without memguard env its guard is a no-op and batches stay whole).

The loss of a batch is a mean over its rows of each row's mean token loss, so the run is the
same computation at any micro-batch size. Logs JSON lines like trainer.py (start, signal,
apply, step, done) and writes the final parameters as .npz.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "src"))
from memguard_client import Guard  # noqa: E402

VOCAB = 512


def seq_len(i: int, n: int, min_len: int, max_len: int) -> int:
    return min_len + (max_len - min_len) * i // max(1, n - 1)


def build_model(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=False, use_cache=False,
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def samples(n: int, min_len: int, max_len: int, seed: int) -> List[torch.Tensor]:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed * 100003 + i)
        out.append(torch.randint(0, VOCAB, (seq_len(i, n, min_len, max_len),), generator=g))
    return out


def collate(rows: List[Any]) -> Dict[str, torch.Tensor]:
    rows = [r["input_ids"] if isinstance(r, dict) else r for r in rows]
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = r
        mask[k, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def row_mean_loss(model: Any, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over rows of each row's mean next-token loss (a mean over rows: exact re-chunking)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shift = logits[:, :-1].float()
    target = batch["input_ids"][:, 1:]
    mask = batch["attention_mask"][:, 1:].float()
    tok = torch.nn.functional.cross_entropy(shift.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    per_row = (tok.view(target.shape) * mask).sum(1) / mask.sum(1)
    return per_row.mean()


class Log:
    def __init__(self, path: str) -> None:
        self.out = open(path, "a", buffering=1)

    def __call__(self, event: str, **fields: Any) -> None:
        self.out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


class Tracker:
    """Rows of each forward pass and the guard's signals, logged per optimizer step."""

    def __init__(self, log: Log, guard: Guard, batch: int) -> None:
        self.log, self.guard, self.batch = log, guard, batch
        self.rows: List[int] = []
        self.samples = 0
        self.step = 0
        self.seq = -1
        self.applied: Optional[int] = None
        self.reports_ok = self.reports_total = 0

    def hook(self, _module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and torch.is_grad_enabled():
            self.rows.append(int(ids.shape[0]))

    def end_step(self, loss: float, size: int, rows: int) -> None:
        g = self.guard
        if g.seq != self.seq:
            self.seq = g.seq
            sig = g.signal
            self.log("signal", seq=g.seq, level=g.level, batch=g.batch_size, accumulation=g.grad_accumulation,
                     source=g.source, seen_at=g.seen_at, signal_time=sig.timestamp_seconds() if sig else None,
                     reason=sig.reason if sig else "")
        if size != self.applied:
            self.applied = size
            self.log("apply", step=self.step, batch=size, seq=g.seq, level=g.level)
        if g.sidecar_url:
            self.reports_total += 1
            self.reports_ok += g.report(step=self.step, batch_size=size, framework="torch")
        self.samples += rows
        self.log("step", step=self.step, rows=rows, micro=self.rows, batch=size, accumulation=1,
                 samples=self.samples, loss=loss)
        self.rows = []
        self.step += 1


def run_hf(a: argparse.Namespace, guard: Guard, tracker: Tracker, data: List[torch.Tensor]) -> Any:
    import transformers
    from torch.utils.data import SequentialSampler

    from memguard_client.hf import attach

    model = build_model(a.seed)
    model.register_forward_pre_hook(tracker.hook, with_kwargs=True)

    class InOrder(transformers.Trainer):  # type: ignore[misc]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
            return row_mean_loss(model, inputs)

    args = transformers.TrainingArguments(
        output_dir=a.out_dir, per_device_train_batch_size=a.batch_size, gradient_accumulation_steps=1,
        num_train_epochs=1, learning_rate=a.lr, lr_scheduler_type="constant", optim="adamw_torch",
        weight_decay=0.0, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        seed=a.seed, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = InOrder(model=model, args=args, train_dataset=[{"input_ids": s} for s in data], data_collator=collate)
    cb = attach(trainer, guard) if guard.enabled else None
    losses: List[float] = []

    class Steps(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            size = cb.runner.size if cb is not None and cb.runner.size else a.batch_size
            tracker.end_step(losses[-1] if losses else float("nan"), size, sum(tracker.rows) if tracker.rows else 0)

    inner = trainer.training_step

    def training_step(*args: Any, **kw: Any) -> Any:
        loss = inner(*args, **kw)
        losses.append(float(loss))
        return loss

    trainer.training_step = training_step
    trainer.add_callback(Steps())
    trainer.train()
    return model, (cb.downgrades if cb else 0), (cb.oom_recoveries if cb else 0)


def run_loop(a: argparse.Namespace, guard: Guard, tracker: Tracker, data: List[torch.Tensor]) -> Any:
    from memguard_client.torch import MicroBatcher

    model = build_model(a.seed)
    model.register_forward_pre_hook(tracker.hook, with_kwargs=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    batcher = MicroBatcher(guard)
    for start in range(0, len(data), a.batch_size):
        batch = collate(data[start : start + a.batch_size])
        rows = batch["input_ids"].shape[0]
        loss = batcher.backward(batch, lambda mb: row_mean_loss(model, mb), model=model)
        batcher.step(opt)
        tracker.end_step(loss, batcher.micro_batch_size, rows)
    return model, batcher.downgrades, batcher.oom_recoveries


def _mmap_large_blocks() -> None:
    """Large blocks straight from mmap (as numpy's are in trainer.py), so what a step frees goes
    back to the kernel and the cgroup sees what the trainer really holds (glibc's dynamic
    threshold would otherwise keep freed activations in the heap). Same for every arm."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["hf", "loop"], required=True)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--no-long-poll", action="store_true")
    a = p.parse_args(argv)
    a.out_dir = str(Path(a.weights).with_suffix(".trainer"))
    _mmap_large_blocks()
    torch.set_num_threads(1)
    log = Log(a.log)
    guard = Guard(batch_size=a.batch_size, grad_accumulation=1, background=not a.no_long_poll)
    data = samples(a.samples, a.min_len, a.max_len, a.seed)
    log("start", pid=os.getpid(), batch=guard.batch_size, accumulation=1, effective_batch=a.batch_size,
        samples=a.samples, epochs=1, memguard=guard.enabled, mode=a.mode)
    tracker = Tracker(log, guard, a.batch_size)
    run = run_hf if a.mode == "hf" else run_loop
    model, downgrades, recoveries = run(a, guard, tracker, data)
    import numpy as np

    np.savez(a.weights, **{k: v.detach().float().numpy() for k, v in model.state_dict().items()})
    log("done", steps=tracker.step, samples=tracker.samples, batch=guard.batch_size, accumulation=1,
        effective_batch_start=a.batch_size, effective_batch_end=a.batch_size,
        reports_ok=tracker.reports_ok, reports_total=tracker.reports_total,
        downgrades=downgrades, oom_recoveries=recoveries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
