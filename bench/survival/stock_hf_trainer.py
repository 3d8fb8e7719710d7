#!/usr/bin/env python3
"""A stock Hugging Face Trainer script: nothing of memguard in it.

Settings come from the command line through ``HfArgumentParser`` (``TrainingArguments`` and the
data arguments below), or from one JSON file given as the only argument, as in the transformers
examples. The model is a small Llama-style causal
LM built from a config (random weights, nothing from a hub); sample ``i`` is a sequence of
random tokens whose length grows with ``i``, and ``--train_sampling_strategy sequential`` keeps
them in order, so the memory of a step grows through the run. The loss is the model's own
(labels, padding ignored).

What is memguard-specific lives outside this file: the webhook's injected client (on
``PYTHONPATH``) attaches itself to the Trainer, or nothing does. For the survival harness the
script logs what any user could log with a callback and a forward hook (rows per forward pass,
steps, samples) as JSON lines, and saves the final parameters as .npz.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List

import numpy as np
import torch
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@dataclass
class DataArguments:
    samples: int = field(default=256, metadata={"help": "number of training sequences"})
    min_len: int = field(default=32, metadata={"help": "length of the first sequence"})
    max_len: int = field(default=768, metadata={"help": "length of the last sequence"})
    vocab_size: int = field(default=512, metadata={"help": "vocabulary size"})
    log_file: str = field(default="", metadata={"help": "JSON lines of steps (optional)"})
    weights_file: str = field(default="", metadata={"help": "final parameters as .npz (optional)"})
    lora_rank: int = field(default=0, metadata={"help": "LoRA (PEFT) of this rank on q_proj and v_proj; 0: full fine-tuning"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})


def dataset(d: DataArguments, seed: int) -> List[Dict[str, torch.Tensor]]:
    rows = []
    for i in range(d.samples):
        n = d.min_len + (d.max_len - d.min_len) * i // max(1, d.samples - 1)
        g = torch.Generator().manual_seed(seed * 100003 + i)
        rows.append({"input_ids": torch.randint(0, d.vocab_size, (n,), generator=g)})
    return rows


def collate(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, : len(r["input_ids"])] = r["input_ids"]
        mask[k, : len(r["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class StepLog(TrainerCallback):
    """Rows of each training forward pass, per optimizer step, as JSON lines."""

    def __init__(self, path: str, batch: int, rank: int) -> None:
        self.out = open(path, "a", buffering=1) if path else None
        self.rows: List[int] = []
        self.samples = 0
        self.applied = None
        self.batch = batch
        self.rank = rank

    def log(self, event: str, **fields: Any) -> None:
        if self.out is not None:
            self.out.write(json.dumps({"event": event, "t": time.time(), "rank": self.rank, **fields}) + "\n")

    def forward_hook(self, _module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and torch.is_grad_enabled():
            self.rows.append(int(ids.shape[0]))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        size = self.rows[0] if self.rows else 0
        if size != self.applied:
            self.applied = size
            self.log("apply", step=state.global_step - 1, batch=size, seq=0)
        self.samples += sum(self.rows)
        self.log("step", step=state.global_step - 1, rows=sum(self.rows), micro=self.rows,
                 batch=size, accumulation=1, samples=self.samples, loss=None)
        self.rows = []


def main() -> int:
    parser = HfArgumentParser((DataArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        # The transformers examples' convention: every setting from one JSON file.
        data_args, args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        data_args, args = parser.parse_args_into_dataclasses()
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=data_args.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    if data_args.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=data_args.lora_rank, lora_alpha=2 * data_args.lora_rank, lora_dropout=data_args.lora_dropout,
            target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    steps = StepLog(data_args.log_file, args.per_device_train_batch_size, args.process_index)
    model.register_forward_pre_hook(steps.forward_hook, with_kwargs=True)
    steps.log("start", pid=os.getpid(), batch=args.per_device_train_batch_size, accumulation=1,
              effective_batch=args.per_device_train_batch_size, samples=data_args.samples, epochs=1)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(data_args, args.seed),
                      data_collator=collate, callbacks=[steps])
    trainer.train()
    if data_args.weights_file and args.process_index == 0:
        np.savez(data_args.weights_file,
                 **{k: v.detach().float().numpy() for k, v in model.state_dict().items()})
    steps.log("done", steps=trainer.state.global_step, samples=steps.samples,
              batch=args.per_device_train_batch_size, accumulation=1,
              effective_batch_start=args.per_device_train_batch_size,
              effective_batch_end=args.per_device_train_batch_size,
              attached=hasattr(trainer, "_memguard_callback"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
