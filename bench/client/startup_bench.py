#!/usr/bin/env python3
"""Interpreter start-up with and without the injected client (goal: <= 20 ms added).

    python3 bench/client/startup_bench.py [--runs 40] [--memguard target/debug/memguard]

Lays the client out as the webhook's init container does (``memguard client install DIR`` when
the binary is given or built, else the same files copied from the source tree), then starts
``python3 -c pass`` alternately without and with ``PYTHONPATH=DIR`` and the pod's ``MEMGUARD_*``
env, ``--runs`` times each, and prints the median and 90th percentile wall time of each and the
median difference. Two "with" variants: the client's directory read-only as the pod mounts it
(no bytecode cache: every start compiles the hook), and writable (cached bytecode).
Also times ``import transformers`` + touching ``transformers.Trainer`` with and without the hook
(``--transformers``), where the hook wraps ``Trainer.train``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]


def install(dest: Path, memguard: str) -> str:
    if memguard and Path(memguard).is_file():
        subprocess.run([memguard, "client", "install", str(dest)], check=True, capture_output=True)
        return f"{memguard} client install"
    client = REPO / "clients" / "python"
    shutil.copytree(client / "src" / "memguard_client", dest / "memguard_client",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(client / "inject" / "sitecustomize.py", dest / "sitecustomize.py")
    return "copied from clients/python"


def wall(cmd: List[str], env: Dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - t0) * 1000


def stats(xs: List[float]) -> str:
    s = sorted(xs)
    return f"median {statistics.median(s):6.1f} ms, p90 {s[int(len(s) * 0.9)]:6.1f} ms"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--memguard", default=str(REPO / "target" / "debug" / "memguard"))
    p.add_argument("--transformers", action="store_true")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="memguard-startup-"))
    try:
        how = install(tmp / "client", a.memguard)
        base = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_") and k != "PYTHONPATH"}
        pod = dict(base, MEMGUARD_SIGNAL_FILE="/var/run/memguard/signal.json",
                   MEMGUARD_SIDECAR_URL="http://127.0.0.1:9091", MEMGUARD_BATCH_SIZE="8")
        variants = {
            "without": base,
            "with, read-only (as mounted)": dict(pod, PYTHONPATH=str(tmp / "client"),
                                                 PYTHONDONTWRITEBYTECODE="1"),
            "with, bytecode cached": dict(pod, PYTHONPATH=str(tmp / "client")),
        }
        programs = {"python -c pass": [sys.executable, "-c", "pass"]}
        if a.transformers:
            programs["import transformers.Trainer"] = [
                sys.executable, "-c", "import transformers; transformers.Trainer"]
        print(f"client: {how}; {a.runs} runs each, interleaved; python {sys.version.split()[0]}; "
              f"load {os.getloadavg()[0]:.1f}")
        for prog, cmd in programs.items():
            for env in variants.values():  # warm the page cache and the bytecode cache
                wall(cmd, env)
            times: Dict[str, List[float]] = {k: [] for k in variants}
            for _ in range(a.runs):
                for name, env in variants.items():
                    times[name].append(wall(cmd, env))
            for name, xs in times.items():
                print(f"{prog:30} {name:30} {stats(xs)}")
            ref = statistics.median(times["without"])
            for name in list(variants)[1:]:
                print(f"{prog:30} added ({name}): {statistics.median(times[name]) - ref:+.1f} ms (median)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
