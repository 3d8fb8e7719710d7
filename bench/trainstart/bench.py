#!/usr/bin/env python3
"""Cost of the plan at train start (issue 37, item 7): the client's report of the real config,
the sidecar's decision and its reply, as wall time at the client.

Each run starts a fresh `memguard-sidecar` binary (the decision is made once per sidecar) on
loopback, watching a cgroup v2 tree this script writes (a 2 GiB limit), with the settings the
webhook writes for a CPU trainer, and a 1 s sampling interval (the report wakes the sidecar:
the reply must not wait for a tick). The config is read from a real tiny Llama and real
`TrainingArguments` (as the HF adapter does at the first training step), then
`Guard.plan_at_train_start` is timed. Prints one JSON object: per-run times in ms, median, p90.

    python3 bench/trainstart/bench.py [--runs 30] [--sidecar target/debug/memguard-sidecar]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python" / "src"))

from memguard_client import Guard  # noqa: E402
from memguard_client.train_config import first_batch, trainer_config  # noqa: E402

MIB = 1 << 20
TRAIN_START = ("safety-ratio=0.9,estimate-level=0.95,allow-quality=0,floor-batch-size=1,"
               "floor-seq-length=256,floor-lora-rank=4,floor-lora-layers=1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def v2_tree(cg: Path, limit: int) -> None:
    cg.mkdir(parents=True)
    for name, text in {
        "memory.current": f"{300 * MIB}\n", "memory.max": f"{limit}\n", "memory.high": "max\n",
        "memory.peak": f"{300 * MIB}\n",
        "memory.stat": "anon 0\nfile 0\ninactive_file 0\nactive_file 0\n",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "cgroup.events": "populated 1\nfrozen 0\n",
    }.items():
        (cg / name).write_text(text)


def the_config() -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    config = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16,
                             use_cpu=True, report_to=[])
    started = time.perf_counter()
    knobs = trainer_config(args, model, None)
    knobs.update(first_batch({"input_ids": torch.zeros(16, 256, dtype=torch.long)}))
    return {"knobs": knobs, "read_ms": (time.perf_counter() - started) * 1000}


def one_run(sidecar: str, knobs: dict, tmp: Path) -> dict:
    cg = tmp / "cg"
    v2_tree(cg, 2048 * MIB)
    api, prom = free_port(), free_port()
    proc = subprocess.Popen(
        [sidecar, "--cgroup", str(cg), "--proc-root", str(tmp / "proc"),
         "--signal-file", str(tmp / "signal.json"), "--termination-log", str(tmp / "term"),
         "--listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{prom}",
         "--interval", "1s", "--log-format", "text", "--exit-when-empty", "false",
         "--grow-back", "false", "--train-start", TRAIN_START],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{prom}/healthz", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the sidecar did not listen")
                time.sleep(0.05)
        guard = Guard(signal_file="", sidecar_url=f"http://127.0.0.1:{api}", env={},
                      background=False, oom_hook=False)
        started = time.perf_counter()
        decision = guard.plan_at_train_start(knobs)
        elapsed = (time.perf_counter() - started) * 1000
        assert decision is not None and decision["planned"], decision
        assert guard.batch_size == decision["batch_size"], (guard.batch_size, decision)
        return {"ms": elapsed, "batch_size": decision["batch_size"]}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--sidecar", default=str(ROOT / "target" / "debug" / "memguard-sidecar"))
    a = p.parse_args()
    read = the_config()
    times, batches = [], set()
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as d:
            run = one_run(a.sidecar, read["knobs"], Path(d))
        times.append(run["ms"])
        batches.add(run["batch_size"])
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    print(json.dumps({
        "runs": a.runs, "sidecar": a.sidecar, "planned_batch_sizes": sorted(batches),
        "read_config_ms": round(read["read_ms"], 2),
        "plan_ms_median": round(statistics.median(times), 2), "plan_ms_p90": round(p90, 2),
        "plan_ms_max": round(max(times), 2), "plan_ms": [round(t, 2) for t in times],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
