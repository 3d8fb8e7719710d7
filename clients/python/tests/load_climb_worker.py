"""One rank of the load-climb test (test_load_climb.py): a stock HF Trainer under torchrun
(gloo, CPU) with the injected client, whose model loads slowly, layer by layer, as from slow
storage: the working set climbs steadily for ``--load-seconds`` before ``Trainer.train``, when
the client has reported nothing yet. Then it trains; from step ``--leak-from`` each step keeps
``--leak-mib`` more MiB alive (a real leak, during steps).

    torchrun --standalone --nproc_per_node 2 load_climb_worker.py OUT_DIR [options]

Rank 0 writes ``times.json``: the wall-clock times training began and the leak began.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import transformers

#: One layer: 1280 × 1280 fp32, 6.25 MiB.
WIDTH = 1280


class SlowlyLoaded(torch.nn.Module):
    """A deep stack of frozen layers under a trainable head, built one layer per interval."""

    def __init__(self, layers: int, interval_s: float) -> None:
        super().__init__()
        stack = []
        for _ in range(layers):
            layer = torch.nn.Linear(WIDTH, WIDTH, bias=False)
            layer.weight.requires_grad_(False)  # a frozen base: no gradients, no optimizer state
            stack.append(layer)
            time.sleep(interval_s)
        self.body = torch.nn.Sequential(*stack)
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: Any, labels: Any = None) -> Dict[str, Any]:
        with torch.no_grad():
            h = self.body(x) / WIDTH
        out = self.head(h).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--load-seconds", type=float, default=30.0)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-seconds", type=float, default=0.5)
    p.add_argument("--leak-from", type=int, default=2)
    p.add_argument("--leak-mib", type=int, default=8)
    a = p.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = SlowlyLoaded(a.layers, a.load_seconds / a.layers)
    data = [{"x": torch.randn(WIDTH), "labels": torch.randn(())} for _ in range(4 * a.steps)]
    leaked: List[torch.Tensor] = []
    times: Dict[str, float] = {}

    class Pace(transformers.TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times["train_begin"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step >= a.leak_from:
                times.setdefault("leak_begin", time.time())
                leaked.append(torch.ones(a.leak_mib << 18))  # fp32: MiB × 2^18 elements
            time.sleep(a.step_seconds)

    args = transformers.TrainingArguments(
        output_dir=str(a.out / "ckpt"), per_device_train_batch_size=4, max_steps=a.steps,
        save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
        ddp_backend="gloo", disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Pace()])
    trainer.train()
    if rank == 0:
        (a.out / "times.json").write_text(json.dumps(times))


if __name__ == "__main__":
    main()
