"""The config a trainer really runs at, read from its own objects at train start (issue 37).

The one reader of a trainer's config for the sidecar's ``config`` report
(``memguard_api::signal::TRAINER_CONFIG_KNOBS``): the ``TrainingArguments`` (TRL's configs are
subclasses), the model and its ``config``, the accelerator's sharding, and the first
micro-batch. Only what the objects say: a value that is missing, or that this module cannot
read for sure, is left out, never guessed; the sidecar then makes no plan and says which
value was missing.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Mapping, Optional

#: The optimizers the sidecar knows, by ``memguard_api::signal::OPTIMIZER_CODES`` index.
OPTIMIZER_CODES = (
    "adamw",
    "adam",
    "sgd",
    "sgd-momentum",
    "adafactor",
    "adamw-8bit",
    "adamw-8bit-torchao",
)

#: ``TrainingArguments.optim`` values → the estimator's optimizer (others are not reported).
_HF_OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "adamw_apex_fused": "adamw",
    "adamw_torch_xla": "adamw",
    "adamw_torch_npu_fused": "adamw",
    "adafactor": "adafactor",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",
    "paged_adamw_8bit": "adamw-8bit",
    "adamw_torch_8bit": "adamw-8bit-torchao",
    "sgd": "sgd",
}

#: The projections a LoRA may wrap, by ``memguard_api::signal::LORA_TARGET_BITS`` bit (1 << i),
#: under transformers' Llama-family module names.
LORA_TARGET_BITS = ("q", "k", "v", "o", "gate", "up", "down")
_LORA_MODULES = {f"{name}_proj": 1 << i for i, name in enumerate(LORA_TARGET_BITS)}

#: Attention implementations that keep no ``S²`` score matrix.
_MEMORY_EFFICIENT_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
_EAGER_ATTENTION = ("eager",)

#: Module names of a gated FFN's gate projection (Llama, Mistral, Qwen, Gemma; Phi-3).
_GATE_NAMES = ("gate_proj", "gate_up_proj")


class _Knobs(dict):  # type: ignore[type-arg]
    """knob → number; a bool as 0/1; anything else (None, a negative, a string) left out."""

    def put(self, knob: str, value: Any) -> None:
        if isinstance(value, bool):
            self[knob] = 1.0 if value else 0.0
        elif isinstance(value, (int, float)) and value >= 0:
            self[knob] = float(value)


def trainer_config(args: Any, model: Any = None, accelerator: Any = None) -> Dict[str, float]:
    """The config a Trainer runs at: its arguments, its model's shape and parameters, its
    sharding (see the module doc)."""
    out = _Knobs()
    out.put("batch-size", getattr(args, "per_device_train_batch_size", None))
    out.put("grad-accumulation", getattr(args, "gradient_accumulation_steps", None))
    out.put("grad-checkpointing", getattr(args, "gradient_checkpointing", None))
    out.put("world-size", getattr(args, "world_size", None))
    # TRL's configs cut at `max_length` (`max_seq_length` before TRL 0.20); at the first step
    # the run's own bound replaces it (`run_sequence`).
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out.put("seq-length", value)
            break
    out.put("bf16", getattr(args, "bf16", None))
    out.put("fp16", getattr(args, "fp16", None))
    out.put("fused-loss", getattr(args, "use_liger_kernel", None))
    optim = getattr(args, "optim", None)
    optim = getattr(optim, "value", optim)
    name = _HF_OPTIMIZERS.get(str(optim)) if optim is not None else None
    if name is not None:
        out.put("optimizer", OPTIMIZER_CODES.index(name))
    if model is not None:
        out.update(model_config(model))
    out.update(sharding(accelerator))
    out.update(local_ranks(getattr(args, "world_size", None)))
    return dict(out)


def loop_config(model: Any = None, optimizer: Any = None) -> Dict[str, float]:
    """What a custom loop's objects say, for a loop memguard cannot re-chunk from outside: the
    world size of the initialised ``torch.distributed`` process group and the ranks in this
    container; with ``model``, its shape and parameters; with ``optimizer``, the parameters it
    steps and its kind. No micro-batch: only the loop knows what a batch is, so the sidecar
    makes no plan on it. No sequence either: a loop's first batch says nothing of its later,
    perhaps longer ones (and a profile would fill an unread sequence with it)."""
    out = _Knobs()
    world = process_group_size()
    out.put("world-size", world)
    out.update(local_ranks(world))
    if optimizer is not None:
        out.update(optimizer_config(optimizer))
    if model is not None:
        out.update(model_config(model))
    return dict(out)


def process_group_size() -> Optional[int]:
    """The world size of the initialised default process group; None when there is none
    (``torch.distributed`` is not imported here: a process that never did has none)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:
        return None
    return None


