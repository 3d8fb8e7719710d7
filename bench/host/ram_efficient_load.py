#!/usr/bin/env python3
"""Does FSDP's `cpu_ram_efficient_loading` lower a multi-rank load's host memory? (issue 39)

Two ranks load a bf16 checkpoint (the proofs' m400, 322M parameters) as fp32 (a copy per rank,
the case the key is for), each reading every weight after the load as `model.to("cuda")` would,
in a fresh cgroup v1 memory group without limit (bench/host/proof.py's harness, cold page cache).
The worker parses `TrainingArguments` first, as a Trainer script does, so the key reaches the
environment exactly as it does in a real launch. Four runs: `accelerate launch --use_fsdp` and
`torchrun`, with the key off and on. Each prints a JSON line: the group's peak, the highest
anonymous memory while loading, and what each rank saw (`is_fsdp_enabled()`, the devices of its
parameters). Root only.

    sudo python3 bench/host/ram_efficient_load.py [--out bench/host/results/ram_efficient_load.jsonl]

Measured here (transformers 5.23, accelerate, torch CPU): the key changes nothing; see
docs/host-memory.md, "RAM-efficient loading".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GIB = 1 << 30


def worker() -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, HfArgumentParser, TrainingArguments
    from transformers.distributed.fsdp import is_fsdp_enabled

    from proof_train import ModelArguments, mark

    model_args, _ = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    mark("loading")
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=getattr(torch, model_args.dtype))
    # Read every weight, one tensor at a time: mapped pages nobody reads are not charged.
    for p in model.parameters():
        if p.device.type != "meta":
            float(p.sum())
    mark("loaded")
    devices = sorted({p.device.type for p in model.parameters()})
    print(f"rank {os.environ.get('RANK')} is_fsdp_enabled={is_fsdp_enabled()} devices={devices}", flush=True)
    dist.barrier()


def main() -> None:
    if os.environ.get("MEMGUARD_RAM_EFFICIENT_WORKER"):
        worker()
        return
    import proof

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="append one JSON line per run here")
    args = parser.parse_args()
    proof.require_root()
    ckpt = proof.build_checkpoint("m400", "bfloat16")
    scratch = Path(proof.tempfile.mkdtemp(prefix="memguard-ram-efficient-"))
    launchers = {
        "accelerate launch --use_fsdp": [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--num_processes", "2",
                                         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
    }
    for name, launcher in launchers.items():
        for on in (False, True):
            argv = launcher + [str(Path(__file__).resolve()), "--model_name_or_path", str(ckpt), "--dtype", "float32",
                               "--output_dir", str(scratch / "out"), "--use_cpu", "--fsdp", "full_shard",
                               "--fsdp_config", json.dumps({"cpu_ram_efficient_loading": on})]
            run = proof.run_in_cgroup(f"ram-efficient-{'accelerate' if 'accelerate' in name else 'torchrun'}-{on}", 64 * GIB, argv,
                                      cwd=scratch, env={"MEMGUARD_RAM_EFFICIENT_WORKER": "1"})
            assert run.returncode == 0, proof.describe(run)
            result = dict(
                case="ram-efficient-load-m400-bf16-float32-r2", launcher=name, cpu_ram_efficient_loading=on,
                peak_gib=round(run.peak_bytes / GIB, 3), anon_load_gib=round(run.anon_by_phase["load"] / GIB, 3),
                ranks=sorted(line for line in run.output.splitlines() if line.startswith("rank ")),
                wall_s=run.wall_s, versions=versions(),
            )
            print(json.dumps(result), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(result) + "\n")


def versions() -> dict:
    import accelerate
    import torch
    import transformers

    return dict(torch=torch.__version__, transformers=transformers.__version__, accelerate=accelerate.__version__)


if __name__ == "__main__":
    main()
