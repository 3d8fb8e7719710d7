"""The MLX leak path end to end: a real MLX loop that leaks (leak_mlx.py, through
``memguard_client.mlx.MicroBatcher``) reports ``leak_bytes_per_second``, and the real
memguard-sidecar, watching the trainer's real cgroup v1, downgrades on it; a steady loop reports
no leak and is left alone.

Which rule acted: the sidecar's own growth rule needs 20 s of working-set history
(``policy::leak_eta``), and the trainer, warm before the sidecar starts, has its downgrade within
a few seconds of the sidecar's start; the working set stays below the warn ratio, so neither the
ratio nor the sidecar's own rule can be the cause. ``--leak-horizon 600s`` makes the test
independent of how fast the loop runs on a loaded machine (any reported growth that reaches the
limit within 10 minutes counts; the default is 60 s). Same skip rules as test_survival.py.

    python -m pytest bench/survival/test_leak_mlx.py -s -rs
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import survival  # noqa: E402
from survival import parse_rfc3339  # noqa: E402

LIMIT = 512 << 20
#: The sidecar's own growth rule cannot see a leak in less history than this (policy::leak_eta).
OWN_RULE_HISTORY_S = 20.0


def run(out: Path, sidecar: Path, leak_mib: float, steps: int) -> Dict[str, Any]:
    name = f"leak{int(leak_mib)}"
    log, side_log_path = out / f"{name}.jsonl", out / f"{name}.sidecar.log"
    signal_file, term = out / f"{name}.signal.json", out / f"{name}.termination-log.json"
    port = survival.free_port()
    env = survival.base_env()
    env.update(
        MEMGUARD_SIGNAL_FILE=str(signal_file),
        MEMGUARD_SIDECAR_URL=f"http://127.0.0.1:{port}",
        MEMGUARD_BATCH_SIZE="8",
        MEMGUARD_GRAD_ACCUMULATION="1",
        MEMGUARD_BUDGET_BYTES=str(LIMIT),
    )
    cg = survival.Cgroup(f"memguard-survival-{os.getpid()}-{name}", LIMIT)
    side = None
    try:
        cmd = [sys.executable, str(HERE / "leak_mlx.py"), "--leak-mib", str(leak_mib),
               "--steps", str(steps), "--log", str(log)]
        trainer = subprocess.Popen(
            ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg.path), *cmd],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert trainer.stdout is not None and trainer.stdin is not None
        assert trainer.stdout.readline().strip() == "ready", "the trainer died before training"
        with open(side_log_path, "w") as side_log:
            side = subprocess.Popen(
                [
                    str(sidecar), "--cgroup", str(cg.path), "--signal-file", str(signal_file),
                    "--listen", f"127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:0",
                    "--interval", "100ms", "--batch-size", "8", "--grad-accumulation", "1",
                    "--grad-checkpointing", "false", "--leak-horizon", "600s",
                    "--termination-log", str(term), "--log-format", "json",
                ],
                stdout=side_log, stderr=subprocess.STDOUT,
                env={**survival.base_env(), "RUST_LOG": "info"},
            )
        deadline = time.monotonic() + 20
        while not signal_file.exists():
            assert side.poll() is None and time.monotonic() < deadline, f"sidecar did not start; see {side_log_path}"
            time.sleep(0.02)
        trainer.stdin.write("go\n")
        trainer.stdin.close()
        assert trainer.wait(timeout=300) == 0
        ws_peak = int(cg.read("memory.max_usage_in_bytes"))
    finally:
        if side is not None:
            try:
                side.wait(timeout=10)  # it exits by itself when the cgroup empties
            except subprocess.TimeoutExpired:
                side.send_signal(signal.SIGTERM)
                side.wait(timeout=10)
        cg.remove()
    # The sidecar's JSON log lines carry the event's fields at the top level (memguard_runtime).
    records = [json.loads(line) for line in side_log_path.read_text().splitlines() if line.startswith("{")]
    started = next(parse_rfc3339(r["timestamp"]) for r in records
                   if r.get("message") == "memguard-sidecar starting")
    signals = [{**r, "time": parse_rfc3339(r["timestamp"])} for r in records
               if r.get("message") == "signal"]
    return {
        "events": survival.read_log(log),
        "sidecar_started": started,
        "sidecar_signals": signals,
        "summary": json.loads(term.read_text()),
        "last_interval_peak": ws_peak,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, Any]]:
    reason = survival.skip_reason()
    if reason:
        msg = f"SKIP SKIP SKIP: the MLX leak test did NOT run: {reason}"
        print("\n" + msg, file=sys.stderr)
        if os.environ.get("MEMGUARD_REQUIRE_SURVIVAL") == "1":
            pytest.fail(msg + " (MEMGUARD_REQUIRE_SURVIVAL=1)")
        pytest.skip(msg)
    sidecar = survival.find_sidecar(None)
    assert sidecar is not None and sidecar.is_file(), "no memguard-sidecar binary: cargo build -p memguard-sidecar"
    out = tmp_path_factory.mktemp("leak-mlx")
    return {
        "leaking": run(out, sidecar, leak_mib=4.0, steps=40),
        "steady": run(out, sidecar, leak_mib=0.0, steps=30),
    }


def of(events: List[Dict[str, Any]], kind: str) -> List[Dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def test_a_leak_the_mlx_trainer_reports_makes_the_real_sidecar_downgrade(runs: Dict[str, Dict[str, Any]]) -> None:
    r = runs["leaking"]
    steps = of(r["events"], "step")
    reported = [s for s in steps if s["leak_bytes_per_second"]]
    # The client's rule: five checks in a row, each above the one before, after clear_cache.
    assert reported, "the leak was never reported"
    assert reported[0]["step"] == 4 and all(s["report_accepted"] for s in steps)
    # The sidecar downgraded on a steady growth, not on the working set's ratio ...
    downs = [s for s in r["sidecar_signals"] if s["level"] in ("downgrade", "critical")]
    assert downs, r["sidecar_signals"]
    first = downs[0]
    assert "steady growth reaches the limit" in first["reason"] and "working set" not in first["reason"], first
    assert first["batch_size"] == 4
    # ... sooner than its own growth rule could have seen anything: it was the trainer's report.
    assert first["time"] - r["sidecar_started"] < OWN_RULE_HISTORY_S, (first, r["sidecar_started"])
    assert all(s["level"] != "warn" for s in r["sidecar_signals"][: r["sidecar_signals"].index(first)])
    # The trainer followed it.
    down = of(r["events"], "downgraded")
    assert down and down[0]["batch"] == 4 and down[0]["step"] == len(steps)
    assert r["summary"]["downgrades"] >= 1 and r["summary"]["peak_bytes"] < 0.7 * LIMIT
    print(f"\nleak reported from step {reported[0]['step']} "
          f"({reported[0]['leak_bytes_per_second'] / 2**20:.0f} MiB/s); sidecar downgrade "
          f"{first['time'] - r['sidecar_started']:.1f} s after its start: {first['reason']}")


def test_a_steady_mlx_loop_reports_no_leak_and_is_left_alone(runs: Dict[str, Dict[str, Any]]) -> None:
    r = runs["steady"]
    steps = of(r["events"], "step")
    assert len(steps) == 30 and all(s["report_accepted"] for s in steps)
    assert not any(s["leak_bytes_per_second"] for s in steps)
    assert not of(r["events"], "downgraded")
    assert r["summary"]["downgrades"] == 0
    assert all(s["level"] in ("ok", "warn") for s in r["sidecar_signals"]), r["sidecar_signals"]
