#!/usr/bin/env python3
"""Back-to-back 2-rank runs of the stock HF trainer with the injected client, on a loaded
machine, counting the runs that do not exit 0.

    python3 bench/distributed/exit_stress.py --runs 200 --burners 2 [--agreement pipelined]

Each run is what ``tests/test_auto.py::test_two_ranks_under_torchrun_agree_on_every_step``
does: ``torchrun --standalone --nproc_per_node 2`` of ``bench/survival/stock_hf_trainer.py``
(gloo, CPU), the client first on ``PYTHONPATH`` as ``memguard client install`` lays it out,
each rank following its own signal file (rank 1's says 2 rows, rank 0's 8), so every step
runs the agreement. ``--burners`` processes spin on the CPU meanwhile: exit races show when
the ranks' threads are descheduled at the wrong moment.

``--sidecar`` serves the sidecar's HTTP API on loopback (``GET /v1/signal`` long-polls and
answers "no news", ``POST /v1/report`` takes every report) and gives the ranks its URL, so the
client's long-poll thread and its step reporter (``memguard_client.peaks``, which posts only with
a sidecar URL) run, and exit, as they do in a pod. The reports received are counted.

A run fails when torchrun exits non-zero, or when the ranks did not agree on every step (the
stress must not pass by training less). ``PYTHONFAULTHANDLER=1`` makes an aborting rank print
every Python thread's stack, kept for the first failures under ``--keep``. Prints one JSON
summary line (runs, failures, exit codes, seconds) and, with ``--json``, writes it there.
"""

from __future__ import annotations

import argparse
import http.server
import threading
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "clients" / "python"
STOCK = REPO / "bench" / "survival" / "stock_hf_trainer.py"


def signal(seq: int, batch: int) -> Dict[str, Any]:
    return {
        "version": 1, "seq": seq, "level": "downgrade", "batch_size": batch,
        "grad_accumulation": 1, "grad_checkpointing": False, "reason": "exit stress",
        "pressure": {"memory_ratio": 0.5}, "timestamp": "2026-11-29T00:00:00.000Z",
    }


