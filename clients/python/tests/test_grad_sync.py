"""Gradient sync under FSDP, for real: 2-rank torchrun (gloo, CPU) with FSDP2 (``fully_shard``)
and the real HF ``Accelerator`` (gradsync_worker.py), plus the env and the HF Trainer adapter.

Accumulating micro-batches under ``set_requires_gradient_sync(False)`` (Accelerate's
``accumulate``, the HF Trainer, LitGPT) holds every rank's gradients unsharded; syncing each
micro-batch keeps them sharded. The client's run-time downgrade raises accumulation, so under
FSDP it must sync each micro-batch, on every rank from the same step, and stay exact.
Accelerate shards with FSDP only on accelerators (``MULTI_CPU`` is never ``FSDP``), so the
Accelerator is tested for its flag (``accumulate()`` with a DDP model) and the client's
mechanism against real FSDP2 beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from memguard_client import Guard

torch = pytest.importorskip("torch", reason="torch is installed by scripts/install-deps.sh")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "gradsync_worker.py"


def torchrun(mode: str, out: Path) -> List[Dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMGUARD_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), mode, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    return torchrun("fsdp2", tmp_path_factory.mktemp("fsdp2"))


def test_accumulating_under_no_sync_holds_unsharded_gradients_and_syncing_each_batch_does_not(
    fsdp2: List[Dict[str, Any]],
) -> None:
    for r in fsdp2:
        full = r["full_grad_bytes"]  # 74 497 fp32 parameters
        shard = r["each_batch"]["after_first"]
        # Sharded over 2 ranks (FSDP2 pads each shard a little).
        assert full / 2 <= shard < full / 2 * 1.01, (full, shard)
        # The defect: after the first micro-batch under no_sync, the whole model's gradients.
        assert r["no_sync"]["after_first"] == full
        # The last micro-batch syncs and frees them: sharded either way at the step.
        assert r["no_sync"]["after_last"] == r["each_batch"]["after_last"] == shard


def test_the_clients_downgrade_syncs_each_batch_on_every_rank_and_stays_exact(
    fsdp2: List[Dict[str, Any]],
) -> None:
    r0, r1 = fsdp2
    full, shard = r0["full_grad_bytes"], r0["each_batch"]["after_first"]
    ref = r0["reference"]
    for r in (r0, r1):
        # Only rank 0's signal drops 8 -> 4 at step 1; the pipelined agreement applies it at
        # step 2, where both ranks split and switch together.
        assert r["client"]["rows"] == [[8], [8], [4, 4], [4, 4]]
        assert r["client"]["sync"] == [False, False, True, True]
        # Gradient bytes when the second micro-batch begins: sharded with the fix...
        assert r["client"]["between"] == [[], [], [shard], [shard]]
        # ...unsharded without it (sync_each_batch=False: the micro-batches under no_sync).
        assert r["client_never"]["between"] == [[], [], [full], [full]]
        assert r["client_never"]["sync"] == [False] * 4
        # MEMGUARD_GRAD_SYNC=each-batch with batch 4 from the env: sharded from the first step.
        assert r["client_env"]["rows"] == [[4, 4]] * 4
        assert r["client_env"]["sync"] == [True] * 4
        assert r["client_env"]["between"] == [[shard]] * 4
        # Syncing each micro-batch changes communication, not the result.
        for run in ("client", "client_never", "client_env"):
            for got, want in zip(r[run]["params"], ref):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_the_real_accelerator_honours_the_flag_and_the_client_sets_it_at_the_downgrade(
    tmp_path: Path,
) -> None:
    pytest.importorskip("accelerate")
    for r in torchrun("accelerate", tmp_path):
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"
        # accumulate(): the first of two micro-batches runs under no_sync unless the flag is set.
        assert (r["before"], r["after"]) == (False, True)
        assert (r["set_now"], r["set_again"]) == (True, False)
        # Set at the step rank 0's downgrade (seen at step 1) applies: step 2, on both ranks.
        assert r["client_flags"] == [False, False, True, True]


def test_guard_reads_grad_sync_from_the_env() -> None:
    assert Guard(signal_file="", env={}).grad_sync == "accumulate"
    assert Guard(signal_file="", env={"MEMGUARD_GRAD_SYNC": "each-batch"}).grad_sync == "each-batch"
    assert Guard(signal_file="", env={"MEMGUARD_GRAD_SYNC": " Sync-Each-Batch "}).grad_sync == "each-batch"
    assert Guard(signal_file="", env={}, grad_sync="each-batch").grad_sync == "each-batch"
    # The env (the webhook's plan) wins; an unknown value falls back to the default.
    assert Guard(signal_file="", env={"MEMGUARD_GRAD_SYNC": "accumulate"}, grad_sync="each-batch").grad_sync == "accumulate"
    assert Guard(signal_file="", env={"MEMGUARD_GRAD_SYNC": "sometimes"}).grad_sync == "accumulate"


@pytest.mark.parametrize("grad_sync", ["each-batch", "accumulate"])
def test_hf_attach_sets_sync_each_batch_from_the_env(tmp_path: Path, grad_sync: str) -> None:
    """A real Trainer: MEMGUARD_GRAD_SYNC=each-batch sets Accelerate's flag at attach()."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from memguard_client.hf import attach

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        report_to=[], save_strategy="no", use_cpu=True,
    )
    trainer = transformers.Trainer(model=torch.nn.Linear(2, 1), args=args)
    kwargs = trainer.accelerator.gradient_state.plugin_kwargs
    kwargs.pop("sync_each_batch", None)  # GradientState is shared by every Accelerator
    try:
        attach(trainer, Guard(signal_file="", env={"MEMGUARD_GRAD_SYNC": grad_sync}))
        assert kwargs.get("sync_each_batch", False) == (grad_sync == "each-batch")
    finally:
        kwargs.pop("sync_each_batch", None)


def test_one_rank_or_no_fsdp_never_switches() -> None:
    """Without several FSDP ranks there is nothing to keep sharded: a downgrade changes only the
    micro-batch size (one process here, so no collective)."""
    from memguard_client.distributed import Agreement
    from memguard_client.recovery import StepRunner

    guard = Guard(signal_file="", env={"MEMGUARD_BATCH_SIZE": "8"})
    runner = StepRunner(guard, Agreement())
    runner.begin_step(fsdp=True)
    guard._current = dataclasses.replace(guard._current, batch_size=4)  # a sidecar's downgrade
    runner.begin_step(fsdp=True)
    assert runner.size == 4 and runner.downgrades == 1
    assert not runner.sync_each_batch
    assert Agreement().step_sync(4, False, True) == (4, False, True)
