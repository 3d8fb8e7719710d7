#!/usr/bin/env python3
"""Host-memory ground truth: the peak of a real memory cgroup while real models load, while a
DataLoader feeds batches, and while a sharded model saves its state.

Every case runs in its own fresh cgroup v1 memory group under
/sys/fs/cgroup/memory/memguard-host-bench/ (no limit). The launcher shell writes its own pid to
the group's cgroup.procs and then execs the workload, so torchrun, its ranks and DataLoader
workers are all charged to that group, as the processes of one Kubernetes container are. The
case's host peak is the group's `memory.max_usage_in_bytes` (page cache included: on Kubernetes
the file pages a container reads or writes count against its limit); a sampler thread reads
`memory.stat` every 20 ms and keeps the rss/cache split of the highest sample. "Cold" cases
(runtime, load, input) drop the page cache first (`sync; echo 3 > /proc/sys/vm/drop_caches`), so
the pages of the checkpoint and of torch's own libraries are read, and charged, inside the case,
as in a container that has just started.

    sudo python3 bench/host/measure.py sweep --out bench/host/results/host.jsonl
    sudo python3 bench/host/measure.py sweep --only load-m150 --out /tmp/x.jsonl

Kinds of case (see `cases()`):

* runtime: torchrun with N ranks that import torch and transformers' Llama and join a gloo group.
* load: N torchrun ranks each call `LlamaForCausalLM.from_pretrained` on a local safetensors
  checkpoint (random-init models saved by `save_pretrained`), with the dtype left to the
  loader's default or given.
* input: one torchrun rank iterating a DataLoader over a synthetic tokenised dataset (tokens made per
  index, nothing held in memory) with W workers, a prefetch factor, pin_memory and a batch size.
* save: N ranks train one step of an FSDP2 (`fully_shard`, gloo, CPU) model with AdamW, then
  save: the full state dict gathered on rank 0 (model only, or with the optimizer state), a
  sharded `torch.distributed.checkpoint` save, or (one rank, no FSDP) HF `save_pretrained`.
  Rank 0 reads the group's usage before the save (the train baseline), resets
  `memory.max_usage_in_bytes`, and reads it after: the spike is the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup/memory/memguard-host-bench")
MODELS_DIR = Path(os.environ.get("MEMGUARD_HOST_MODELS", "/tmp/memguard-host-models"))
SCRATCH_DIR = Path(os.environ.get("MEMGUARD_HOST_SCRATCH", "/tmp/memguard-host-scratch"))
HERE = Path(__file__).resolve()

# Llama-architecture shapes (untied embeddings, vocab 32000). Parameter counts are recorded from
# the built model, not from these comments.
SHAPES: Dict[str, dict] = {
    "m50": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1376, num_attention_heads=8),
    "m150": dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12),
    "m400": dict(hidden_size=1024, num_hidden_layers=20, intermediate_size=2816, num_attention_heads=16),
    "m1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, num_attention_heads=16),
}
# Checkpoints: (shape, storage dtype, max_shard_size or None).
CHECKPOINTS: Dict[str, tuple] = {
    "m50-fp32": ("m50", "float32", None),
    "m150-fp32": ("m150", "float32", None),
    "m150-bf16": ("m150", "bfloat16", None),
    "m400-fp32": ("m400", "float32", None),
    "m400-bf16-sharded": ("m400", "bfloat16", "200MB"),
    "m1b-bf16": ("m1b", "bfloat16", None),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def cases() -> List[dict]:
    out: List[dict] = []
    for ranks in (1, 2, 4):
        out.append(dict(kind="runtime", name=f"runtime-r{ranks}", ranks=ranks, cold=True))
    load_grid = [
        ("m50-fp32", "default", (1, 2, 4)),
        ("m50-fp32", "bfloat16", (1, 2)),
        ("m150-fp32", "default", (1, 2, 4)),
        ("m150-fp32", "bfloat16", (1, 2, 4)),
        ("m150-fp32", "float32", (1,)),
        ("m150-bf16", "default", (1, 2, 4)),
        ("m150-bf16", "float32", (1, 2)),
        ("m400-fp32", "default", (1, 2, 4)),
        ("m400-fp32", "bfloat16", (1, 2)),
        ("m400-bf16-sharded", "default", (1, 2, 4)),
        ("m1b-bf16", "default", (1, 2)),
        ("m1b-bf16", "float32", (1,)),
    ]
    for ckpt, dtype, ranks_list in load_grid:
        for ranks in ranks_list:
            out.append(
                dict(kind="load", name=f"load-{ckpt}-{dtype}-r{ranks}", checkpoint=ckpt, dtype=dtype, ranks=ranks, cold=True)
            )
    # Batch sizes: 8 x 2048 tokens (small, 0.4 MiB of tensors) and 64 x 8192 (large, 12 MiB).
    for batch, seq in ((8, 2048), (64, 8192)):
        for workers in (0, 1, 2, 4, 8):
            out.append(dict(kind="input", name=f"input-b{batch}x{seq}-w{workers}-pf2", batch=batch, seq=seq, workers=workers, prefetch=2, pin=False, cold=True))
        for workers in (2, 8):
            out.append(dict(kind="input", name=f"input-b{batch}x{seq}-w{workers}-pf4", batch=batch, seq=seq, workers=workers, prefetch=4, pin=False, cold=True))
        for workers in (0, 4):
            out.append(dict(kind="input", name=f"input-b{batch}x{seq}-w{workers}-pf2-pin", batch=batch, seq=seq, workers=workers, prefetch=2, pin=True, cold=True))
    for shape, ranks, modes in (
        ("m150", 2, ("full_model", "full_with_optimizer", "sharded")),
        ("m150", 4, ("full_model", "full_with_optimizer", "sharded")),
        ("m400", 2, ("full_model", "sharded")),
    ):
        for mode in modes:
            out.append(dict(kind="save", name=f"save-{shape}-r{ranks}-{mode}", shape=shape, ranks=ranks, mode=mode))
    for shape in ("m150", "m400"):
        for safe in (True, False):
            out.append(dict(kind="save", name=f"save-{shape}-r1-hf-{'safetensors' if safe else 'torch'}", shape=shape, ranks=1, mode="hf_safetensors" if safe else "hf_torch"))
    return out


# ---------------------------------------------------------------- the harness (root, outside)


def machine_facts() -> dict:
    import torch
    import transformers

    mem_total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    return dict(
        host=platform.node(),
        kernel=platform.release(),
        cpus=os.cpu_count(),
        mem_total_bytes=mem_total,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        cgroup="v1 memory",
    )


def build_checkpoints(names: List[str]) -> Dict[str, dict]:
    """Random-init models saved once with `save_pretrained`; reused across sweeps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    facts = {}
    for name in names:
        shape, dtype, shard = CHECKPOINTS[name]
        path = MODELS_DIR / name
        meta = path / "memguard-bench.json"
        if not meta.exists():
            if path.exists():
                shutil.rmtree(path)
            torch.manual_seed(0)
            cfg = LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **SHAPES[shape])
            model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
            params = sum(p.numel() for p in model.parameters())
            kwargs = {"max_shard_size": shard} if shard else {}
            model.save_pretrained(path, **kwargs)
            del model
            files = sorted(p.name for p in path.glob("*.safetensors"))
            size = sum((path / f).stat().st_size for f in files)
            meta.write_text(json.dumps(dict(params=params, storage_dtype=dtype, files=files, checkpoint_bytes=size)))
        facts[name] = json.loads(meta.read_text())
    return facts


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_stat(group: Path) -> Dict[str, int]:
    stat = {}
    for line in (group / "memory.stat").read_text().splitlines():
        key, value = line.split()
        stat[key] = int(value)
    return stat


