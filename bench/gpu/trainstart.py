#!/usr/bin/env python3
"""The train-start plan and the growth back on a real GPU (issue 37, "in any session that is
lent a device"): one real HF ``Trainer`` on a random-initialised Llama-architecture model (built
from its config: nothing is downloaded), attached to the real ``memguard-sidecar`` binary over
loopback.

The sidecar is started with a per-device budget (``--train-start budget-bytes=…``, what
admission passes for a GPU trainer) below what the configured micro-batch needs, so the
train-start plan shrinks it before the first step (the effective batch kept by accumulation).
Then the client reports CUDA's ``max_memory_reserved`` each step, and the sidecar grows the
micro-batch back toward the configured one while the measured peaks fit the device with the
policy's margin. Every step's micro-batch and CUDA figures, the plan and the growths go to
``OUT/gpu-trainstart.json``.

    python3 bench/gpu/trainstart.py --out OUT --sidecar target/debug/memguard-sidecar

Needs torch with CUDA and transformers (the device machine has both: no pip, no network).
Without a CUDA device it exits 3 with a message and writes nothing: the GPU path cannot run on
a machine without one (tests: ``bench/gpu/test_measure.py``, the CPU-side logic only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "clients" / "python" / "src"))

from measure import SHAPES, model_config_json  # noqa: E402

GIB = 1 << 30
#: Exit status when this machine has no CUDA device.
NO_GPU = 3
RESULT = "gpu-trainstart.json"
#: The webhook's policy for a GPU trainer (the default floors, quality rungs off), plus the
#: budget this run forces.
POLICY = ("budget-bytes={budget},safety-ratio=0.9,estimate-level=0.95,allow-quality=0,"
          "floor-batch-size=1,floor-seq-length=256,floor-lora-rank=4,floor-lora-layers=1")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"`{text}` is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"`{text}` is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", HERE / "out")),
                   help="where gpu-trainstart.json is written (default $OUT, else bench/gpu/out)")
    p.add_argument("--sidecar", type=Path,
                   default=Path(os.environ.get("MEMGUARD_SIDECAR_BIN",
                                               ROOT / "target" / "debug" / "memguard-sidecar")),
                   help="the memguard-sidecar binary")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b-shape")
    p.add_argument("--batch", type=positive_int, default=16, help="configured micro-batch")
    p.add_argument("--seq", type=positive_int, default=1024, help="tokens per row")
    p.add_argument("--steps", type=positive_int, default=40, help="optimizer steps")
    # `memguard estimate` (bf16, AdamW, SDPA) for the 1B shape at 1024 tokens: upper bound
    # 34.2 GB at 4 rows, 54.6 GB at 8, 95.3 GB at 16; 40 GiB (42.9 GB) fits 4, not 8.
    p.add_argument("--budget-gib", type=positive_float, default=40.0,
                   help="the per-device budget the plan is checked against (admission's "
                        "`budget-bytes`, the safety ratio applied): below the configured "
                        "micro-batch's need, it forces the shrink")
    return p.parse_args(argv)


def cuda_missing() -> Optional[str]:
    """Why this machine cannot run the measurement, or None when it can."""
    try:
        import torch
    except ImportError as exc:
        return f"torch does not import ({exc})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def summarize(configured: int, steps: List[Dict[str, Any]], summary: Dict[str, Any]) -> Dict[str, Any]:
    """What the run showed: the plan's micro-batch, whether it shrank the configured one and
    whether the micro-batch grew back after it, and the highest reserved memory at each
    micro-batch (CUDA's all-time peak at the last step run at it: the client never resets it)."""
    plan = summary.get("train_start") or {}
    planned = plan.get("batch_size") if plan.get("planned") else None
    ran = [s["micro_batch"] for s in steps if isinstance(s.get("micro_batch"), int)]
    reserved_at: Dict[str, int] = {}
    for s in steps:
        if isinstance(s.get("micro_batch"), int) and isinstance(s.get("max_reserved_bytes"), int):
            reserved_at[str(s["micro_batch"])] = s["max_reserved_bytes"]
    return {
        "configured_batch": configured,
        "planned_batch": planned,
        "shrunk": planned is not None and planned < configured,
        "grew": planned is not None and any(m > planned for m in ran),
        "first_micro_batch": ran[0] if ran else None,
        "last_micro_batch": ran[-1] if ran else None,
        "micro_batches": sorted(set(ran)),
        "max_reserved_bytes_at": reserved_at,
        "growths": summary.get("growths", 0),  # the summary leaves out a zero
        "downgrades": summary.get("downgrades"),
    }


def write_result(out: Path, result: Dict[str, Any]) -> Path:
    """``out/gpu-trainstart.json``, written whole (a temporary file renamed over it)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULT
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stand_in_cgroup(path: Path) -> Path:
    """A cgroup v2 directory the sidecar watches: the device machine's own cgroup is not ours
    to read, and this run's memory is the GPU's, which the client reports. Its host figures are
    fixed and roomy, so only the device figures move the micro-batch."""
    files = {
        "memory.current": f"{GIB}\n", "memory.max": f"{64 * GIB}\n", "memory.high": "max\n",
        "memory.peak": f"{GIB}\n",
        "memory.stat": "anon 0\nfile 0\ninactive_file 0\nactive_file 0\n",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "cgroup.events": "populated 1\nfrozen 0\n",
        "memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                           "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    }
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def run_on_gpu(a: argparse.Namespace, work: Path) -> Dict[str, Any]:
    import torch
    import transformers

    from memguard_client import Guard
    from memguard_client.hf import attach

    api, prom = free_port(), free_port()
    budget = int(a.budget_gib * GIB)
    (work / "pressure").mkdir(parents=True)
    (work / "pressure" / "memory").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                                              "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    sidecar_cmd = [str(a.sidecar), "--cgroup", str(stand_in_cgroup(work / "cg")),
                   "--proc-root", str(work),  # no host PSI: only the device figures count
                   "--signal-file", str(work / "signal.json"),
                   "--termination-log", str(work / "summary.json"),
                   "--listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{prom}",
                   "--interval", "100ms", "--log-format", "json", "--exit-when-empty", "false",
                   "--train-start", POLICY.format(budget=budget), "--grow-back", "true"]
    log = open(work / "sidecar.log", "w")
    side = subprocess.Popen(sidecar_cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=5).read()
            break
        except OSError:
            if side.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not start; see {work / 'sidecar.log'}")
            time.sleep(0.1)

    shape = SHAPES[a.shape]
    cfg = transformers.LlamaConfig(**{k: v for k, v in model_config_json(shape).items()
                                      if k not in ("architectures", "model_type", "torch_dtype")})
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", **{dtype_kw: torch.bfloat16}).to("cuda")
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, shape.vocab_size, (a.batch * a.steps, a.seq))]
    steps: List[Dict[str, Any]] = []
    started = time.monotonic()

    class Record(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.cuda.synchronize()
            steps.append({
                "step": int(state.global_step),
                "micro_batch": mg.runner.size,
                "grad_accumulation": mg.guard.grad_accumulation,
                "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
                "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                "reserved_bytes": int(torch.cuda.memory_reserved()),
                "seconds": round(time.monotonic() - started, 3),
            })

    targs = transformers.TrainingArguments(
        output_dir=str(work / "out"), per_device_train_batch_size=a.batch, max_steps=a.steps,
        bf16=True, optim="adamw_torch", learning_rate=1e-5, save_strategy="no",
        logging_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=rows, callbacks=[Record()])
    mg = attach(trainer, Guard(sidecar_url=f"http://127.0.0.1:{api}", env={}))
    error = None
    try:
        trainer.train()
    except Exception as exc:  # recorded: a failed run is a result too
        error = f"{type(exc).__name__}: {exc}"[:2000]
    with urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=5) as r:
        metrics = [line for line in r.read().decode().splitlines()
                   if line.startswith(("memguard_sidecar_train_start", "memguard_sidecar_growth",
                                       "memguard_sidecar_downgrades", "memguard_sidecar_trainer_config"))]
    side.terminate()
    side.wait(timeout=30)
    log.close()
    summary = json.loads((work / "summary.json").read_text())
    events = [json.loads(line) for line in (work / "sidecar.log").read_text().splitlines()
              if line.startswith("{") and ("signal" in line or "train-start" in line)]
    return {
        "error": error,
        "steps": steps,
        "sidecar_summary": summary,
        "sidecar_events": events[-200:],
        "metrics": metrics,
        "device": torch.cuda.get_device_name(),
        "device_memory_bytes": int(torch.cuda.get_device_properties(0).total_memory),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    why = cuda_missing()
    if why is not None:
        print(f"trainstart.py: {why}: this measurement runs on a GPU machine only "
              "(bench/gpu/README.md); nothing written", file=sys.stderr)
        return NO_GPU
    if not a.sidecar.is_file():
        print(f"trainstart.py: no sidecar binary at {a.sidecar}: cargo build -p memguard-sidecar "
              "and carry it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="memguard-gpu-") as tmp:
        run = run_on_gpu(a, Path(tmp))
    result = {
        "shape": a.shape, "seq": a.seq, "steps_asked": a.steps, "budget_bytes": int(a.budget_gib * GIB),
        "outcome": summarize(a.batch, run["steps"], run["sidecar_summary"]), **run,
    }
    path = write_result(a.out, result)
    print(json.dumps(result["outcome"], sort_keys=True))
    print(f"trainstart.py: wrote {path}")
    return 0 if run["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
