#!/usr/bin/env python3
"""What autograd really keeps for backward, per token and transformer layer.

Builds small real LLaMA-style models (LitGPT's `GPT`/`lora.GPT`, and transformers'
`LlamaForCausalLM` with PEFT), runs one forward pass on the CPU and measures, for each setup:

* `saved`: the distinct storages handed to `save_for_backward` (seen through
  `torch.autograd.graph.saved_tensors_hooks`), parameters and quantized weights excluded,
  by dtype;
* `live`: every storage created by an op during the forward pass and still alive after it
  (tracked weakly through a `TorchDispatchMode`), which also sees tensors an `autograd.Function` keeps
  as plain `ctx` attributes, as bitsandbytes' `MatMul4Bit` does (`ctx.tensors = (A, B)`),
  invisible to the hooks.

Per token and layer = (value with 4 layers - value with 2 layers) / (2 * B * S), so the
embeddings, the head and the loss cancel. Reported in bytes per token-layer and in units of
the hidden size `h`, so the figures transfer to any width.

Quantized setups replace every `nn.Linear` of the blocks with bitsandbytes' `Linear4bit`
(NF4, compute dtype bf16), as LitGPT's `BitsandbytesPrecision` and transformers'
`load_in_4bit` do. Two semantics of `MatMul4Bit` are measured:

* `bnb-legacy`: bitsandbytes up to 0.45 (what the published QLoRA runs used): forward runs
  `linear(A, dequantize_4bit(B).t())` and keeps `ctx.tensors = (A, B)`;
* `bnb-installed`: the installed bitsandbytes (0.48+ keeps `(None, B)`: no input).

`head_step_peak` measures one whole step's peak instead (forward and backward, live bytes
summed after every op): LitGPT's `lora.GPT` with the LM head's linear in bf16 or NF4, as
Fabric's `BitsandbytesPrecision` makes it (`--only head` runs just that). `softcap_tanh_bytes`
measures what Gemma 2's soft-capped eager attention keeps for its tanh (`--only softcap`).
`loss_step_peak` measures the cross-entropy's peak over the logits, upcast or not, with the
model's output held through backward or let go before it (`--only loss`).

Rerun: `python3 bench/accuracy/saved_tensors.py` (needs torch, transformers, peft,
bitsandbytes, litgpt; CPU only, about a minute). `--json` prints the raw figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

B, S = 2, 64
H, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 2, 704, 512
DT = torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def _static_ptrs(model: nn.Module) -> set[int]:
    ptrs = set()
    for t in list(model.parameters()) + list(model.buffers()):
        ptrs.add(t.untyped_storage().data_ptr())
    for mod in model.modules():
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        if qs is not None:
            for v in vars(qs).values():
                if torch.is_tensor(v):
                    ptrs.add(v.untyped_storage().data_ptr())
    return ptrs


class _Allocations(TorchDispatchMode):
    """Every storage an op creates during the forward pass, held weakly: what is still
    alive afterwards is what the forward pass left for backward (plus its output), however
    it is referenced (saved tensors, ctx attributes, closures)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t) and t.device.type == "cpu":
                st = t.untyped_storage()
                ptr = st.data_ptr()
                known = self.storages.get(ptr)
                # An address freed and handed out again is a new storage.
                if ptr != 0 and (known is None or known[0].expired()):
                    self.storages[ptr] = (StorageWeakRef(st), st.nbytes())
        return out

    def live_bytes(self, static: set[int]) -> int:
        return sum(n for ptr, (ref, n) in self.storages.items() if not ref.expired() and ptr not in static)


def forward_measure(model: nn.Module, ids: torch.Tensor, run) -> dict:
    """Runs `run(model, ids)` (a forward pass returning a scalar loss) and measures it."""
    static = _static_ptrs(model)
    saved: dict[int, tuple[int, str]] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in static and ptr != 0:
            saved[ptr] = (st.nbytes(), str(t.dtype).replace("torch.", ""))
        return t

    tracker = _Allocations()
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(model, ids)
    gc.collect()
    live = tracker.live_bytes(static)
    by_dtype: dict[str, int] = {}
    for nbytes, dt in saved.values():
        by_dtype[dt] = by_dtype.get(dt, 0) + nbytes
    loss.backward()  # the graph must be usable: the figures are of a trainable setup
    return {"saved": sum(by_dtype.values()), "saved_by_dtype": by_dtype, "live": live}