def install(dest: Path) -> Path:
    """The directory ``memguard client install DEST`` writes, plus an image sitecustomize (chained
    by ours) that gives each rank its own signal file, as each pod has its own sidecar."""
    shutil.copytree(CLIENT / "src" / "memguard_client", dest / "client" / "memguard_client",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(CLIENT / "inject" / "sitecustomize.py", dest / "client" / "sitecustomize.py")
    (dest / "image").mkdir()
    (dest / "image" / "sitecustomize.py").write_text(
        "import os\n"
        "if 'LOCAL_RANK' in os.environ:\n"
        "    os.environ['MEMGUARD_SIGNAL_FILE'] += '.' + os.environ['LOCAL_RANK']\n"
    )
    sig = dest / "signal.json"
    Path(f"{sig}.0").write_text(json.dumps(signal(3, 8)))
    Path(f"{sig}.1").write_text(json.dumps(signal(3, 2)))
    return sig


class SidecarStandIn(http.server.ThreadingHTTPServer):
    """The sidecar's HTTP API as the client sees it: signals from the files (no news here),
    every report accepted and counted."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _SidecarHandler)
        self.reports: Dict[str, int] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _SidecarHandler(http.server.BaseHTTPRequestHandler):
    server: SidecarStandIn

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        # A long-poll with nothing new: hold it a moment, as the sidecar holds it until its
        # wait ends, then "no news".
        time.sleep(0.5)
        self.send_response(204)
        self.end_headers()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
        try:
            kinds = sorted(json.loads(body or b"{}"))
        except ValueError:
            kinds = ["unparsable"]
        with self.server.lock:
            for kind in kinds:
                self.server.reports[kind] = self.server.reports.get(kind, 0) + 1
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def burn() -> None:
    while True:
        pass


def allow_cores() -> None:
    """A rank that aborts leaves a core in the run's directory (with core_pattern ``core``)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def one_run(work: Path, sig: Path, i: int, batch: int, samples: int, agreement: str,
            cores: bool = False, sidecar_url: str = "") -> Dict[str, Any]:
    run = work / f"run{i}"
    run.mkdir()
    log = run / "log.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_") and k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=f"{work / 'client'}:{work / 'image'}", MEMGUARD_SIGNAL_FILE=str(sig))
    if agreement:
        env["MEMGUARD_AGREEMENT"] = agreement
    if sidecar_url:
        env["MEMGUARD_SIDECAR_URL"] = sidecar_url
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(STOCK), "--output_dir", str(run / "out"), "--per_device_train_batch_size", str(batch),
           "--num_train_epochs", "1", "--learning_rate", "1e-3", "--train_sampling_strategy",
           "sequential", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
           "--logging_strategy", "no", "--disable_tqdm", "true", "--samples", str(samples),
           "--min_len", "8", "--max_len", "24", "--log_file", str(log), "--ddp_backend", "gloo"]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=run,
                             preexec_fn=allow_cores if cores else None)
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = -999, f"timeout: {exc}"
    seconds = time.monotonic() - t0
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    micro = {r: [e["micro"] for e in events if e["event"] == "step" and e["rank"] == r] for r in (0, 1)}
    steps = samples // (2 * batch)
    agreed = micro[0] == micro[1] == [[2] * (batch // 2)] * steps
    return {"rc": rc, "agreed": agreed, "seconds": seconds, "text": text,
            "terminate": "terminate called" in text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--burners", type=int, default=2, help="CPU-spinning processes meanwhile")
    ap.add_argument("--agreement", default="", help="MEMGUARD_AGREEMENT for the ranks ('' = unset)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--keep", type=Path, default=None, help="directory for failed runs' output")
    ap.add_argument("--json", type=Path, default=None, help="write the summary there too")
    ap.add_argument("--sidecar", action="store_true",
                    help="serve the sidecar's HTTP API on loopback and give the ranks its URL")
    ap.add_argument("--cores", action="store_true",
                    help="keep an aborted rank's core file under --keep (for gdb)")
    args = ap.parse_args()

    sidecar = SidecarStandIn() if args.sidecar else None
    if sidecar is not None:
        threading.Thread(target=sidecar.serve_forever, daemon=True).start()
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    failures: List[Dict[str, Any]] = []
    codes: Dict[str, int] = {}
    seconds: List[float] = []
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="exit-stress-") as tmp:
            work = Path(tmp)
            sig = install(work)
            for i in range(args.runs):
                r = one_run(work, sig, i, args.batch, args.samples, args.agreement, args.cores,
                            sidecar.url if sidecar is not None else "")
                codes[str(r["rc"])] = codes.get(str(r["rc"]), 0) + 1
                seconds.append(r["seconds"])
                ok = r["rc"] == 0 and r["agreed"]
                if not ok:
                    failures.append(r)
                    if args.keep is not None:
                        args.keep.mkdir(parents=True, exist_ok=True)
                        (args.keep / f"failure{len(failures)}-run{i}.txt").write_text(r["text"])
                        for core in (work / f"run{i}").glob("core*"):
                            shutil.move(str(core), str(args.keep / f"failure{len(failures)}-{core.name}"))
                print(f"run {i + 1}/{args.runs}: rc {r['rc']} agreed {r['agreed']} "
                      f"{r['seconds']:.1f}s{' TERMINATE' if r['terminate'] else ''}",
                      file=sys.stderr, flush=True)
                shutil.rmtree(work / f"run{i}", ignore_errors=True)
    finally:
        for b in burners:
            b.kill()
    seconds.sort()
    summary = {
        "runs": args.runs, "failures": len(failures),
        "terminate": sum(1 for f in failures if f["terminate"]),
        "not_agreed": sum(1 for f in failures if not f["agreed"]),
        "exit_codes": codes, "agreement": args.agreement or "(unset)", "burners": args.burners,
        "median_run_s": round(seconds[len(seconds) // 2], 1) if seconds else None,
        "wall_s": round(time.monotonic() - t0, 1),
        "load_avg": os.getloadavg(),
        "sidecar_reports": dict(sidecar.reports) if sidecar is not None else None,
    }
    print(json.dumps(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
