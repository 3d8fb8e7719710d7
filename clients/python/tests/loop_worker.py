"""One rank of the custom-loop config tests (test_loop_config.py): a plain torch loop under
torchrun (gloo, CPU) with the injected client, which memguard cannot re-chunk from outside.

    torchrun --standalone --nproc_per_node 2 loop_worker.py plain|batcher

``plain``: a small MLP and AdamW, no memguard code at all. ``batcher``: a tiny Llama built from
its config (no download) run through :class:`memguard_client.torch.MicroBatcher`, its batches
``input_ids`` of :data:`SEQ` tokens.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

SEQ = 48
ROWS = 4


def plain() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(ROWS, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(1.1)  # the step reporter posts at most once a second


def batcher() -> None:
    import transformers

    from memguard_client import Guard
    from memguard_client.torch import MicroBatcher

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=SEQ,
    )
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mb = MicroBatcher(Guard())
    for _ in range(3):
        ids = torch.randint(0, 512, (ROWS, SEQ))
        mb.backward({"input_ids": ids, "labels": ids}, lambda b: model(**b).loss, model=model)
        mb.step(opt)
        time.sleep(1.1)
    mb.close()


if __name__ == "__main__":
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    try:
        {"plain": plain, "batcher": batcher}[sys.argv[1]]()
    finally:
        dist.destroy_process_group()
