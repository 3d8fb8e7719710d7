#!/usr/bin/env python3
"""Our own GPU truth: the peak memory of a few real training steps, next to `memguard estimate`.

Random-initialised Hugging Face models built from a config (nothing is downloaded) train for a
few steps with full fine-tuning, LoRA (peft) and, when bitsandbytes imports, QLoRA. For each case
it records `torch.cuda.max_memory_allocated()`, `torch.cuda.max_memory_reserved()` and the NVML
peak of the device (sampled), and runs `memguard estimate` for the same config. Cases with
variable-length padded batches, packed batches, and with and without
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` measure the allocator's fragmentation
(`docs/accuracy.md`, "Reserved memory and fragmentation").

Each case runs in its own process (a fresh CUDA context; the allocator setting is read when torch
starts). `all` writes, under --out:

* `cases.jsonl`: one JSON object per case (config, figures, the estimate, versions);
* `gpu-measured.csv`: the rows in `bench/accuracy/collected/`'s columns, three per case (allocated
  as `tensor_peak`, reserved as `reserved`, NVML as `total`), ready to commit as a source.

    python3 bench/gpu/measure.py all --device cuda --out OUT --memguard target/release/memguard
    python3 bench/gpu/measure.py all --device cpu --tiny --out OUT --memguard target/debug/memguard

`--device cpu --tiny` runs the same code path on tiny configs (the CPU rehearsal the tests run);
its figure is the process's peak RSS, and its rows are not a source.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"
SOURCE_GROUP = "U-memguard-gpu"
# The columns of bench/accuracy/collected/*.csv.
COLUMNS = (
    "id,source_group,model,params,hidden_size,num_layers,num_heads,num_kv_heads,"
    "intermediate_size,vocab_size,ffn_gated,num_experts,experts_per_token,model_bits,precision,"
    "method,lora_rank,lora_targets,lora_layers,optimizer,batch_size,grad_accumulation,seq_length,"
    "grad_checkpointing,flash_attention,parallelism,world_size,device,device_memory_bytes,outcome,"
    "measured_bytes,compare_to,trust,notes,head_dim,tie_embeddings,split"
).split(",")


@dataclass
class Shape:
    """A Llama-architecture model (transformers' `LlamaConfig`): gated MLP, RoPE, RMSNorm."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool


# Llama 3.2 1B's shape and Qwen2.5 1.5B's widths on the Llama architecture (no QKV bias):
# small enough for a few cases a minute on one H100, big enough that the CUDA context is not
# most of the figure.
SHAPES = {
    "llama-3.2-1b-shape": Shape("llama-3.2-1b-shape", 2048, 16, 32, 8, 8192, 128256, True),
    "qwen2.5-1.5b-shape": Shape("qwen2.5-1.5b-shape", 1536, 28, 12, 2, 8960, 151936, True),
    "tiny": Shape("tiny", 64, 2, 4, 2, 128, 256, False),
}


@dataclass
class Case:
    """One training config to measure."""

    name: str
    shape: str
    method: str  # full | lora | qlora
    batch: int
    seq: int
    checkpointing: bool = False
    spread: float = 0.0  # (longest - shortest) / longest of the padded batch lengths
    packing: bool = False
    expandable: bool = False
    steps: int = 6
    lora_rank: int = 16
    # "uniform": within `spread`, the longest last; "ms-swift": ms-swift's benchmark data
    # (lengths 3,234 ± 2,547 tokens, cut at 91 and `seq`), in the order drawn.
    lengths: str = "uniform"

    def alloc_conf(self) -> str:
        # Expandable segments off is stated, not left unset, so the estimate and the run agree.
        return EXPANDABLE if self.expandable else "expandable_segments:False"


def gpu_cases() -> List[Case]:
    """About 8 minutes on one H100 (model build, a few steps and the estimate per case); every
    case's estimate is below 80 GB (the largest about 50 GB)."""
    llama, qwen = "llama-3.2-1b-shape", "qwen2.5-1.5b-shape"
    return [
        Case("llama-full-b4-s1024", llama, "full", 4, 1024),
        Case("llama-full-b4-s2048-ckpt", llama, "full", 4, 2048, checkpointing=True),
        Case("llama-lora-b8-s1024", llama, "lora", 8, 1024),
        Case("llama-lora-b4-s2048-ckpt", llama, "lora", 4, 2048, checkpointing=True),
        Case("llama-qlora-b8-s1024", llama, "qlora", 8, 1024),
        Case("qwen-full-b2-s2048", qwen, "full", 2, 2048),
        Case("qwen-lora-b4-s1024", qwen, "lora", 4, 1024),
        Case("qwen-qlora-b2-s2048", qwen, "qlora", 2, 2048),
        # Fragmentation: the same LoRA run padded to varying lengths, packed, with and without
        # expandable segments.
        Case("llama-lora-b2-s4096-even", llama, "lora", 2, 4096, steps=8),
        Case("llama-lora-b2-s4096-spread", llama, "lora", 2, 4096, spread=0.75, steps=8),
        Case("llama-lora-b2-s4096-spread-exp", llama, "lora", 2, 4096, spread=0.75, steps=8,
             expandable=True),
        Case("llama-lora-b2-s4096-packed", llama, "lora", 2, 4096, spread=0.75, packing=True,
             steps=8),
    ]


def reserve_cases() -> List[Case]:
    """Issue 38's open question (docs/accuracy.md, "What is left on set 2"): does the caching
    allocator's reserve over a variable-length run follow the length and the vocabulary, as
    ms-swift's Qwen rows suggest? Qwen2.5 1.5B's widths (its 151,936-token vocabulary), LoRA,
    one row a step, lengths drawn as ms-swift's benchmark draws them, at three caps; the 4,096
    cap again with expandable segments (the control: no fragmentation). Each step's reserved
    and allocated memory is kept (`per_step`). About 3 minutes on one H100."""
    qwen = "qwen2.5-1.5b-shape"
    return [
        Case("qwen-lora-b1-s1024-msswift", qwen, "lora", 1, 1024, steps=40, lengths="ms-swift"),
        Case("qwen-lora-b1-s2048-msswift", qwen, "lora", 1, 2048, steps=40, lengths="ms-swift"),
        Case("qwen-lora-b1-s4096-msswift", qwen, "lora", 1, 4096, steps=40, lengths="ms-swift"),
        Case("qwen-lora-b1-s4096-msswift-exp", qwen, "lora", 1, 4096, steps=40,
             lengths="ms-swift", expandable=True),
        Case("qwen-lora-b1-s4096-even", qwen, "lora", 1, 4096, steps=40),
    ]


#: ms-swift's benchmark lengths (`scripts/benchmark/test_memory_time`, docs/accuracy.md).
MS_SWIFT_LENGTH_MEAN, MS_SWIFT_LENGTH_SD, MS_SWIFT_LENGTH_MIN = 3234.0, 2547.0, 91


def tiny_cases() -> List[Case]:
    """The CPU rehearsal: the same code path, seconds in all."""
    return [
        Case("tiny-full", "tiny", "full", 2, 32, steps=2),
        Case("tiny-lora", "tiny", "lora", 2, 32, steps=2, lora_rank=4),
        Case("tiny-lora-spread", "tiny", "lora", 2, 32, spread=0.5, steps=3, lora_rank=4),
        Case("tiny-lora-msswift", "tiny", "lora", 1, 32, steps=3, lora_rank=4, lengths="ms-swift"),
    ]


def batch_lengths(case: Case, seed: int = 0) -> List[int]:
    """The padded length of each step's batch: the sequence length when packed or even; else
    uniform between (1 - spread) * seq and seq, with the longest batch last so the peak sees
    every shorter shape first (what fragments the allocator). `lengths="ms-swift"`: drawn as
    ms-swift's benchmark draws them, cut at `seq`, in the order drawn."""
    if case.lengths == "ms-swift":
        rng = random.Random(seed)
        low = min(MS_SWIFT_LENGTH_MIN, case.seq)
        return [
            min(case.seq, max(low, round(rng.gauss(MS_SWIFT_LENGTH_MEAN, MS_SWIFT_LENGTH_SD))))
            for _ in range(case.steps)
        ]
    if case.lengths != "uniform":
        raise ValueError(f"{case.name}: lengths {case.lengths!r} is neither uniform nor ms-swift")
    if case.packing or case.spread == 0.0:
        return [case.seq] * case.steps
    rng = random.Random(seed)
    shortest = max(1, int(case.seq * (1.0 - case.spread)))
    lengths = [rng.randint(shortest, case.seq) for _ in range(case.steps - 1)]
    return lengths + [case.seq]


def spread_of(case: Case) -> float:
    """(longest - shortest) / longest of the run's batch lengths, as the estimate takes it: the
    case's own `spread` for uniform lengths, that of the lengths drawn otherwise."""
    if case.lengths == "uniform":
        return case.spread
    lengths = batch_lengths(case)
    return round((max(lengths) - min(lengths)) / max(lengths), 3)


def model_config_json(shape: Shape) -> Dict[str, object]:
    """The Hugging Face `config.json` of `shape` (Llama architecture), for transformers and for
    `memguard estimate --model-config`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
    }


def estimate_args(case: Case, config_path: Path, device: str) -> List[str]:
    """`memguard estimate` flags describing `case` as it runs in `run_case`."""
    args = [
        "estimate",
        "--model-config", str(config_path),
        "--method", case.method,
        # Weights (and, under full fine-tuning, gradients and AdamW states) in bf16; CPU in fp32.
        "--precision", "bf16" if device == "cuda" else "fp32",
        "--optimizer", "adamw",
        "--batch-size", str(case.batch),
        "--seq-length", str(case.seq),
        "--grad-checkpointing", "true" if case.checkpointing else "false",
        "--flash-attention", "true" if device == "cuda" else "false",
        "--device", device,
        "--seq-length-spread", "0" if case.packing else str(spread_of(case)),
        "--packing", "true" if case.packing else "false",
        "--output", "json",
    ]
    if device == "cuda":
        args += ["--pytorch-cuda-alloc-conf", case.alloc_conf()]
    if case.method != "full":
        args += ["--lora-rank", str(case.lora_rank), "--lora-targets", "q,v"]
    return args


def memguard_estimate(memguard: str, case: Case, config_path: Path, device: str) -> Dict:
    out = subprocess.run(
        [memguard] + estimate_args(case, config_path, device),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"memguard estimate failed ({out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout)


class NvmlPeak:
    """Samples the device's used memory (NVML, else nvidia-smi) until stopped; the peak."""

    def __init__(self, index: int = 0, interval_s: float = 0.02):
        self.peak = 0
        self.baseline: Optional[int] = None
        self._stop = threading.Event()
        self._read = self._reader(index)
        self._interval = interval_s
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def _reader(index: int):
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:  # noqa: BLE001 - no NVML binding: nvidia-smi, slower
            if shutil.which("nvidia-smi") is None:
                return None

            def smi() -> int:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                     "-i", str(index)],
                    capture_output=True, text=True, timeout=10,
                )
                return int(out.stdout.strip().splitlines()[0]) * 1024 * 1024

            return smi

    def available(self) -> bool:
        return self._read is not None

    def start(self) -> None:
        if self._read is None:
            return
        self.baseline = self._read()

        def loop() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, self._read())
                self._stop.wait(self._interval)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.peak = max(self.peak, self._read())