def per_token_layer(build, run, layers=(2, 4)) -> dict:
    lo, hi = (forward_measure(build(n), _ids(), run) for n in layers)
    span = (layers[1] - layers[0]) * B * S
    dtypes = set(lo["saved_by_dtype"]) | set(hi["saved_by_dtype"])
    return {
        "saved": (hi["saved"] - lo["saved"]) / span,
        "live": (hi["live"] - lo["live"]) / span,
        "saved_by_dtype": {
            d: (hi["saved_by_dtype"].get(d, 0) - lo["saved_by_dtype"].get(d, 0)) / span
            for d in sorted(dtypes)
        },
    }


def _ids() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(0, VOCAB, (B, S))


# ---------------------------------------------------------------------------------------------
# bitsandbytes: 4-bit linears, and the legacy MatMul4Bit semantics
# ---------------------------------------------------------------------------------------------


class LegacyMatMul4Bit(torch.autograd.Function):
    """bitsandbytes <= 0.45 `MatMul4Bit` (bitsandbytes/autograd/_functions.py), verbatim in
    what it computes and keeps: forward dequantizes the NF4 weight and runs `linear` (under
    no_grad, inside the Function), then keeps the input `A` and the packed weight `B` as plain
    ctx attributes whenever A or B needs a gradient."""

    @staticmethod
    def forward(ctx, A, B, out=None, bias=None, quant_state=None):
        import bitsandbytes.functional as F

        # The installed Linear4bit passes the weight untransposed (the old one passed
        # `weight.t()` and transposed back): the same product either way.
        output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype), bias)
        ctx.state = quant_state
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
        if any(ctx.needs_input_grad[:2]):
            ctx.tensors = (A, B)
        else:
            ctx.tensors = (None, None)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        import bitsandbytes.functional as F

        req_gradA, _, _, req_gradBias, _ = ctx.needs_input_grad
        A, B = ctx.tensors
        grad_A, grad_bias = None, None
        if req_gradBias:
            grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias)
        if req_gradA:
            grad_A = torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype))
        return grad_A, None, None, grad_bias, None


@contextmanager
def legacy_bnb(on: bool):
    import bitsandbytes.autograd._functions as fns

    original = fns.matmul_4bit
    if on:

        def matmul_4bit(A, B, quant_state, out=None, bias=None):
            return LegacyMatMul4Bit.apply(A, B, out, bias, quant_state)

        fns.matmul_4bit = matmul_4bit
        import bitsandbytes

        bitsandbytes.matmul_4bit = matmul_4bit
    try:
        yield
    finally:
        fns.matmul_4bit = original
        import bitsandbytes

        bitsandbytes.matmul_4bit = original


def quantize_linears(root: nn.Module, skip=("lora_",), source=DT) -> int:
    """Replaces every nn.Linear under `root` (LoRA's own matrices excepted) with an NF4
    `Linear4bit` holding the same weight, as `BitsandbytesPrecision` / `load_in_4bit` do.
    `source` is the dtype quantized from, which becomes the quant state's dtype and so the
    dtype `dequantize_4bit` returns: Fabric's `_Linear4bit.quantize` and bitsandbytes <= 0.42's
    `Params4bit.cuda` quantize from fp16 (`.half()`), bitsandbytes >= 0.43 from the weight's own."""
    import bitsandbytes as bnb

    n = 0
    for name, child in list(root.named_children()):
        if isinstance(child, nn.Linear) and not any(s in name for s in skip):
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=DT,
                quant_type="nf4",
            )
            q.weight = bnb.nn.Params4bit(child.weight.data.to(source), requires_grad=False, quant_type="nf4")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data.to(DT), requires_grad=False)
            q = q.to("cpu")
            setattr(root, name, q)
            n += 1
        else:
            n += quantize_linears(child, skip, source)
    return n


