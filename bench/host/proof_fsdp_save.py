#!/usr/bin/env python3
"""A training script with Hugging Face flags and its own FSDP2 loop, for the save proof of issue
39 (bench/host/test_host_proofs.py): `HfArgumentParser` over `TrainingArguments`, a Llama of a
local checkpoint's config built on the meta device and sharded with `fully_shard` (gloo, CPU),
AdamW, synthetic tokens; at the last step it saves as the flags say, as the Trainer does:

* `--fsdp_config` `state_dict_type`: `FULL_STATE_DICT` (the default) gathers the whole state on
  rank 0's host (`cpu_offload`) and rank 0 writes it; `SHARDED_STATE_DICT` writes each rank's
  shard with `torch.distributed.checkpoint`;
* `--save_only_model`: the model alone, else the optimizer's state too.

Markers under $MEMGUARD_PROOF_MARKERS, one file per rank: `loaded-<rank>` once the model is
built and sharded, `stepped-<rank>` after the first step, `saving-<rank>` before the save,
`saved-<rank>` after it, `trained-<rank>` at the end.

    torchrun --nproc_per_node 2 bench/host/proof_fsdp_save.py --model_name_or_path CKPT \
        --output_dir OUT --max_steps 2 --fsdp full_shard --fsdp_config '{"state_dict_type": "FULL_STATE_DICT"}'
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local checkpoint (its config is used)"})
    max_seq_length: int = field(default=64, metadata={"help": "tokens per sample"})


def mark(name: str) -> None:
    markers = os.environ.get("MEMGUARD_PROOF_MARKERS")
    if markers:
        Path(markers, f"{name}-{dist.get_rank()}").write_text("")


def save(model, optim, args: TrainingArguments, out: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    state_dict_type = (args.fsdp_config or {}).get("state_dict_type", "FULL_STATE_DICT")
    if state_dict_type == "SHARDED_STATE_DICT":
        import torch.distributed.checkpoint as dcp

        opts = StateDictOptions()
        state = {"model": get_model_state_dict(model, options=opts)}
        if not args.save_only_model:
            state["optimizer"] = get_optimizer_state_dict(model, optim, options=opts)
        dcp.save(state, checkpoint_id=str(out))
        return
    if state_dict_type != "FULL_STATE_DICT":
        raise SystemExit(f"proof_fsdp_save.py: state_dict_type {state_dict_type!r} is not FULL_STATE_DICT or SHARDED_STATE_DICT")
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=opts)}
    if not args.save_only_model:
        state["optimizer"] = get_optimizer_state_dict(model, optim, options=opts)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "checkpoint.pt")


def main() -> None:
    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():  # TrainingArguments' device setup may have done it
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    mark("loaded")
    # One parameter at a time: the foreach kernels make temporaries of every parameter at once,
    # which a GPU job holds in device memory and this CPU run would hold on the host.
    optim = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, foreach=False)
    steps = max(args.max_steps, 1)
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
        ids = torch.randint(0, config.vocab_size, (args.per_device_train_batch_size, model_args.max_seq_length), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mark("stepped")
    dist.barrier()
    if args.save_strategy != "no":
        mark("saving")
        save(model, optim, args, Path(args.output_dir) / f"checkpoint-{steps}")
        dist.barrier()
        mark("saved")
    mark("trained")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
