"""The grow-back trainer: a real Hugging Face ``Trainer`` on CPU (a tiny GPT-2 made from a
config, float64, no dropout, plain SGD at a constant rate: deterministic), configured at a
micro-batch of 16 and accumulation 1.

Guarded (``--guarded``): attached to memguard (``memguard_client.hf.attach``); the guard starts
from the admitted plan in ``MEMGUARD_BATCH_SIZE`` / ``MEMGUARD_GRAD_ACCUMULATION`` (2 × 8) and
follows the sidecar at ``MEMGUARD_SIDECAR_URL``. Unguarded: the same run without memguard.

Writes ``<out>/weights.pt`` (the final parameters) and ``<out>/run.json``: the micro-batch run at
each optimizer step (guarded), the forwards and rows the model saw, the steps, and the seconds
``trainer.train()`` took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--guarded", action="store_true")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    import transformers

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (args.samples, args.seq), generator=gen)
    data = [{"input_ids": row, "labels": row} for row in ids]

    seen = {"forwards": 0, "rows": 0}

    def count(_module: Any, inputs: Any, kwargs: Dict[str, Any]) -> None:
        x = kwargs.get("input_ids", inputs[0] if inputs else None)
        seen["forwards"] += 1
        seen["rows"] += int(x.shape[0])

    model.register_forward_pre_hook(count, with_kwargs=True)
    targs = transformers.TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, num_train_epochs=1, optim="sgd", learning_rate=0.05,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
        data_seed=0, dataloader_drop_last=True, disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data)
    sizes: List[int] = []
    if args.guarded:
        from memguard_client import Guard
        from memguard_client.hf import attach

        cb = attach(trainer, Guard(oom_hook=False))

        class Record(transformers.TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
                sizes.append(int(cb.runner.size or 0))

        trainer.add_callback(Record())
    started = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - started
    rank = int(os.environ.get("RANK", "0"))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights-{rank}.pt")
    (out / f"run-{rank}.json").write_text(json.dumps({
        "sizes": sizes, "steps": int(trainer.state.global_step), "forwards": seen["forwards"],
        "rows": seen["rows"], "train_seconds": seconds,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