def run_case(case: Case, device: str, config_path: Path) -> Dict[str, object]:
    """Builds the model from its config, trains `case.steps` steps, returns the figures. Runs in
    its own process: `PYTORCH_CUDA_ALLOC_CONF` must be set before torch starts."""
    nvml = NvmlPeak() if device == "cuda" else None
    if nvml is not None:
        nvml.start()  # before torch touches the device: the process's CUDA context counts
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.from_pretrained(config_path.parent)
    # transformers 5 names the argument `dtype`; 4.x `torch_dtype`.
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    attn = "sdpa" if device == "cuda" else "eager"
    skipped = None
    if case.method == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001
            skipped = f"bitsandbytes does not import: {e}"
    if skipped:
        if nvml is not None:
            nvml.stop()
        return {"skipped": skipped}

    if case.method == "qlora":
        # Quantization happens at load: save the random weights, load them back in 4 bits.
        with tempfile.TemporaryDirectory() as tmp:
            model = transformers.AutoModelForCausalLM.from_config(cfg, **{dtype_kw: dtype})
            model.save_pretrained(tmp)
            del model
            bnb = transformers.BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=dtype,
            )
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, quantization_config=bnb, attn_implementation=attn, device_map={"": 0},
                **{dtype_kw: dtype},
            )
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=attn, **{dtype_kw: dtype}
        ).to(device)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.config.use_cache = False
    if case.method in ("lora", "qlora"):
        import peft

        lora = peft.LoraConfig(
            r=case.lora_rank, lora_alpha=2 * case.lora_rank, lora_dropout=0.0,
            target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
        )
        if case.checkpointing:
            model.enable_input_require_grads()
        model = peft.get_peft_model(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    model.train()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    lengths = batch_lengths(case)
    per_step: List[Dict[str, int]] = []
    for length in lengths:
        ids = torch.randint(0, cfg.vocab_size, (case.batch, length), device=device)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del out
        if device == "cuda":
            # What the reserve does step by step: held after each step, and its peak so far.
            stats = torch.cuda.memory_stats()
            per_step.append({
                "length": length,
                "reserved": int(torch.cuda.memory_reserved()),
                "max_reserved": int(torch.cuda.max_memory_reserved()),
                "max_allocated": int(torch.cuda.max_memory_allocated()),
                "alloc_retries": int(stats.get("num_alloc_retries", 0)),
                "segments": int(stats.get("segment.all.current", 0)),
            })
    if device == "cuda":
        torch.cuda.synchronize()
    figures: Dict[str, object] = {
        "seconds": round(time.monotonic() - started, 2),
        "batch_lengths": lengths,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in params),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if per_step:
        figures["per_step"] = per_step
    try:
        import peft as _peft

        figures["peft"] = _peft.__version__
    except Exception:  # noqa: BLE001
        pass
    if device == "cuda":
        figures["max_memory_allocated"] = int(torch.cuda.max_memory_allocated())
        figures["max_memory_reserved"] = int(torch.cuda.max_memory_reserved())
        figures["gpu"] = torch.cuda.get_device_name(0)
        figures["device_memory"] = int(torch.cuda.get_device_properties(0).total_memory)
        assert nvml is not None
        nvml.stop()
        if nvml.available() and nvml.baseline is not None:
            figures["nvml_peak"] = nvml.peak
            figures["nvml_baseline"] = nvml.baseline
    else:
        # Linux reports ru_maxrss in KiB.
        figures["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return figures


def rows_for(result: Dict[str, object], shape: Shape, device: str, stamp: str) -> List[Dict]:
    """The collected-format rows of one measured case: one per figure it has."""
    case = result["case"]
    fig = result["figures"]
    est = result["estimate"]
    tags = []
    if case["spread"] and not case["packing"]:
        tags.append(f"[spread={case['spread']}]")
    if case.get("lengths", "uniform") != "uniform":
        tags.append(f"[lengths={case['lengths']}]")
    if case["packing"]:
        tags.append("[packing]")
    if device == "cuda" and case["expandable"]:
        tags.append("[expandable-segments]")
    base = {
        "source_group": SOURCE_GROUP,
        "model": shape.name,
        "params": fig.get("params", ""),
        "hidden_size": shape.hidden_size,
        "num_layers": shape.num_layers,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "ffn_gated": "true",
        "model_bits": "4" if case["method"] == "qlora" else "",
        "precision": "bf16" if device == "cuda" else "fp32",
        "method": case["method"],
        "lora_rank": case["lora_rank"] if case["method"] != "full" else "",
        "lora_targets": "q,v" if case["method"] != "full" else "",
        "optimizer": "adamw",
        "batch_size": case["batch"],
        "grad_accumulation": 1,
        "seq_length": case["seq"],
        "grad_checkpointing": str(case["checkpointing"]).lower(),
        "flash_attention": "true" if device == "cuda" else "false",
        "parallelism": "none",
        "world_size": 1,
        "device": device,
        "device_memory_bytes": fig.get("device_memory", ""),
        "outcome": "ok",
        "trust": "high",
        "head_dim": "",
        "tie_embeddings": str(shape.tie_embeddings).lower(),
        "split": "heldout",
    }
    versions = ", ".join(
        f"{k} {fig[k]}" for k in ("gpu", "torch", "transformers", "peft") if k in fig
    )
    note = (
        f"bench/gpu/measure.py, {stamp}: case {case['name']}, random-initialised "
        f"LlamaForCausalLM from config, {case['steps']} steps of AdamW, batch lengths "
        f"{fig['batch_lengths']}; {versions}; {ALLOC_CONF}={case['alloc_conf']}; "
        f"memguard estimate: total {est['total_bytes']}, tensor peak {est['tensor_peak_bytes']}, "
        f"upper {est['total_upper_bytes']}. Loss: transformers' ForCausalLMLoss (fp32 upcast)."
    )
    figures = (
        [("max_memory_allocated", "tensor_peak"), ("max_memory_reserved", "reserved")]
        if device == "cuda"
        else [("max_rss", "total")]
    )
    rows = []
    for key, compare in figures:
        if key not in fig:
            continue
        rows.append(dict(base, id=f"{case['name']}-{compare}", measured_bytes=fig[key],
                         compare_to=compare, notes=f"{note} Figure: {key}. {' '.join(tags)}"))
    if device == "cuda" and "nvml_peak" in fig:
        # The process's device footprint: the peak less what the device held before it started.
        rows.append(dict(base, id=f"{case['name']}-total",
                         measured_bytes=int(fig["nvml_peak"]) - int(fig["nvml_baseline"]),
                         compare_to="total",
                         notes=f"{note} Figure: NVML used, peak less the baseline before torch "
                               f"started. {' '.join(tags)}"))
    return rows


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = tiny_cases() if args.tiny else (reserve_cases() if args.group == "reserve" else gpu_cases())
    if args.only:
        cases = [c for c in cases if c.name in set(args.only.split(","))]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = ""
    stamp = f"{stamp}, memguard {commit or 'unknown commit'}, {platform.node()}"
    started = time.monotonic()
    rows: List[Dict] = []
    failed = 0
    with open(out / "cases.jsonl", "w") as log:
        for case in cases:
            elapsed = time.monotonic() - started
            shape = SHAPES[case.shape]
            result: Dict[str, object] = {"case": dict(asdict(case), alloc_conf=case.alloc_conf())}
            if elapsed > args.budget_s:
                result["skipped"] = f"time budget: {elapsed:.0f} s of {args.budget_s} s spent"
                log.write(json.dumps(result) + "\n")
                print(f"{case.name}: skipped ({result['skipped']})", flush=True)
                continue
            config_dir = out / "configs" / shape.name
            config_dir.mkdir(parents=True, exist_ok=True)
            config_path = config_dir / "config.json"
            config_path.write_text(json.dumps(model_config_json(shape), indent=2) + "\n")
            result["estimate"] = memguard_estimate(args.memguard, case, config_path, args.device)
            env = dict(os.environ)
            if args.device == "cuda":
                env[ALLOC_CONF] = case.alloc_conf()
            proc = subprocess.run(
                [sys.executable, __file__, "case", "--device", args.device,
                 "--config", str(config_path), "--case-json", json.dumps(asdict(case))],
                capture_output=True, text=True, env=env, timeout=args.case_timeout_s,
            )
            if proc.returncode != 0:
                failed += 1
                result["error"] = (proc.stderr or proc.stdout).strip()[-2000:]
                print(f"{case.name}: FAILED\n{result['error']}", flush=True)
            else:
                figures = json.loads(proc.stdout.strip().splitlines()[-1])
                if "skipped" in figures:
                    result["skipped"] = figures["skipped"]
                else:
                    result["figures"] = figures
                    rows.extend(rows_for(result, shape, args.device, stamp))
                print(f"{case.name}: {json.dumps(figures)} estimate total "
                      f"{result['estimate']['total_bytes']}", flush=True)
            log.write(json.dumps(result) + "\n")
            log.flush()
    with open(out / "gpu-measured.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)
    print(f"{len(rows)} rows in {out / 'gpu-measured.csv'}; {failed} case(s) failed; "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("all", help="measure every case and write the rows")
    a.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a.add_argument("--tiny", action="store_true", help="tiny configs (the CPU rehearsal)")
    a.add_argument("--out", required=True)
    a.add_argument("--memguard", default="target/release/memguard")
    a.add_argument("--only", help="comma-separated case names")
    a.add_argument("--group", choices=["main", "reserve"], default="main",
                   help="main: the estimate's cases; reserve: the variable-length reserve (issue 38)")
    a.add_argument("--budget-s", type=float, default=480.0,
                   help="start no case after this many seconds")
    a.add_argument("--case-timeout-s", type=float, default=240.0)
    c = sub.add_parser("case", help="(internal) one case, in its own process")
    c.add_argument("--device", choices=["cuda", "cpu"], required=True)
    c.add_argument("--config", required=True)
    c.add_argument("--case-json", required=True)
    args = parser.parse_args()
    if args.command == "all":
        if shutil.which(args.memguard) is None and not Path(args.memguard).is_file():
            print(f"measure: no memguard binary at {args.memguard}", file=sys.stderr)
            return 2
        return run_all(args)
    case = Case(**json.loads(args.case_json))
    print(json.dumps(run_case(case, args.device, Path(args.config))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
