"""Test helpers: the package under test from ./src, a real local sidecar stand-in."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional
from urllib.parse import parse_qs, urlparse

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

REPO = Path(__file__).resolve().parents[3]
FIXTURE = REPO / "api" / "fixtures" / "signal-v1.json"


def signal_dict(seq: int, batch: int = 8, accum: int = 4, level: str = "ok", **extra: Any) -> Dict[str, Any]:
    d: Dict[str, Any] = {
        "version": 1,
        "seq": seq,
        "level": level,
        "batch_size": batch,
        "grad_accumulation": accum,
        "grad_checkpointing": False,
        "reason": f"test seq {seq}",
        "pressure": {"memory_ratio": 0.5},
        "timestamp": "2026-11-22T22:00:00.000Z",
    }
    d.update(extra)
    return d


def write_atomic(path: Path, obj: Any) -> None:
    """What the sidecar does: write a temporary file, then rename it over the signal file."""
    tmp = path.with_name(path.name + ".tmp")
    data = obj if isinstance(obj, (bytes, str)) else json.dumps(obj)
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def age(path: Path, seconds: float = 5.0) -> None:
    """Push the file's mtime into the past (out of the client's racy window)."""
    t = time.time() - seconds
    os.utime(path, (t, t))


class FakeSidecar:
    """A real HTTP server on 127.0.0.1 speaking the sidecar's trainer API.

    `GET /v1/signal?after=N&wait=30s` holds the request until a signal with seq > N is
    published or the wait ends (then 204); without `after` it answers the current signal.
    `POST /v1/report` records the JSON body (its `container_memory` in `container_memory`).
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.current: Optional[Dict[str, Any]] = None
        self.raw_override: Optional[bytes] = None
        self.status_override: Optional[int] = None
        self.reports: List[Dict[str, Any]] = []
        self.container_memory: List[Dict[str, Any]] = []
        #: Report fields answered with 400, as a sidecar that does not know them does.
        self.unknown_fields: set = set()
        self.refused: List[Dict[str, Any]] = []
        self.report_headers: List[Dict[str, str]] = []
        self.requests: List[str] = []
        sidecar = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                sidecar.requests.append(self.path)
                if url.path != "/v1/signal":
                    self.send_error(404)
                    return
                if sidecar.status_override is not None:
                    self.send_error(sidecar.status_override)
                    return
                q = parse_qs(url.query)
                after = int(q["after"][0]) if "after" in q else None
                wait_s = _parse_wait(q.get("wait", ["0s"])[0])
                deadline = time.monotonic() + wait_s
                with sidecar.cond:
                    while after is not None and (
                        sidecar.current is None or sidecar.current["seq"] <= after
                    ):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        sidecar.cond.wait(left)
                    cur = sidecar.current
                    raw = sidecar.raw_override
                if raw is not None:
                    body = raw
                elif cur is None or (after is not None and cur["seq"] <= after):
                    self.send_response(204)
                    self.end_headers()
                    return
                else:
                    body = json.dumps(cur).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                if self.path != "/v1/report":
                    self.send_error(404)
                    return
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n))
                if sidecar.unknown_fields & set(body):
                    # As an older sidecar (serde's deny_unknown_fields) answers.
                    sidecar.refused.append(body)
                    self.send_error(400)
                    return
                # The container's own cgroup figures ride along at their own rate
                # (own_cgroup.py): kept apart, so a report's other fields compare exactly.
                memory = body.pop("container_memory", None)
                if memory is not None:
                    sidecar.container_memory.append(memory)
                sidecar.reports.append(body)
                sidecar.report_headers.append(dict(self.headers))
                self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def publish(self, sig: Dict[str, Any]) -> None:
        with self.cond:
            self.current = sig
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


def _parse_wait(text: str) -> float:
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    if text.endswith("s"):
        return float(text[:-1])
    return float(text)


@pytest.fixture
def sidecar() -> Iterator[FakeSidecar]:
    s = FakeSidecar()
    yield s
    s.close()


@pytest.fixture
def signal_path(tmp_path: Path) -> Path:
    return tmp_path / "signal.json"
