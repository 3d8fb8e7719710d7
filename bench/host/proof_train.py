#!/usr/bin/env python3
"""A stock-shaped Hugging Face training script for the host-memory proofs of issue 39
(bench/host/test_host_proofs.py): `HfArgumentParser` over its own model arguments and
`TrainingArguments`, `from_pretrained` of a local checkpoint, a `Trainer` over synthetic tokens,
LoRA adapters (peft) or the full model. Launched by torchrun, with gloo on the CPU.

It leaves evidence of how far it got, one file per rank under $MEMGUARD_PROOF_MARKERS:
`loading-<rank>` as `from_pretrained` is called, `loaded-<rank>` once it has returned,
`stepped-`, `saving-`, `saved-<rank>` from the Trainer's callbacks (`PhaseMarkers`), and
`trained-<rank>` once `train()` has returned.

    torchrun --nproc_per_node 2 bench/host/proof_train.py --model_name_or_path CKPT \
        --dtype float32 --lora true --output_dir OUT --max_steps 3
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local checkpoint"})
    dtype: str = field(default="auto", metadata={"help": "the dtype the weights are loaded in"})
    lora: bool = field(default=False, metadata={"help": "train LoRA adapters on a frozen base"})
    max_seq_length: int = field(default=64, metadata={"help": "tokens per sample"})


class SyntheticTokens(torch.utils.data.Dataset):
    """Samples made from their index: nothing held, so the cgroup sees the trainer itself."""

    def __init__(self, n: int, seq: int, vocab: int):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=g)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(self.seq, dtype=torch.long)}


def mark(name: str) -> None:
    markers = os.environ.get("MEMGUARD_PROOF_MARKERS")
    if markers:
        Path(markers, f"{name}-{os.environ.get('RANK', '0')}").write_text("")


class PhaseMarkers(TrainerCallback):
    """`stepped-<rank>` at the first step's end, `saving-<rank>` at the step end at which the
    Trainer decided to save (the save comes next), `saved-<rank>` once it is written."""

    def on_step_end(self, args, state, control, **kwargs):
        mark("stepped")
        if control.should_save:
            mark("saving")

    def on_save(self, args, state, control, **kwargs):
        mark("saved")


def main() -> None:
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    dtype = model_args.dtype if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    mark("loading")
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
    mark("loaded")
    if model_args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        # Every rank loaded the frozen base from the same files: DDP need not broadcast it. On a
        # GPU that broadcast is device memory; on the CPU it would copy the base once more on
        # the host, which a GPU job's host never holds.
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    steps = max(training_args.max_steps, 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = SyntheticTokens(steps * training_args.per_device_train_batch_size * world, model_args.max_seq_length, model.config.vocab_size)
    Trainer(model=model, args=training_args, train_dataset=data, callbacks=[PhaseMarkers()]).train()
    mark("trained")


if __name__ == "__main__":
    main()