# ---------------------------------------------------------------------------------------------
# LitGPT
# ---------------------------------------------------------------------------------------------


def litgpt_config(n_layer: int, lora: dict | None):
    kw = dict(
        block_size=S,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=n_layer,
        n_head=HEADS,
        n_query_groups=KV_HEADS,
        n_embd=H,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=INTER,
    )
    if lora is None:
        from litgpt.config import Config

        return Config(**kw)
    from litgpt.lora import Config

    return Config(**kw, **lora)


def litgpt_build(n_layer, *, lora=None, quant=False, full=False, ckpt=False):
    torch.manual_seed(0)
    if lora is None:
        from litgpt.model import GPT
    else:
        from litgpt.lora import GPT, mark_only_lora_as_trainable
    model = GPT(litgpt_config(n_layer, lora)).to(DT)
    if lora is not None:
        mark_only_lora_as_trainable(model)
    elif not full:
        # Frozen everywhere, but the blocks' input needs a gradient (as below an adapter):
        # what a frozen layer keeps only to pass the gradient on.
        model.requires_grad_(False)
        model.transformer.wte.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
    if quant:
        for block in model.transformer.h:
            quantize_linears(block)
    model.train()
    model._ckpt = ckpt
    return model


def litgpt_run(model, ids):
    from litgpt.utils import chunked_cross_entropy

    if getattr(model, "_ckpt", False):
        # Fabric's activation_checkpointing_policy={Block}: each block under
        # torch.utils.checkpoint (non-reentrant), as FSDPStrategy wraps it.
        from torch.utils.checkpoint import checkpoint

        for block in model.transformer.h:
            if not hasattr(block, "_orig_forward"):
                block._orig_forward = block.forward
                block.forward = (
                    lambda *a, _b=block, **k: checkpoint(_b._orig_forward, *a, use_reentrant=False, **k)
                )
    logits = model(ids)
    return chunked_cross_entropy(logits[..., :-1, :], ids[..., 1:], chunk_size=128)


# ---------------------------------------------------------------------------------------------
# transformers + PEFT
# ---------------------------------------------------------------------------------------------


def hf_build(n_layer, *, lora_targets=None, dropout=0.05, quant=False, kbit_prep=False, full=False, ckpt=False,
             attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=n_layer,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=S,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).to(DT)
    if quant:
        for layer in model.model.layers:
            quantize_linears(layer)
        model.is_loaded_in_4bit = True
    if kbit_prep:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=bool(ckpt),
            gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"},
        )
    elif ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
        model.enable_input_require_grads()
    if lora_targets is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=lora_targets, task_type="CAUSAL_LM"),
        )
    elif not full:
        model.requires_grad_(False)
        model.get_input_embeddings().weight.requires_grad_(False)
        model.enable_input_require_grads()
    model.train()
    return model


def hf_run(model, ids):
    return model(input_ids=ids, labels=ids).loss


# ---------------------------------------------------------------------------------------------
# The frozen-linear question
# ---------------------------------------------------------------------------------------------


