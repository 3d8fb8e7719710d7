"""LoRA at train start (issue 37): the client reads the adapter PEFT really wrapped (its rank,
the projections, its dropout) from the model, never from `target_modules`; the sidecar plans it
only when the LoRA it sizes is the one that trains. Real transformers and peft models on the
CPU; the end-to-end plan is in `test_train_start_plan.py`."""
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memguard_client.train_config import LORA_TARGET_BITS, model_config  # noqa: E402

#: `memguard_api::signal::LORA_TARGET_BITS`: q 1, k 2, v 4, o 8, gate 16, up 32, down 64.
Q, K, V, O, GATE, UP, DOWN = (1 << i for i in range(7))


def tiny_llama() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def lora(model: Any, **kw: Any) -> Any:
    return peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **kw))


def test_the_bits_are_the_sidecars() -> None:
    assert LORA_TARGET_BITS == ("q", "k", "v", "o", "gate", "up", "down")


def test_the_projections_peft_wrapped_and_its_dropout_are_reported() -> None:
    knobs = model_config(lora(tiny_llama(), r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05))
    assert knobs["lora-rank"] == 8 and knobs["lora-targets"] == Q | V and knobs["lora-dropout"] == 1
    # 2 layers × 8·((64 + 64) + (64 + 32)): q is 64 → 64, v 64 → 2 heads × 16.
    assert knobs["trainable-params"] == 2 * 8 * ((64 + 64) + (64 + 32))
    every = model_config(lora(tiny_llama(), r=4, target_modules="all-linear", lora_dropout=0.0))
    assert every["lora-targets"] == Q | K | V | O | GATE | UP | DOWN and every["lora-dropout"] == 0
    # A regular expression over the module names: what it matched is what counts.
    pattern = model_config(lora(tiny_llama(), r=4, target_modules=r".*\.(k_proj|down_proj)"))
    assert pattern["lora-targets"] == K | DOWN


def test_what_the_client_cannot_name_for_sure_is_left_out() -> None:
    # DoRA is another adapter; the estimate of LoRA would not be it.
    dora = model_config(lora(tiny_llama(), r=4, target_modules=["q_proj"], use_dora=True))
    assert "lora-targets" not in dora and "lora-dropout" not in dora
    # GPT-2's fused `c_attn` is no Llama-family projection.
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256))
    knobs = model_config(lora(gpt2, r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    assert knobs["lora-rank"] == 4 and "lora-targets" not in knobs
    # Layers that wrap different projections: no one set of targets.
    mixed = tiny_llama()
    mixed = lora(mixed, r=4, target_modules=["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"])
    assert "lora-targets" not in model_config(mixed)
    # A subset of layers wraps the same projections: reported; the sidecar finds the trainable
    # count is not an all-layer LoRA's and plans nothing (decide's trainer_config tests).
    half = model_config(lora(tiny_llama(), r=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[0]))
    assert half["lora-targets"] == Q | V and half["trainable-params"] == 8 * ((64 + 64) + (64 + 32))