#: ``torch.optim`` classes → the estimator's optimizer (SGD is split on its momentum).
_TORCH_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam", "Adafactor": "adafactor"}


def optimizer_config(optimizer: Any) -> Dict[str, float]:
    """The parameters ``optimizer`` steps (each once), and its kind when it is one of
    ``torch.optim``'s the estimator knows."""
    out = _Knobs()
    try:
        groups = list(optimizer.param_groups)
        seen = {id(p): p for g in groups for p in g["params"]}
        out.put("trainable-params", int(sum(p.numel() for p in seen.values())))
    except Exception:  # not a torch optimizer: nothing to say of its parameters
        return dict(out)
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim"):
        return dict(out)
    name = _TORCH_OPTIMIZERS.get(cls.__name__)
    if cls.__name__ == "SGD":
        momentum = {g.get("momentum", 0) for g in groups}
        if momentum == {0}:
            name = "sgd"
        elif 0 not in momentum:
            name = "sgd-momentum"
    if name is not None:
        out.put("optimizer", OPTIMIZER_CODES.index(name))
    return dict(out)


def local_ranks(world_size: Any, environ: Optional[Mapping[str, str]] = None) -> Dict[str, float]:
    """The ranks in this container, which share its memory limit: torchrun's
    ``LOCAL_WORLD_SIZE``; one for a run of one rank; unknown otherwise."""
    out = _Knobs()
    raw = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE")
    if raw is not None and raw.strip().isdigit() and int(raw) >= 1:
        out.put("local-ranks", int(raw))
    elif world_size == 1:
        out.put("local-ranks", 1)
    return dict(out)


def model_config(model: Any) -> Dict[str, float]:
    """The model's shape (its ``config``), parameter counts, dtype, quantization, attention and
    device."""
    out = _Knobs()
    try:
        params = list(model.parameters())
    except Exception:  # a model-like object without parameters: nothing to say of them
        params = []
    if params:
        out.put("params", int(sum(p.numel() for p in params)))
        out.put("trainable-params", int(sum(p.numel() for p in params if p.requires_grad)))
        first = next((p for p in params if p.is_floating_point()), None)
        if first is not None:
            out.put("param-bits", {4: 32, 2: 16}.get(first.element_size()))
            kind = first.device.type
            if kind in ("cuda", "cpu"):
                out.put("gpu", kind == "cuda")
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, dict) and peft:
        out.put("lora-rank", getattr(next(iter(peft.values())), "r", None))
        if len(peft) == 1:
            out.update(lora_modules(model, next(iter(peft.values()))))
    config = getattr(model, "config", None)
    text = config
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text()
        except Exception:
            text = config
    if text is not None:
        hidden = _int(text, "hidden_size")
        heads = _int(text, "num_attention_heads")
        out.put("hidden-size", hidden)
        out.put("num-layers", _int(text, "num_hidden_layers"))
        out.put("num-heads", heads)
        # transformers' convention: no `num_key_value_heads` is classic multi-head attention.
        kv = _int(text, "num_key_value_heads")
        out.put("num-kv-heads", kv if kv is not None else heads)
        head_dim = _int(text, "head_dim")
        if head_dim is None and hidden is not None and heads:
            head_dim = hidden // heads
        out.put("head-dim", head_dim)
        out.put("intermediate-size", _int(text, "intermediate_size"))
        out.put("vocab-size", _int(text, "vocab_size"))
        experts = [_int(text, n) for n in ("num_local_experts", "num_experts", "n_routed_experts")]
        named = [e for e in experts if e is not None]
        out.put("num-experts", max(named) if named else 1)
        attention = getattr(config, "_attn_implementation", None)
        if attention in _MEMORY_EFFICIENT_ATTENTION:
            out.put("flash-attention", True)
        elif attention in _EAGER_ATTENTION:
            out.put("flash-attention", False)
        quant = getattr(config, "quantization_config", None)
        if getattr(model, "is_loaded_in_4bit", False) or _flag(quant, "load_in_4bit"):
            out.put("quant-bits", 4)
        elif getattr(model, "is_loaded_in_8bit", False) or _flag(quant, "load_in_8bit"):
            out.put("quant-bits", 8)
        elif quant is None:
            out.put("quant-bits", 0)
    tied = _tied(model)
    if tied is not None:
        out.put("tie-embeddings", tied)
    try:
        names = [n for n, _ in model.named_modules()]
    except Exception:
        names = []
    if names:
        out.put("gated-ffn", any(n.rsplit(".", 1)[-1] in _GATE_NAMES for n in names))
    return dict(out)


