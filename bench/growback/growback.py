"""Grow-back, measured (issue 37, item 5): a real HF ``Trainer`` configured at 16 × 1, admitted
at 2 × 8 under a roomy real cgroup v1 limit, with the real ``memguard-sidecar`` watching it,
grows back to 16; its wall time and final parameters are compared with the same run unguarded
at 16 × 1.

Arms, each in a fresh cgroup ``/sys/fs/cgroup/memory/memguard-growback-<pid>-<arm>-<i>`` limited
to ``--limit-mib``:

* ``plain``: the trainer alone, at 16 × 1;
* ``guarded``: the trainer attached to memguard, starting at 2 × 8, the sidecar at
  ``--interval`` with its default growth settings (``--grow-window`` overrides the window).

Runs alternate (plain, guarded, plain, …) so machine load hits both alike; the report gives the
median train time of each arm, their ratio, the load average before and after, and whether every
guarded run grew back to 16 with parameters equal to the plain run's.

    sudo python3 bench/growback/growback.py --runs 5 --out /tmp/growback

``--world-size 2`` runs each arm under ``torchrun`` (gloo) with both ranks in the cgroup and one
sidecar: the ranks must grow at the same step. Needs root and a writable cgroup v1 memory
controller (exits 77 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "bench" / "survival"))
import survival  # noqa: E402  (its cgroup, sidecar and port helpers)

CLIENT_SRC = REPO / "clients" / "python" / "src"


def trainer_command(args: argparse.Namespace, out: Path, guarded: bool) -> List[str]:
    script = [str(HERE / "trainer.py"), "--out", str(out), "--samples", str(args.samples),
              "--seq", str(args.seq), "--layers", str(args.layers), "--width", str(args.width)]
    if guarded:
        script.append("--guarded")
    if args.world_size > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={args.world_size}", *script]
    return [sys.executable, *script]


def run_arm(args: argparse.Namespace, sidecar: Optional[Path], out: Path, name: str, guarded: bool) -> Dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    cg = survival.Cgroup(f"memguard-growback-{os.getpid()}-{name}", args.limit_mib << 20)
    side = None
    env = survival.base_env()
    env["PYTHONPATH"] = str(CLIENT_SRC)
    try:
        if guarded:
            assert sidecar is not None
            api, prom = survival.free_port(), survival.free_port()
            env.update(MEMGUARD_SIDECAR_URL=f"http://127.0.0.1:{api}", MEMGUARD_BATCH_SIZE="2",
                       MEMGUARD_GRAD_ACCUMULATION="8")
            cmd = [str(sidecar), "--cgroup", str(cg.path), "--signal-file", str(out / "signal.json"),
                   "--termination-log", str(out / "summary.json"),
                   "--listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{prom}",
                   "--interval", args.interval, "--log-format", "json", "--reset-v1-peak", "true",
                   "--batch-size", "2", "--grad-accumulation", "8",
                   "--admitted-config", "batch-size=2,grad-accumulation=8"]
            if args.grow_window:
                cmd += ["--grow-window", args.grow_window]
            side = subprocess.Popen(cmd, stdout=open(out / "sidecar.log", "w"), stderr=subprocess.STDOUT)
            wait_listening(api, side)
        code, wall = survival.run_trainer_in(cg, trainer_command(args, out, guarded), env, args.timeout)
        result: Dict[str, Any] = {"exit_code": code, "wall_seconds": wall,
                                  "peak_bytes": int(cg.read("memory.max_usage_in_bytes")),
                                  "oom_kill": cg.oom_kills()[0]}
    finally:
        if side is not None:
            try:
                side.wait(timeout=20)  # it exits by itself once the cgroup empties
            except subprocess.TimeoutExpired:
                side.terminate()
                side.wait(timeout=20)
        cg.remove()
    ranks = []
    for rank in range(args.world_size):
        path = out / f"run-{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    result["ranks"] = ranks
    summary = out / "summary.json"
    result["summary"] = json.loads(summary.read_text()) if guarded and summary.exists() else None
    return result


def wait_listening(port: int, side: "subprocess.Popen[bytes]") -> None:
    import urllib.request

    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read()
            return
        except OSError:
            if side.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the sidecar did not start listening")
            time.sleep(0.1)


def max_param_diff(a: Path, b: Path) -> float:
    import torch

    wa, wb = torch.load(a), torch.load(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="memguard grow-back benchmark (real cgroup v1, real sidecar, real HF Trainer)")
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sidecar", default=None)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--limit-mib", type=int, default=4096)
    p.add_argument("--interval", default="100ms")
    p.add_argument("--grow-window", default=None, help="the sidecar's --grow-window (default: its own)")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    reason = survival.skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        return survival.SKIP
    sidecar = Path(args.sidecar) if args.sidecar else survival.find_sidecar(None)
    if sidecar is None:
        print("no memguard-sidecar binary: cargo build -p memguard-sidecar", file=sys.stderr)
        return 2
    out = Path(args.out)
    runs: Dict[str, List[Dict[str, Any]]] = {"plain": [], "guarded": []}
    load_before = os.getloadavg()
    for i in range(args.runs):
        for name, guarded in (("plain", False), ("guarded", True)):
            r = run_arm(args, sidecar, out / f"{name}-{i}", f"{name}-{i}", guarded)
            if guarded:
                plain = out / f"plain-{i}"
                r["max_param_diff"] = max(
                    max_param_diff(plain / f"weights-{k}.pt", out / f"guarded-{i}" / f"weights-{k}.pt")
                    for k in range(args.world_size))
            runs[name].append(r)
            print(json.dumps({"arm": name, "run": i, "wall_seconds": round(r["wall_seconds"], 2),
                              "train_seconds": [round(x["train_seconds"], 2) for x in r["ranks"] if x],
                              "sizes_seen": sorted({s for x in r["ranks"] if x for s in x["sizes"]}),
                              "max_param_diff": r.get("max_param_diff")}), flush=True)
    load_after = os.getloadavg()

    def median_train(name: str) -> float:
        return statistics.median(max(x["train_seconds"] for x in r["ranks"]) for r in runs[name])

    plain_s, guarded_s = median_train("plain"), median_train("guarded")
    report = {
        "runs": args.runs, "samples": args.samples, "world_size": args.world_size,
        "cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after,
        "plain_median_train_seconds": plain_s, "guarded_median_train_seconds": guarded_s,
        "ratio": guarded_s / plain_s,
        "ratios_per_run": [max(x["train_seconds"] for x in g["ranks"]) / max(x["train_seconds"] for x in q["ranks"])
                           for g, q in zip(runs["guarded"], runs["plain"])],
        "all_grew_to_16": all(r["ranks"] and all(x and x["sizes"] and x["sizes"][-1] == 16 for x in r["ranks"])
                              for r in runs["guarded"]),
        "max_param_diff": max(r["max_param_diff"] for r in runs["guarded"]),
        "growths": [r["summary"].get("growths", 0) if r["summary"] else None for r in runs["guarded"]],
    }
    (out / "results.json").write_text(json.dumps({"report": report, "runs": runs}, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