def frozen_linear_saves_input() -> dict:
    """Does a frozen 16-bit nn.Linear keep its input for backward? (It needs only the
    weight to pass the gradient back to its input.)"""
    out = {}
    for frozen in (True, False):
        lin = nn.Linear(H, INTER, bias=False).to(DT)
        lin.weight.requires_grad_(not frozen)
        x = torch.randn(B, S, H, dtype=DT, requires_grad=True)
        kept = []

        def pack(t):
            kept.append((tuple(t.shape), str(t.dtype), t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = lin(x)
        y.sum().backward()
        out["frozen" if frozen else "trainable"] = kept
    return out


# ---------------------------------------------------------------------------------------------
# Gemma 2's soft-capped attention scores
# ---------------------------------------------------------------------------------------------


def softcap_tanh_bytes() -> dict:
    """What LitGPT's soft-capped eager attention keeps for its `tanh`, per token and layer:
    a frozen bf16 LitGPT model with `attention_logit_softcapping=50` (the eager path Gemma 2
    takes), against the same path with `do_softcapping` made the identity. Expected: the tanh
    output, `p·heads·S`."""
    import dataclasses

    import litgpt.model as lm
    from litgpt.model import GPT

    def build(n_layer):
        torch.manual_seed(0)
        cfg = dataclasses.replace(litgpt_config(n_layer, None), attention_logit_softcapping=50.0)
        model = GPT(cfg).to(DT)
        model.requires_grad_(False)
        model.transformer.wte.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
        model.train()
        return model

    capped = per_token_layer(build, litgpt_run)
    original = lm.do_softcapping
    lm.do_softcapping = lambda x, thresh: x
    try:
        plain = per_token_layer(build, litgpt_run)
    finally:
        lm.do_softcapping = original
    return {"capped": capped["saved"], "identity": plain["saved"], "tanh": capped["saved"] - plain["saved"],
            "expected": 2 * HEADS * S}


# ---------------------------------------------------------------------------------------------
# One full step's peak: the LM head under Fabric's bitsandbytes precision
# ---------------------------------------------------------------------------------------------


class _PeakTracker(_Allocations):
    """`_Allocations` that also sums the live non-static bytes after every op (forward and
    backward) and remembers the largest sum and the biggest storages alive at that moment."""

    def __init__(self, static: set[int]):
        super().__init__()
        self.static = static
        self.peak = 0
        self.at_peak: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        live = [(n, p) for p, (ref, n) in self.storages.items() if not ref.expired() and p not in self.static]
        total = sum(n for n, _ in live)
        if total > self.peak:
            self.peak = total
            self.at_peak = sorted((n for n, _ in live), reverse=True)[:4]
        return out


def head_step_peak(quantize_head: bool, layers: int = 2, vocab: int = 32768, seq: int = 256,
                   source: torch.dtype = DT) -> dict:
    """Peak live bytes (parameters and packed weights excluded) of one forward + backward of
    LitGPT's `lora.GPT` as `litgpt/finetune/lora.py` runs it (LoRA on every linear and the
    head, `lm_head_chunk_size=128`, `chunked_cross_entropy`), with the blocks' linears in NF4
    and the LM head's inner `nn.Linear` either NF4 too (Fabric's `BitsandbytesPrecision`
    patches every `nn.Linear` built under `init_module`, the head's included) or bf16
    (transformers' bnb integration skips `lm_head`). Legacy bnb `MatMul4Bit` semantics."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    from litgpt.utils import chunked_cross_entropy

    torch.manual_seed(0)
    kw = dict(block_size=seq, vocab_size=vocab, padded_vocab_size=vocab, n_layer=layers, n_head=HEADS,
              n_query_groups=KV_HEADS, n_embd=H, rotary_percentage=1.0, parallel_residual=False, bias=False,
              norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=INTER)
    model = GPT(Config(**kw, **LORA_ALL, lora_head=True, lora_dropout=0.0)).to(DT)
    mark_only_lora_as_trainable(model)
    for block in model.transformer.h:
        quantize_linears(block, source=source)
    if quantize_head:
        quantize_linears(model.lm_head, source=source)
    model.train()
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (1, seq))
    tracker = _PeakTracker(_static_ptrs(model))
    with legacy_bnb(True), tracker:
        logits = model(ids, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]
        loss = chunked_cross_entropy(logits, ids[..., 1:])
        loss.backward()
    return {"quantize_head": quantize_head, "V": vocab, "h": H, "S": seq, "peak": tracker.peak,
            "largest_at_peak": tracker.at_peak, "head_bf16_bytes": vocab * H * 2}


def loss_step_peak(upcast: bool, held: bool, dtype: torch.dtype, vocab: int = 8192, seq: int = 256) -> float:
    """Peak live bytes of the LM head's output and the cross-entropy over it, one forward and
    backward, in units of `B·S·V·p`: the logits in `dtype`, upcast with `.float()` or not
    (`narrow`), shifted and flattened as universal-llm-trainer and transformers do, and the
    model's output either held through backward (a loop that keeps `outputs`) or let go
    before it (`Trainer.training_step` keeps only the loss; `del output`: `narrow-released`)."""
    torch.manual_seed(0)
    head = nn.Linear(H, vocab, bias=False).to(dtype)
    hidden = torch.randn(B, seq, H, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (B, seq))
    static = _static_ptrs(head) | {hidden.untyped_storage().data_ptr(), labels.untyped_storage().data_ptr()}
    tracker = _PeakTracker(static)
    with tracker:
        output = {"logits": head(hidden)}
        logits = output["logits"].float() if upcast else output["logits"]
        loss = nn.CrossEntropyLoss()(logits[:, :-1, :].reshape(-1, vocab), labels[:, 1:].reshape(-1))
        del logits
        if not held:
            del output
        loss.backward()
    return tracker.peak / (B * seq * vocab * dtype.itemsize)


# ---------------------------------------------------------------------------------------------


LORA_QV = dict(lora_r=8, lora_alpha=16, lora_query=True, lora_value=True)
LORA_ALL = dict(
    lora_r=8, lora_alpha=16, lora_query=True, lora_key=True, lora_value=True, lora_projection=True, lora_mlp=True
)


def setups():
    lg = lambda **k: (lambda n: litgpt_build(n, **k))  # noqa: E731
    hf = lambda **k: (lambda n: hf_build(n, **k))  # noqa: E731
    yield "litgpt", "frozen bf16 base (no adapter)", lg(), False
    yield "litgpt", "full fine-tuning", lg(full=True), False
    yield "litgpt", "LoRA q,v dropout 0.05", lg(lora={**LORA_QV, "lora_dropout": 0.05}), False
    yield "litgpt", "LoRA q,v dropout 0", lg(lora={**LORA_QV, "lora_dropout": 0.0}), False
    yield "litgpt", "LoRA all dropout 0.05", lg(lora={**LORA_ALL, "lora_dropout": 0.05}), False
    yield "litgpt", "QLoRA q,v dropout 0.05 (bnb-legacy)", lg(lora={**LORA_QV, "lora_dropout": 0.05}, quant=True), True
    yield "litgpt", "QLoRA q,v dropout 0.05 (bnb-installed)", lg(lora={**LORA_QV, "lora_dropout": 0.05}, quant=True), False
    yield "litgpt", "QLoRA all dropout 0.05 (bnb-legacy)", lg(lora={**LORA_ALL, "lora_dropout": 0.05}, quant=True), True
    yield "litgpt", "QLoRA q,v dropout 0 (bnb-legacy)", lg(lora={**LORA_QV, "lora_dropout": 0.0}, quant=True), True
    yield "litgpt", "LoRA q,v + checkpointing", lg(lora={**LORA_QV, "lora_dropout": 0.05}, ckpt=True), False
    yield "litgpt", "QLoRA q,v + checkpointing (bnb-legacy)", lg(lora={**LORA_QV, "lora_dropout": 0.05}, quant=True, ckpt=True), True
    yield "litgpt", "full fine-tuning + checkpointing", lg(full=True, ckpt=True), False
    qv = ["q_proj", "v_proj"]
    allt = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    yield "hf", "LoRA q,v dropout 0.05", hf(lora_targets=qv), False
    yield "hf", "LoRA q,v dropout 0", hf(lora_targets=qv, dropout=0.0), False
    yield "hf", "LoRA all dropout 0.05", hf(lora_targets=allt), False
    yield "hf", "QLoRA all, no kbit prep (bnb-legacy)", hf(lora_targets=allt, quant=True), True
    yield "hf", "QLoRA all + prepare_model_for_kbit_training (bnb-legacy)", hf(lora_targets=allt, quant=True, kbit_prep=True), True
    yield "hf", "QLoRA q,v + prepare_model_for_kbit_training (bnb-legacy)", hf(lora_targets=qv, quant=True, kbit_prep=True), True
    yield "hf", "LoRA all + checkpointing (non-reentrant)", hf(lora_targets=allt, ckpt=True), False
    yield "hf", "QLoRA all + kbit prep + checkpointing non-reentrant (bnb-legacy)", hf(lora_targets=allt, quant=True, kbit_prep=True, ckpt=True), True
    yield "hf", "QLoRA all + kbit prep + checkpointing reentrant (bnb-legacy)", hf(lora_targets=allt, quant=True, kbit_prep=True, ckpt="reentrant"), True
    yield "hf", "QLoRA all + kbit prep + checkpointing reentrant (bnb-installed)", hf(lora_targets=allt, quant=True, kbit_prep=True, ckpt="reentrant"), False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="", help="substring of the setups to run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {"shape": dict(B=B, S=S, h=H, heads=HEADS, kv_heads=KV_HEADS, I=INTER, V=VOCAB, dtype=str(DT)),
               "frozen_linear": frozen_linear_saves_input(), "rows": []}
    for family, name, build, legacy in setups():
        if args.only and args.only not in f"{family} {name}":
            continue
        run = litgpt_run if family == "litgpt" else hf_run
        with legacy_bnb(legacy):
            r = per_token_layer(build, run)
        r.update(family=family, setup=name)
        results["rows"].append(r)
        if not args.json:
            dt = ", ".join(f"{d} {v / H:.2f}h" for d, v in r["saved_by_dtype"].items() if abs(v) > 0.5)
            print(f"{family:7} {name:58} saved {r['saved']:8.0f} B = {r['saved'] / H:6.2f}h   "
                  f"live {r['live']:8.0f} B = {r['live'] / H:6.2f}h   [{dt}]", flush=True)
    if not args.only or "softcap" in args.only:
        results["softcap"] = softcap_tanh_bytes()
        if not args.json:
            sc = results["softcap"]
            print(f"soft-capped scores (heads {HEADS}, S {S}): saved {sc['capped']:.0f} B against "
                  f"{sc['identity']:.0f} B without the tanh: {sc['tanh']:.0f} B per token-layer "
                  f"(p·heads·S = {sc['expected']})", flush=True)
    results["loss_step"] = []
    if not args.only or "loss" in args.only:
        for dtype in (torch.bfloat16, torch.float32):
            for upcast in (False, True):
                for held in (True, False):
                    peak = loss_step_peak(upcast, held, dtype)
                    results["loss_step"].append({"dtype": str(dtype), "upcast": upcast, "held": held, "peak": peak})
                    if not args.json:
                        print(f"loss step peak, {str(dtype).replace('torch.', ''):8} "
                              f"{'upcast' if upcast else 'narrow':6} output {'held' if held else 'let go':6}: "
                              f"{peak:.2f}·B·S·V·p", flush=True)
    results["head_step"] = []
    if not args.only or "head" in args.only:
        for vocab in (32768, 65536):
            bf16, nf4 = (head_step_peak(q, vocab=vocab, seq=64) for q in (False, True))
            # Quantized from fp16, as Fabric's `_Linear4bit.quantize` does.
            nf4_fp16 = head_step_peak(True, vocab=vocab, seq=64, source=torch.float16)
            rise = (nf4["peak"] - bf16["peak"]) / bf16["head_bf16_bytes"]
            rise16 = (nf4_fp16["peak"] - bf16["peak"]) / bf16["head_bf16_bytes"]
            results["head_step"].append({"bf16_head": bf16, "nf4_head": nf4, "nf4_head_from_fp16": nf4_fp16,
                                         "rise_over_Vhp": rise, "rise_over_Vhp_from_fp16": rise16})
            if not args.json:
                print(f"step peak, LM head bf16 vs NF4 (V {vocab}, h {H}, S 64): {bf16['peak']} B -> "
                      f"{nf4['peak']} B, +{rise:.2f}·V·h·p (quantized from fp16: {nf4_fp16['peak']} B, "
                      f"+{rise16:.2f}·V·h·p); largest alive at the NF4 peaks: {nf4['largest_at_peak']}, "
                      f"from fp16 {nf4_fp16['largest_at_peak']}", flush=True)
    if args.json:
        json.dump(results, sys.stdout, indent=1)
    else:
        fl = results["frozen_linear"]
        print(f"\nfrozen nn.Linear saves: {fl['frozen']}\ntrainable nn.Linear saves: {fl['trainable']}")
        print(f"(h = {H}, q = {HEADS * H // HEADS}, kv = {KV_HEADS * H // HEADS}, I = {INTER}; bytes per token and layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
