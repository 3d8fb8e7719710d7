"""The per-step cost of the step report the client makes for the growth back (issue 37, item 5):
``StepReporter.step`` (hand step and micro-batch to the sender thread), timed in the training
thread while the sender really reads the device figures and posts to a loopback HTTP server
answering 204, as the sidecar does; and the sender's device read (``device_figures``) alone.

    python3 bench/growback/step_cost.py [--calls 200000]

Prints the median and the 99th percentile of the per-call time over batches of 1,000 calls, for
``device_figures()`` (in the sender thread, off the step) and for ``step()`` (the step's cost). On a machine without CUDA (or with
CUDA not initialised) the device read is the check that finds it absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, List

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "src"))
from memguard_client import Guard  # noqa: E402
from memguard_client.peaks import StepReporter, device_figures  # noqa: E402


class Accept(BaseHTTPRequestHandler):
    posts = 0

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        Accept.posts += 1
        self.send_response(204)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


def per_call_us(fn: Callable[[int], None], calls: int, batch: int = 1000) -> List[float]:
    out = []
    for start in range(0, calls, batch):
        t0 = time.perf_counter_ns()
        for i in range(start, start + batch):
            fn(i)
        out.append((time.perf_counter_ns() - t0) / batch / 1000)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=200_000)
    args = p.parse_args()
    try:
        import torch  # noqa: F401  (the device read looks for an imported torch)
        cuda = bool(torch.cuda.is_available())
        if cuda:
            torch.zeros(1, device="cuda")  # initialise CUDA so the peaks are really read
    except ImportError:
        cuda = False
    server = ThreadingHTTPServer(("127.0.0.1", 0), Accept)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    guard = Guard(signal_file="", sidecar_url=f"http://127.0.0.1:{server.server_address[1]}",
                  background=False, oom_hook=False)
    reporter = StepReporter(guard)
    read = per_call_us(lambda i: device_figures(), args.calls)
    step = per_call_us(lambda i: reporter.step(i, 16), args.calls)
    reporter.close()
    server.shutdown()

    def q(xs: List[float], f: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]

    print(json.dumps({
        "cuda": cuda, "calls": args.calls, "posts_sent": Accept.posts,
        "device_read_us": {"median": round(statistics.median(read), 3), "p99": round(q(read, 0.99), 3)},
        "step_us": {"median": round(statistics.median(step), 3), "p99": round(q(step, 0.99), 3)},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
