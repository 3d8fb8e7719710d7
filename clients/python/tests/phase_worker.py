"""One rank of the 2-rank save-deferral test (test_phase.py): a real HF Trainer under torchrun
(gloo, CPU). Only rank 1's signal file is at ``warn``, as when only one pod's sidecar sees
pressure; both ranks must put off the save due at step 2 and save at the last step (4).

    torchrun --standalone --nproc_per_node 2 phase_worker.py OUT_DIR

Every rank writes ``rank<r>.json``: the steps at which it saved and its deferral count.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import transformers

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from memguard_client import Guard  # noqa: E402
from memguard_client.hf import attach  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x: Any, labels: Any = None) -> Dict[str, Any]:
        out = self.lin(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    level = "warn" if rank == 1 else "ok"
    signal_file = out / f"signal{rank}.json"
    signal_file.write_text(json.dumps({
        "version": 1, "seq": 1, "level": level, "batch_size": 4, "grad_accumulation": 1,
        "grad_checkpointing": False, "reason": "test", "pressure": {"memory_ratio": 0.72},
        "timestamp": "2026-11-29T05:00:00.000Z",
    }))
    saved: List[int] = []

    class Saves(transformers.TrainerCallback):  # type: ignore[misc]
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            saved.append(int(state.global_step))

    torch.manual_seed(0)
    data = [{"x": torch.randn(3), "labels": torch.randn(())} for _ in range(64)]
    args = transformers.TrainingArguments(
        output_dir=str(out / "ckpt"), per_device_train_batch_size=4, max_steps=4,
        save_strategy="steps", save_steps=2, logging_strategy="no", report_to=[],
        use_cpu=True, ddp_backend="gloo",
    )
    trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[Saves()])
    cb = attach(trainer, Guard(signal_file=str(signal_file), env={}, oom_hook=False))
    trainer.train()
    (out / f"rank{rank}.json").write_text(
        json.dumps({"saved": saved, "saves_deferred": cb.saves_deferred, "level": cb.guard.level})
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
