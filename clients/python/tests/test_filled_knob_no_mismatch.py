"""A knob admission could not read, filled from the trainer's report (issue 37), is not a
config mismatch at the next run: the real `memguard` CLI admits a bespoke script whose batch
its own parser sets (unknown to admission); a real HF Trainer with the client reports its config
to the real `memguard-sidecar`; `memguard explain` learns the report and admits the next pod on
it (the batch filled, the plan as `MEMGUARD_*` env); the sidecar of that pod, given its admitted
config, compares the trainer's next report with it and finds no mismatch."""
import json
import subprocess
import time
from pathlib import Path
from typing import Any, Dict

import pytest

from test_guarded_next_admission import admit, env_of, finished, memguard, sidecar_container
from test_train_start_plan import Sidecar, limit_2g

__all__ = ["limit_2g"]  # the fixture, used by name

#: A bespoke `train.py` on one 24 GiB GPU that passes no batch flag: admission cannot read it.
POD: Dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "sft-1", "namespace": "ml", "uid": "uid-sft-1",
                 "labels": {"memguard.io/enabled": "true"},
                 "annotations": {"memguard.io/gpu-memory": "24Gi"}},
    "spec": {"restartPolicy": "Never", "containers": [{
        "name": "trainer", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}},
        "command": ["python", "train.py"],
        "args": ["--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--gradient_accumulation_steps", "1",
                 "--max_length", "2048", "--output_dir", "/out"]}]},
}
ADMITTED = "MEMGUARD_SIDECAR_ADMITTED_CONFIG"


def report_16x1(tmp: Path, url: str) -> None:
    """A real HF Trainer at 16 × 1 with the client attached: it reports its config at train
    start."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from memguard_client import Guard
    from memguard_client.hf import attach

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x: Any, labels: Any = None) -> Dict[str, Any]:
            out = self.lin(x).squeeze(-1)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    data = [{"x": torch.randn(3), "labels": torch.randn(())} for _ in range(32)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"), per_device_train_batch_size=16, gradient_accumulation_steps=1,
        num_train_epochs=1, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True)
    trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=data)
    attach(trainer, Guard(sidecar_url=url, env={}, oom_hook=False))
    trainer.train()


def run(tmp: Path, cgroup: Path, admitted: Dict[str, str]) -> Dict[str, Any]:
    tmp.mkdir()
    sidecar = Sidecar(tmp, cgroup, train_start=None, env=admitted)
    try:
        report_16x1(tmp, sidecar.url)
        deadline = time.monotonic() + 10
        while 'memguard_sidecar_trainer_config{knob="batch-size"}' not in sidecar.metrics():
            assert time.monotonic() < deadline, "no report"
            time.sleep(0.1)
    finally:
        summary = sidecar.stop()
    return summary


def test_a_batch_filled_from_the_report_is_not_a_mismatch_at_the_next_run(
    tmp_path: Path, limit_2g: Path
) -> None:
    first = admit(tmp_path, POD)
    estimate = json.loads(first["metadata"]["annotations"]["memguard.io/estimate"])
    assert "batch-size" in estimate["unknown"], estimate
    # A plan on an unread batch is a guess: nothing admitted to compare with.
    assert ADMITTED not in env_of(sidecar_container(first))
    summary = run(tmp_path / "run1", limit_2g, {})
    assert summary["trainer_config"]["batch-size"] == 16, summary

    (tmp_path / "status.json").write_text(json.dumps(finished(first, summary)))
    explained = json.loads(memguard(tmp_path, "explain", "-f", "status.json", "-o", "json"))
    profile = {"apiVersion": "training.memguard.io/v1alpha1", "kind": "MemoryProfile",
               "metadata": {"name": explained["next"]["profile"]["name"], "namespace": "ml"},
               "spec": explained["next"]["profile"]["spec"],
               "status": explained["next"]["profile"]["status"]}
    second_pod = json.loads(json.dumps(POD))
    second_pod["metadata"].update(name="sft-2", uid="uid-sft-2")
    second = admit(tmp_path, second_pod, profile)
    estimate = json.loads(second["metadata"]["annotations"]["memguard.io/estimate"])
    assert estimate["sources"]["batch-size"] == "profile:trainer-report", estimate["sources"]
    planned = env_of(second["spec"]["containers"][0])
    assert int(planned["MEMGUARD_BATCH_SIZE"]) < 16, planned
    admitted = env_of(sidecar_container(second))[ADMITTED]
    assert "batch-size=16" in admitted and "grad-accumulation=1" in admitted, admitted

    summary2 = run(tmp_path / "run2", limit_2g, {ADMITTED: admitted})
    assert summary2["trainer_config"]["batch-size"] == 16, summary2
    assert summary2.get("config_mismatch", []) == [], summary2
