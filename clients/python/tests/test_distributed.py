"""Rank agreement for real: 2-rank torchrun (gloo, CPU) with DDP and FSDP2 (``fully_shard``).

Only rank 0's signal changes mid-run, as when only one pod's sidecar sees pressure. Both ranks
must run the same micro-batch sizes at every step and end with the parameters of a
single-process run over the whole global batch. ``ddp-oom`` adds the real
``torch.OutOfMemoryError`` on rank 1 only (forward and backward): both ranks halve together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

torch = pytest.importorskip("torch", reason="torch is installed by scripts/install-deps.sh")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_worker.py"


def torchrun(mode: str, out: Path, **extra_env: str) -> List[Dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), mode, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> List[Any]:
    out = tmp_path_factory.mktemp("reference")
    subprocess.run([sys.executable, str(WORKER), "reference", str(out)], check=True, timeout=120)
    return json.loads((out / "reference.json").read_text())["params"]


def assert_params_equal(got: List[Any], want: List[Any]) -> None:
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def step_collectives(steps: int, pipelined: bool) -> int:
    """Collectives of the per-step agreement: one per boundary, and with the pipelined one the
    first boundary's blocking exchange too."""
    return steps + (1 if pipelined else 0)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_apply_the_same_micro_batch_at_every_step(tmp_path: Path, mode: str, reference: List[Any]) -> None:
    """The default, pipelined agreement: rank 0's downgrade seen at step 2 is proposed at that
    boundary and applied by both ranks at step 3, together."""
    r0, r1 = torchrun(mode, tmp_path)
    # Rank 1's own signal never changed; it follows rank 0's downgrade at the same step.
    assert r0["micro"] == r1["micro"]
    assert r0["micro"][:3] == [[8], [8], [8]]
    assert all(m == [3, 3, 2] for m in r0["micro"][3:])
    assert r0["applied"] == r1["applied"] == 3
    assert r0["downgrades"] == r1["downgrades"] == 1
    # Per step one agreement (plus the first boundary's exchange). With DDP (OOM recovery on)
    # also one OOM status per micro-batch after forward and one after each backward but the
    # last (the synchronising one). With FSDP2 recovery is off (see memguard_client.recovery).
    micro = sum(len(m) for m in r0["micro"])
    want = step_collectives(7, True) + (micro + (micro - 7) if mode == "ddp" else 0)
    assert r0["collectives"] == r1["collectives"] == want
    assert_params_equal(r0["params"], reference)
    assert_params_equal(r1["params"], reference)


def test_the_blocking_agreement_applies_a_signal_at_the_step_it_is_seen(tmp_path: Path, reference: List[Any]) -> None:
    """``MEMGUARD_AGREEMENT=blocking``: rank 0's downgrade at step 2 applies on both ranks at
    step 2."""
    r0, r1 = torchrun("ddp", tmp_path, MEMGUARD_AGREEMENT="blocking")
    assert r0["micro"] == r1["micro"]
    assert r0["micro"][:2] == [[8], [8]]
    assert all(m == [3, 3, 2] for m in r0["micro"][2:])
    assert r0["downgrades"] == r1["downgrades"] == 1
    micro = sum(len(m) for m in r0["micro"])
    assert r0["collectives"] == r1["collectives"] == step_collectives(7, False) + micro + (micro - 7)
    assert_params_equal(r0["params"], reference)
    assert_params_equal(r1["params"], reference)


def test_an_oom_on_one_rank_halves_every_rank_and_stays_exact(tmp_path: Path, reference: List[Any]) -> None:
    r0, r1 = torchrun("ddp-oom", tmp_path)
    assert r0["micro"] == r1["micro"]
    micro = r0["micro"]
    # Rank 0's signal (4) at step 2 applies at step 3 (pipelined agreement).
    assert micro[:4] == [[8], [8], [8], [4, 4]]
    # Step 4: rank 1's forward OOM at 4 rows; both ranks run the batch again at 2.
    assert micro[4] == [4, 2, 2, 2, 2]
    # Step 5: the cap of 2 holds although step 4's boundary proposed 4 (the OOM cap was agreed
    # in step 4 and applies at once); rank 1's backward OOM in the first micro-batch (gradients
    # were fresh): the whole batch again at 1, exact.
    assert micro[5] == [2] + [1] * 8
    assert micro[6] == [1] * 8
    assert r0["oom_recoveries"] == r1["oom_recoveries"] == 2
    assert r0["skipped_steps"] == r1["skipped_steps"] == 0
    assert_params_equal(r0["params"], reference)
    assert_params_equal(r1["params"], reference)


def test_a_collective_in_flight_at_exit_is_completed_before_finalization(tmp_path: Path) -> None:
    """Rank 0 returns from its script with the pipelined agreement's last collective in flight
    and its peer late. The client's exit handler completes it and joins the thread before the
    interpreter finalizes; without it the collective returns during finalization, the thread is
    ended inside torch's C++ frames, and rank 0 aborts: "terminate called without an active
    exception" (exit -6), every time with this timing."""
    r0, r1 = torchrun("exit-in-flight", tmp_path)
    assert r0["collectives"] == r1["collectives"] == step_collectives(3, True)


@pytest.mark.parametrize("value, pipelined", [(None, True), ("pipelined", True), ("blocking", False),
                                              (" Blocking ", False), ("anything", True)])
def test_the_agreement_is_pipelined_unless_blocking_is_asked_for(
    monkeypatch: pytest.MonkeyPatch, value: Any, pipelined: bool
) -> None:
    from memguard_client.distributed import Agreement

    if value is None:
        monkeypatch.delenv("MEMGUARD_AGREEMENT", raising=False)
    else:
        monkeypatch.setenv("MEMGUARD_AGREEMENT", value)
    assert Agreement().pipelined is pipelined
    assert Agreement(pipelined=not pipelined).pipelined is not pipelined
    # One process: nothing to agree with, close() has nothing to wait for.
    assert Agreement().step_sync(4, True, False) == (4, True, False)
    assert Agreement().close() is True
