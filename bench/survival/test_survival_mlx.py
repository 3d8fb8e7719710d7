"""The survival proof with an MLX trainer (trainer_mlx.py, ``memguard_client.mlx.MicroBatcher``)
on MLX's CPU backend: real cgroup v1, real OOM killer, real memguard-sidecar.

On the CPU backend MLX's buffers are ordinary process memory, so the cgroup limit bites on them
as on numpy's: the unguarded run is OOM-killed, the guarded one finishes. Same skip rules as
test_survival.py (``MEMGUARD_REQUIRE_SURVIVAL=1`` turns a skip into a failure; CI sets it).

Why it holds on a loaded machine (docs/survival.md, "With an MLX trainer"): the client returns
freed buffers to the kernel (``memguard_client.allocator``), so a downgrade lowers what the
cgroup sees; and the curriculum grows the full batch's need by about 3 % of the limit per step,
so the sidecar's first downgrade (at 0.85) comes about four steps before the full batch would
reach the limit, where the trainer needs one step (at most two) to follow it.

    python -m pytest bench/survival/test_survival_mlx.py -s -rs
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import survival  # noqa: E402

# 20 steps of 32 samples, lengths 1000 → 2500: at the full batch the last steps need about 1.25×
# the limit even with the guarded trainer's MLX limits (the reference arm measures it).
SAMPLES, BATCH, LIMIT_MIB, MIN_LEN, MAX_LEN = 640, 32, 160, 1000, 2500


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    reason = survival.skip_reason()
    if reason:
        msg = f"SKIP SKIP SKIP: the MLX survival proof did NOT run: {reason}"
        print("\n" + msg, file=sys.stderr)
        if os.environ.get("MEMGUARD_REQUIRE_SURVIVAL") == "1":
            pytest.fail(msg + " (MEMGUARD_REQUIRE_SURVIVAL=1)")
        pytest.skip(msg)
    sidecar = survival.find_sidecar(None)
    assert sidecar is not None, "no memguard-sidecar binary: cargo build -p memguard-sidecar"
    out = tmp_path_factory.mktemp("survival-mlx")
    code = survival.main(
        [
            "--trainer", "mlx",
            "--arms", "reference,baseline,memguard",
            "--out", str(out),
            "--sidecar", str(sidecar),
            "--samples", str(SAMPLES),
            "--epochs", "1",
            "--batch-size", str(BATCH),
            "--min-len", str(MIN_LEN),
            "--max-len", str(MAX_LEN),
            "--limit-mib", str(LIMIT_MIB),
            "--timeout", "600",
        ]
    )
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    data["out"] = out
    return data


def steps(results: Dict[str, Any], arm: str) -> List[Dict[str, Any]]:
    return [e for e in survival.read_log(results["out"] / f"{arm}.jsonl") if e["event"] == "step"]


def start_event(results: Dict[str, Any], arm: str) -> Dict[str, Any]:
    return next(e for e in survival.read_log(results["out"] / f"{arm}.jsonl") if e["event"] == "start")


def test_mlx_unguarded_is_oom_killed_and_guarded_finishes_the_same_training(results: Dict[str, Any]) -> None:
    arms, limit = results["arms"], results["limit_bytes"]
    ref, base, mg = arms["reference"], arms["baseline"], arms["memguard"]
    # The limit bites: the reference run, with the guarded trainer's MLX limits and allocator
    # setting but no cgroup limit and no sidecar, needs well over it at the full batch.
    ref_start = start_event(results, "reference")
    assert ref_start["limits"]["budget_bytes"] == limit and ref_start["freed_memory_returned"] is True
    assert ref["exit_code"] == 0 and ref["finished"] and ref["peak_bytes"] > 1.15 * limit
    # Unguarded (plain MLX, no memguard env): SIGKILL by the kernel's OOM killer, before the end.
    assert start_event(results, "baseline")["limits"] is None
    assert base["exit_code"] == -9 and not base["finished"]
    assert base["oom_kill"] >= 1 or (base["oom_kill_counter"] == "absent" and base["failcnt"] > 0)
    assert base["samples"] < SAMPLES
    # Guarded: every step, downgraded by the sidecar, the batch kept, and never at the limit:
    # the highest usage the sidecar saw (it resets max_usage_in_bytes after each sample) stayed
    # under it and the kernel never had to reclaim (failcnt 0).
    assert mg["exit_code"] == 0 and mg["finished"] and mg["oom_kill"] in (0, None)
    assert mg["peak_bytes"] < limit and mg["failcnt"] == 0, (mg["peak_bytes"], mg["failcnt"])
    assert mg["steps"] == ref["steps"] == SAMPLES // BATCH
    assert mg["downgrades"] >= 1 and mg["batches"][0] == BATCH and min(mg["batches"]) < BATCH
    assert mg["effective_batch_start"] == mg["effective_batch_end"] == BATCH
    mg_steps = steps(results, "memguard")
    assert all(sum(s["micro"]) == s["rows"] == BATCH for s in mg_steps)
    assert max(len(s["micro"]) for s in mg_steps) > 1, "micro-batches ran"
    # The same computation as the unlimited run, to float32 rounding.
    ref_steps = steps(results, "reference")
    assert [s["loss"] for s in mg_steps] == pytest.approx([s["loss"] for s in ref_steps], rel=1e-4)
    wa = np.load(results["out"] / "reference.npz")
    wb = np.load(results["out"] / "memguard.npz")
    for k in wa.files:
        np.testing.assert_allclose(wb[k], wa[k], rtol=1e-4, atol=1e-6)
    # The process's peak per step (VmHWM, what the cgroup charges) fell with the downgrade: at
    # the step that took it, and against the reference's last steps. (MLX's own peak is held
    # near its memory limit in both runs, so it is not the figure that shows it here; the
    # unit tests show get_peak_memory falling.)
    first_small = next(i for i, s in enumerate(mg_steps) if len(s["micro"]) > 1)
    assert first_small > 0
    assert mg_steps[first_small]["rss_peak"] < 0.8 * mg_steps[first_small - 1]["rss_peak"]
    peak_full = max(s["rss_peak"] for s in ref_steps[-3:])
    peak_mg = max(s["rss_peak"] for s in mg_steps[-3:])
    assert peak_mg < 0.75 * peak_full, (peak_mg, peak_full)
    # The trainer's reports (MLX figures) were accepted by the real sidecar, and its limits came
    # from the budget the harness wrote as the webhook would.
    assert mg["reports_total"] == mg["steps"] and mg["reports_ok"] == mg["reports_total"]
    mg_start = start_event(results, "memguard")
    assert mg_start["limits"]["budget_bytes"] == limit and mg_start["freed_memory_returned"] is True
    summary = mg["sidecar_summary"]
    assert summary is not None and summary["oom_events"] == 0 and summary["downgrades"] >= mg["downgrades"]
    first_downgrade = next(i for i, s in enumerate(mg_steps) if min(s["micro"]) < BATCH)
    print("\nMLX survival:", json.dumps({k: {"exit": v["exit_code"], "peak_mib": round(v["peak_bytes"] / 2**20, 1),
                                            "steps": v["steps"], "batches": v["batches"],
                                            "seconds": round(v["seconds"], 1)}
                                        for k, v in arms.items()}),
          f"first step at a smaller batch: {first_downgrade} of {len(mg_steps)}")
