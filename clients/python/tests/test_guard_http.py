"""Guard with the sidecar's HTTP API: long-poll against a real local server, and reports."""

from __future__ import annotations

import socket
import sys
import time
import types
from pathlib import Path

import pytest

from conftest import FakeSidecar, age, signal_dict, write_atomic
from memguard_client import Guard

REPORT_FIELDS = {
    "framework",
    "allocated_bytes",
    "reserved_bytes",
    "peak_bytes",
    "total_bytes",
    "step",
    "batch_size",
}


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def test_long_poll_delivers_a_new_signal_promptly(sidecar: FakeSidecar) -> None:
    sidecar.publish(signal_dict(0, batch=32, accum=1))
    g = Guard(sidecar_url=sidecar.url + "/", env={})
    assert g.sidecar_url == sidecar.url
    assert g.wait_for_signal(5.0) and (g.seq, g.batch_size) == (0, 32)
    time.sleep(0.2)  # the thread is now parked in GET /v1/signal?after=0&wait=30s
    assert any("after=0" in r and "wait=30s" in r for r in sidecar.requests)
    requests_before = len(sidecar.requests)
    t0 = time.monotonic()
    sidecar.publish(signal_dict(1, batch=16, accum=2, level="downgrade"))
    assert g.wait_for_signal(5.0)
    latency = time.monotonic() - t0
    assert (g.seq, g.batch_size, g.grad_accumulation, g.level) == (1, 16, 2, "downgrade")
    assert g.source == "http"
    assert latency < 0.5, f"long-poll latency {latency:.3f}s"
    # It was the held request that answered, not a new one.
    assert len(sidecar.requests) <= requests_before + 1
    g.close()


def test_refresh_never_blocks_on_the_network(sidecar: FakeSidecar) -> None:
    g = Guard(sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "8"})
    t0 = time.monotonic()
    for _ in range(1000):
        g.refresh()
    assert time.monotonic() - t0 < 0.5
    assert g.batch_size == 8
    g.close()


def test_dead_sidecar_is_harmless() -> None:
    g = Guard(sidecar_url=dead_url(), env={"MEMGUARD_BATCH_SIZE": "8"})
    time.sleep(0.1)
    assert g.refresh() is False and g.batch_size == 8
    t0 = time.monotonic()
    assert g.report(step=1, allocated_bytes=10) is False
    assert g.poll_http() is False
    assert time.monotonic() - t0 < 1.0
    g.close()


def test_hung_sidecar_costs_at_most_the_report_timeout() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # accepts connections, never answers
    try:
        g = Guard(sidecar_url=f"http://127.0.0.1:{srv.getsockname()[1]}", env={}, background=False, report_timeout=0.2)
        t0 = time.monotonic()
        assert g.report(step=1) is False
        assert time.monotonic() - t0 < 1.0
    finally:
        srv.close()


def test_server_errors_and_garbage_are_ignored_then_recovery(sidecar: FakeSidecar) -> None:
    sidecar.status_override = 500
    g = Guard(sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "8"}, background=False)
    assert g.poll_http() is False and g.batch_size == 8
    sidecar.status_override = None
    sidecar.raw_override = b'{"version": 1, "seq": 4, "lev'
    sidecar.publish(signal_dict(4, batch=2))
    assert g.poll_http() is False and g.batch_size == 8
    sidecar.raw_override = b'{"version": 9, "seq": 5, "level": "ok"}'
    assert g.poll_http() is False
    sidecar.raw_override = None
    assert g.poll_http() is True and g.batch_size == 2


def test_background_thread_survives_errors(sidecar: FakeSidecar) -> None:
    sidecar.status_override = 503
    g = Guard(sidecar_url=sidecar.url, env={})
    time.sleep(0.3)
    sidecar.status_override = None
    sidecar.publish(signal_dict(7, batch=3, accum=5))
    assert g.wait_for_signal(5.0) and g.batch_size == 3
    g.close()


def test_file_and_http_together_take_the_newest(sidecar: FakeSidecar, signal_path: Path) -> None:
    write_atomic(signal_path, signal_dict(5, batch=4, accum=8))
    age(signal_path)
    sidecar.publish(signal_dict(3, batch=16, accum=2))
    g = Guard(signal_file=str(signal_path), sidecar_url=sidecar.url, env={}, background=False)
    assert g.poll_http() is True
    assert (g.seq, g.batch_size, g.source) == (5, 4, "file")
    sidecar.publish(signal_dict(6, batch=2, accum=16))
    assert g.poll_http() is True and (g.seq, g.batch_size) == (6, 2)
    assert g.refresh() is False  # the file's seq 5 is older


def test_report_posts_only_known_fields_as_json(sidecar: FakeSidecar) -> None:
    g = Guard(sidecar_url=sidecar.url, env={}, background=False)
    assert g.report(step=12, batch_size=4, allocated_bytes=1 << 30, reserved_bytes=3 << 29, peak_bytes=2 << 30)
    assert g.report(step=13, allocated_bytes=-5, peak_bytes=True, total_bytes=2.0, framework="torch")  # type: ignore[arg-type]
    assert g.report() is True
    first, second, empty = sidecar.reports
    assert first == {
        "step": 12,
        "batch_size": 4,
        "allocated_bytes": 1 << 30,
        "reserved_bytes": 3 << 29,
        "peak_bytes": 2 << 30,
    }
    assert second == {"step": 13, "total_bytes": 2, "framework": "torch"}
    assert empty == {}
    for body in sidecar.reports:
        assert set(body) <= REPORT_FIELDS
        assert all(isinstance(v, int) and not isinstance(v, bool) for k, v in body.items() if k != "framework")
    assert sidecar.report_headers[0]["Content-Type"] == "application/json"


def test_report_framework_reads_torch_cuda(sidecar: FakeSidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 0,
        memory_allocated=lambda d: 100,
        memory_reserved=lambda d: 200,
        max_memory_allocated=lambda d: 150,
        get_device_properties=lambda d: types.SimpleNamespace(total_memory=1000),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    g = Guard(sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "4"}, background=False)
    body = g.report_framework(step=9)
    expected = {
        "framework": "torch",
        "allocated_bytes": 100,
        "reserved_bytes": 200,
        "peak_bytes": 150,
        "total_bytes": 1000,
        "step": 9,
        "batch_size": 4,
    }
    assert body == expected
    assert sidecar.reports == [expected]


def test_report_framework_without_any_framework_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("torch", "mlx", "mlx.core", "mxnet"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, as when not installed
    assert Guard(env={}).report_framework() is None
