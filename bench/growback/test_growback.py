"""Grow-back as tests (issue 37, item 5): real cgroup v1, real memguard-sidecar, real HF Trainer.

A trainer configured at 16 × 1 and admitted at 2 × 8 under a roomy limit grows back to 16,
finishes every step and sample, and ends with the parameters of the same run unguarded at
16 × 1; with two ranks (torchrun, gloo) both grow at the same step.

    python -m pytest bench/growback -s -rs

Needs root and a writable cgroup v1 memory controller; elsewhere it skips loudly, and fails
instead with ``MEMGUARD_REQUIRE_SURVIVAL=1`` (CI sets it).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import growback  # noqa: E402

survival = growback.survival


@pytest.fixture(scope="module")
def sidecar() -> Path:
    reason = survival.skip_reason() or survival.torch_skip_reason()
    if reason:
        msg = f"SKIP SKIP SKIP: the grow-back test did NOT run: {reason}"
        print("\n" + msg, file=sys.stderr)
        if os.environ.get("MEMGUARD_REQUIRE_SURVIVAL") == "1":
            pytest.fail(msg + " (MEMGUARD_REQUIRE_SURVIVAL=1)")
        pytest.skip(msg)
    found = survival.find_sidecar(None)
    if found is None:
        cargo = shutil.which("cargo")
        assert cargo, "no memguard-sidecar binary and no cargo: cargo build -p memguard-sidecar"
        subprocess.run([cargo, "build", "-p", "memguard-sidecar"], cwd=growback.REPO, check=True)
        found = survival.find_sidecar(None)
    assert found is not None and found.is_file()
    return found


def settings(world_size: int) -> argparse.Namespace:
    # A short run: the sidecar samples every 50 ms and measures 500 ms at each micro-batch.
    # Roomy: 4 GiB for one trainer (it peaks under 1 GiB), 8 GiB for two. 64 steps per rank.
    return argparse.Namespace(samples=1024 * world_size, seq=16, layers=1, width=32, limit_mib=4096 * world_size,
                              interval="50ms", grow_window="500ms", world_size=world_size,
                              timeout=900)


def runs(sizes: List[int]) -> List[Any]:
    return [(size, len(list(group))) for size, group in itertools.groupby(sizes)]


def both_arms(sidecar: Path, tmp: Path, world_size: int) -> Dict[str, Dict[str, Any]]:
    args = settings(world_size)
    plain = growback.run_arm(args, None, tmp / "plain", "plain", guarded=False)
    guarded = growback.run_arm(args, sidecar, tmp / "guarded", "guarded", guarded=True)
    for name, r in (("plain", plain), ("guarded", guarded)):
        assert r["exit_code"] == 0, f"{name}: exit {r['exit_code']} (see {tmp / name})"
        assert r["oom_kill"] in (0, None), f"{name}: OOM killed under a roomy limit"
    return {"plain": plain, "guarded": guarded}


def test_a_trainer_admitted_at_2_of_16_grows_back_and_ends_like_the_unguarded_run(
    sidecar: Path, tmp_path: Path
) -> None:
    r = both_arms(sidecar, tmp_path, world_size=1)
    guarded, plain = r["guarded"]["ranks"][0], r["plain"]["ranks"][0]
    sizes = guarded["sizes"]
    assert sizes[0] == 2, runs(sizes)
    assert sizes[-1] == 16, f"did not grow back to 16: {runs(sizes)}"
    assert [s for s, _ in runs(sizes)] == [2, 4, 8, 16], "rung by rung, never down, never above 16"
    # Every step and every sample, as the unguarded run.
    assert guarded["steps"] == plain["steps"] == 1024 // 16
    assert guarded["rows"] == plain["rows"] == 1024
    assert guarded["forwards"] > plain["forwards"] == 64, "it did run smaller micro-batches first"
    diff = growback.max_param_diff(tmp_path / "plain" / "weights-0.pt", tmp_path / "guarded" / "weights-0.pt")
    assert diff < 1e-9, f"parameters differ from the unguarded run by {diff}"
    # Recorded like a downgrade: the sidecar's summary counts the growths.
    summary = r["guarded"]["summary"]
    assert summary is not None
    assert (summary["growths"], summary["batch_size"], summary["grad_accumulation"]) == (3, 16, 1)
    assert summary["downgrades"] == 0 and summary["max_level"] == "ok"
    reasons = (tmp_path / "guarded" / "sidecar.log").read_text()
    assert "batch 8 -> 16, accumulation 2 -> 1 (configured 16)" in reasons


def test_two_ranks_grow_at_the_same_step(sidecar: Path, tmp_path: Path) -> None:
    r = both_arms(sidecar, tmp_path, world_size=2)
    rank0, rank1 = r["guarded"]["ranks"]
    assert rank0["sizes"] == rank1["sizes"], (runs(rank0["sizes"]), runs(rank1["sizes"]))
    assert rank0["sizes"][0] <= 2 and rank0["sizes"][-1] == 16, runs(rank0["sizes"])
    assert rank0["sizes"] == sorted(rank0["sizes"]), f"never down: {runs(rank0['sizes'])}"
    assert rank0["steps"] == rank1["steps"] == 2048 // 32
    assert rank0["rows"] == rank1["rows"] == 1024
    for rank in (0, 1):
        diff = growback.max_param_diff(
            tmp_path / "plain" / f"weights-{rank}.pt", tmp_path / "guarded" / f"weights-{rank}.pt"
        )
        assert diff < 1e-9, f"rank {rank}: parameters differ from the unguarded run by {diff}"
    assert r["guarded"]["summary"]["growths"] == 3