class Sampler(threading.Thread):
    """Polls the group's usage; keeps the highest sample and its rss/cache split."""

    def __init__(self, group: Path):
        super().__init__(daemon=True)
        self.group = group
        self.stop = threading.Event()
        self.best = dict(usage=0, rss=0, cache=0, shmem=0, mapped_file=0)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                usage = int((self.group / "memory.usage_in_bytes").read_text())
                if usage > self.best["usage"]:
                    stat = read_stat(self.group)
                    self.best = dict(
                        usage=usage,
                        rss=stat.get("rss", 0),
                        cache=stat.get("cache", 0),
                        shmem=stat.get("shmem", 0),
                        mapped_file=stat.get("mapped_file", 0),
                    )
            except OSError:
                pass
            self.stop.wait(0.02)


def workload_argv(case: dict) -> List[str]:
    spec = json.dumps(case)
    ranks = case.get("ranks", 1)
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(HERE), "worker", spec,
    ]


def run_case(case: dict, facts: dict, ckpt_facts: Dict[str, dict]) -> dict:
    group = CGROUP_ROOT / case["name"]
    if group.exists():
        group.rmdir()
    group.mkdir(parents=True)
    result_file = SCRATCH_DIR / f"{case['name']}.json"
    if result_file.exists():
        result_file.unlink()
    if case.get("cold"):
        drop_caches()
    env = dict(os.environ, MEMGUARD_BENCH_CGROUP=str(group), MEMGUARD_BENCH_RESULT=str(result_file),
               MEMGUARD_HOST_MODELS=str(MODELS_DIR), MEMGUARD_HOST_SCRATCH=str(SCRATCH_DIR),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    # The shell joins the fresh group, then execs the workload: every process it starts is
    # charged there from its first page.
    launcher = ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec nice -n 5 "$@"', "launcher", *workload_argv(case)]
    sampler = Sampler(group)
    sampler.start()
    start = time.time()
    proc = subprocess.run(launcher, env=env, capture_output=True, text=True)
    wall = time.time() - start
    sampler.stop.set()
    sampler.join()
    peak = int((group / "memory.max_usage_in_bytes").read_text())
    record = dict(case=case, ok=proc.returncode == 0, wall_s=round(wall, 1), peak_bytes=peak,
                  at_peak_sample=sampler.best, machine=facts)
    if case["kind"] == "load":
        record["checkpoint"] = ckpt_facts[case["checkpoint"]]
    if result_file.exists():
        record["workload"] = json.loads(result_file.read_text())
    if proc.returncode != 0:
        record["stderr_tail"] = proc.stderr[-3000:]
    try:
        group.rmdir()
    except OSError:
        pass
    return record


def sweep(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        sys.exit("measure.py sweep: needs root (cgroup v1 groups, drop_caches)")
    SCRATCH_DIR.mkdir(parents=True, exist_ok=True)
    CGROUP_ROOT.mkdir(parents=True, exist_ok=True)
    selected = [
        c for c in cases()
        if (not args.only or any(o in c["name"] for o in args.only)) and c["name"] not in (args.skip or [])
    ]
    needed = sorted({c["checkpoint"] for c in selected if c["kind"] == "load"})
    ckpt_facts = build_checkpoints(needed)
    facts = machine_facts()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for case in selected:
            record = run_case(case, facts, ckpt_facts)
            f.write(json.dumps(record) + "\n")
            f.flush()
            status = "ok" if record["ok"] else "FAILED"
            print(f"{case['name']}: {record['peak_bytes'] / 2**30:.3f} GiB {status} ({record['wall_s']} s)", flush=True)
            if not record["ok"]:
                print(record.get("stderr_tail", ""), file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the workloads (inside the group)


def write_result(data: dict) -> None:
    path = os.environ.get("MEMGUARD_BENCH_RESULT")
    if path and int(os.environ.get("RANK", "0")) == 0:
        Path(path).write_text(json.dumps(data))


def group_file(name: str) -> Path:
    return Path(os.environ["MEMGUARD_BENCH_CGROUP"]) / name


def work_runtime(case: dict) -> None:
    import torch
    import torch.distributed as dist
    # The import is the measurement: a trainer imports its model's class, which loads the
    # modelling code transformers' lazy top-level import leaves out.
    from transformers import LlamaForCausalLM  # noqa: F401

    dist.init_process_group("gloo")
    dist.barrier()
    write_result(dict(usage_after_init=int(group_file("memory.usage_in_bytes").read_text())))
    dist.destroy_process_group()
    del torch


def work_load(case: dict) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    dist.barrier()
    before = int(group_file("memory.usage_in_bytes").read_text())
    kwargs = {} if case["dtype"] == "default" else {"dtype": getattr(torch, case["dtype"])}
    model = LlamaForCausalLM.from_pretrained(MODELS_DIR / case["checkpoint"], **kwargs)
    loaded_dtype = str(next(model.parameters()).dtype)
    # Weights loaded in the checkpoint's dtype stay backed by the file's mapped pages until read;
    # a GPU job reads every one (`model.to("cuda")`): read them, one tensor at a time.
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    dist.barrier()
    after = int(group_file("memory.usage_in_bytes").read_text())
    write_result(dict(loaded_dtype=loaded_dtype, usage_before_load=before, usage_after_load=after))
    dist.destroy_process_group()


class SyntheticTokens:
    """A tokenised dataset whose samples are made from their index: nothing is held in memory,
    so what the cgroup sees is the pipeline itself (workers, prefetched batches)."""

    def __init__(self, n: int, seq: int):
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 32000, (self.seq,), generator=g)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(self.seq, dtype=torch.long)}


def work_input(case: dict) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import LlamaForCausalLM  # noqa: F401  (a trainer has its model's code loaded)

    ds = SyntheticTokens(case["batch"] * 24, case["seq"])
    kwargs = dict(batch_size=case["batch"], num_workers=case["workers"], pin_memory=case["pin"])
    if case["workers"] > 0:
        kwargs["prefetch_factor"] = case["prefetch"]
    loader = DataLoader(ds, **kwargs)
    batch_bytes = 0
    for batch in loader:
        batch_bytes = sum(t.numel() * t.element_size() for t in batch.values())
        # A consumer slower than the workers, as a training step is: the prefetch queue fills.
        time.sleep(0.2)
    write_result(dict(batch_bytes=batch_bytes, pin_effective=torch.cuda.is_available()))


def work_save(case: dict) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **SHAPES[case["shape"]])
    out_dir = SCRATCH_DIR / f"save-{case['name']}"
    if rank == 0 and out_dir.exists():
        shutil.rmtree(out_dir)
    dist.barrier()
    hf = case["mode"].startswith("hf_")
    if hf:
        model = LlamaForCausalLM(cfg)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
    params = sum(p.numel() for p in model.parameters())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    dist.barrier()
    baseline = int(group_file("memory.usage_in_bytes").read_text())
    if rank == 0:
        group_file("memory.max_usage_in_bytes").write_text("0\n")
    dist.barrier()
    if hf:
        model.save_pretrained(out_dir, safe_serialization=case["mode"] == "hf_safetensors")
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        if case["mode"] == "sharded":
            import torch.distributed.checkpoint as dcp

            opts = StateDictOptions()
            state = {"model": get_model_state_dict(model, options=opts),
                     "optim": get_optimizer_state_dict(model, optim, options=opts)}
            dcp.save(state, checkpoint_id=str(out_dir))
        else:
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = {"model": get_model_state_dict(model, options=opts)}
            if case["mode"] == "full_with_optimizer":
                state["optim"] = get_optimizer_state_dict(model, optim, options=opts)
            if rank == 0:
                out_dir.mkdir(parents=True, exist_ok=True)
                torch.save(state, out_dir / "checkpoint.pt")
        del state
    dist.barrier()
    spike_peak = int(group_file("memory.max_usage_in_bytes").read_text())
    written = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file()) if rank == 0 else 0
    write_result(dict(params=params, train_baseline=baseline, save_peak=spike_peak,
                      spike=spike_peak - baseline, written_bytes=written))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
    dist.destroy_process_group()


WORKLOADS = {"runtime": work_runtime, "load": work_load, "input": work_input, "save": work_save}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="run the cases, append one JSON line per case to --out")
    s.add_argument("--out", required=True)
    s.add_argument("--only", nargs="*", help="run the cases whose name contains one of these")
    s.add_argument("--skip", nargs="*", help="leave out the cases of these exact names")
    s.add_argument("--list", action="store_true", help="print the case names and exit")
    w = sub.add_parser("worker", help="(internal) run one case's workload")
    w.add_argument("spec")
    args = parser.parse_args()
    if args.cmd == "sweep":
        if args.list:
            for c in cases():
                print(c["name"])
            return
        sweep(args)
    else:
        case = json.loads(args.spec)
        WORKLOADS[case["kind"]](case)


if __name__ == "__main__":
    main()