def lora_modules(model: Any, peft_config: Any) -> Dict[str, float]:
    """``lora-targets`` and ``lora-dropout`` from the modules PEFT really wrapped (not from
    ``target_modules``, which may be a pattern). Nothing when one of them is not a Llama-family
    projection, when DoRA is on, or when the layers differ in what they wrap: the sidecar then
    plans nothing. Whether the rank and the layers are what trains, the sidecar checks against
    the trainable parameters."""
    out = _Knobs()
    if getattr(peft_config, "use_dora", False):
        return dict(out)
    targets = 0
    dropout = False
    per_layer: Dict[str, int] = {}
    try:
        modules = list(model.named_modules())
    except Exception:
        return dict(out)
    for name, module in modules:
        if not hasattr(module, "lora_A"):
            continue
        parent, _, leaf = name.rpartition(".")
        bit = _LORA_MODULES.get(leaf)
        if bit is None:
            return dict(out)
        targets |= bit
        per_layer[parent] = per_layer.get(parent, 0) | bit
        for d in getattr(module, "lora_dropout", {}).values():
            dropout = dropout or (type(d).__name__ == "Dropout" and getattr(d, "p", 0) > 0)
    by_block: Dict[str, int] = {}
    for parent, bits in per_layer.items():
        # `model.layers.3.self_attn` and `model.layers.3.mlp`: one block, two parents.
        block = parent.rsplit(".", 1)[0] if parent.endswith(("self_attn", "mlp")) else parent
        by_block[block] = by_block.get(block, 0) | bits
    if not targets or len(set(by_block.values())) != 1:
        return dict(out)
    out.put("lora-targets", targets)
    out.put("lora-dropout", dropout)
    return dict(out)


def sharding(accelerator: Any) -> Dict[str, float]:
    """FSDP, or DeepSpeed's ZeRO stage, from the accelerator's state."""
    out = _Knobs()
    if accelerator is None:
        return dict(out)
    kind = str(getattr(accelerator, "distributed_type", ""))
    out.put("fsdp", kind.endswith("FSDP"))
    if kind.endswith("DEEPSPEED"):
        plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
        out.put("deepspeed-stage", _int(plugin, "zero_stage"))
    else:
        out.put("deepspeed-stage", 0)
    return dict(out)


def first_batch(inputs: Any) -> Dict[str, float]:
    """The padded length of one micro-batch's ``input_ids`` as ``seq-length``: the sequence of
    that batch only. A collator that pads to the longest row of each batch makes later batches
    longer, so a Trainer's run is read with :func:`run_sequence` instead."""
    out = _Knobs()
    out.put("seq-length", _batch_length(inputs))
    return dict(out)


#: Rows of a training set whose lengths are read at train start (a column of Arrow data or a
#: list in memory: milliseconds); a larger or lazier set leaves the sequence unknown.
MAX_ROWS_READ = 200_000


def run_sequence(trainer: Any, inputs: Any) -> Dict[str, float]:
    """The longest sequence a Trainer's run will see, as ``seq-length``, or nothing.

    The first micro-batch alone is not it: a collator that pads each batch to its longest row
    (transformers' default) makes later batches longer whenever the data's lengths vary. What
    bounds the run, in this order:

    - the training set's longest ``input_ids`` (a ``datasets.Dataset`` column, or a list of
      rows in memory, up to :data:`MAX_ROWS_READ` rows), rounded up to the collator's
      ``pad_to_multiple_of``, or its ``max_length`` when it pads every batch to that;
    - a collator that pads every batch to its ``max_length``;
    - TRL's ``max_length`` (``max_seq_length`` before TRL 0.20), which its data is cut at.

    Never shorter than the first micro-batch. Without any of these the sequence is unknown and
    the sidecar makes no plan (it says ``seq-length`` was not reported)."""
    out = _Knobs()
    first = _batch_length(inputs)
    collator = getattr(trainer, "data_collator", None)
    fixed = _int(collator, "max_length") if getattr(collator, "padding", None) == "max_length" else None
    longest = _dataset_longest(getattr(trainer, "train_dataset", None))
    if longest is not None:
        multiple = _int(collator, "pad_to_multiple_of")
        if multiple and multiple > 0:
            longest = -(-longest // multiple) * multiple
        bound: Optional[int] = max(longest, fixed) if fixed is not None else longest
    elif fixed is not None:
        bound = fixed
    else:
        args = getattr(trainer, "args", None)
        bound = next((v for v in (_int(args, "max_length"), _int(args, "max_seq_length")) if v), None)
    if bound is not None:
        out.put("seq-length", max(bound, first or 0))
    return dict(out)


def _batch_length(inputs: Any) -> Optional[int]:
    ids = inputs.get("input_ids") if isinstance(inputs, dict) or hasattr(inputs, "get") else None
    shape = getattr(ids, "shape", None)
    if shape is not None and len(shape) >= 2:
        return int(shape[-1])
    return None


def _dataset_longest(dataset: Any) -> Optional[int]:
    """The longest ``input_ids`` of a training set whose lengths can be read at once; None for
    any other (an iterable or lazily computed set, one without ``input_ids``, too many rows)."""
    try:
        rows = len(dataset)
    except Exception:
        return None
    if not 0 < rows <= MAX_ROWS_READ:
        return None
    try:
        names = getattr(dataset, "column_names", None)
        if isinstance(names, list):  # datasets.Dataset: one Arrow column
            if "input_ids" not in names:
                return None
            column = dataset["input_ids"]
        elif isinstance(dataset, (list, tuple)):
            column = [row["input_ids"] for row in dataset]
        else:  # a torch Dataset's __getitem__ may tokenize or read files: not at train start
            return None
        lengths = [len(ids) for ids in column]
    except Exception:
        return None
    return max(lengths) if lengths else None


def _int(obj: Any, name: str) -> Optional[int]:
    value = getattr(obj, name, None) if obj is not None else None
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _flag(obj: Any, name: str) -> bool:
    if obj is None:
        return False
    if isinstance(obj, dict):
        return bool(obj.get(name, False))
    return bool(getattr(obj, name, False))


def _tied(model: Any) -> Optional[bool]:
    """Whether the input and output embeddings are one matrix, read from the model."""
    try:
        inp = model.get_input_embeddings()
        outp = model.get_output_embeddings()
    except Exception:
        return None
    if inp is None or outp is None:
        return None
    return getattr(inp, "weight", None) is getattr(outp, "weight", None)
