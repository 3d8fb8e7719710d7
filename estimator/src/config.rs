//! What a training run is: the model's shape and how it is trained. Plain data, validated once.

use std::fmt;
use std::str::FromStr;

/// Declares a string-named enum with `FromStr`, `Display`, `ALL` and `name()` in one place, so
/// the spelling users write (annotations, CLI flags) is defined exactly once.
macro_rules! named_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal $(| $alias:literal)*),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
        pub enum $name {
            $($(#[$vmeta])* #[cfg_attr(feature = "serde", serde(rename = $text))] $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The canonical spelling, as written in annotations and flags.
            pub const fn name(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl FromStr for $name {
            type Err = ConfigError;
            fn from_str(s: &str) -> Result<Self, ConfigError> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($text $(| $alias)* => Ok($name::$variant),)+
                    _ => Err(ConfigError::UnknownValue {
                        field: stringify!($name),
                        value: s.to_string(),
                        expected: concat!($($text, " "),+),
                    }),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

named_enum! {
    /// How the model is trained.
    Method {
        /// Every parameter is trained.
        Full => "full" | "full-finetune",
        /// Low-rank adapters on a frozen base.
        Lora => "lora",
        /// LoRA on a 4-bit NF4-quantised frozen base.
        Qlora => "qlora",
        /// Weight-decomposed LoRA: LoRA plus a trainable magnitude vector per adapted matrix.
        Dora => "dora",
    }
}

named_enum! {
    /// The optimizer, which decides how many bytes of state each trainable parameter carries.
    Optimizer {
        /// AdamW: two moments per parameter.
        AdamW => "adamw" | "adamw-torch" | "adamw_torch",
        /// Adam: two moments per parameter.
        Adam => "adam",
        /// Plain SGD: no state.
        Sgd => "sgd",
        /// SGD with momentum: one buffer per parameter.
        SgdMomentum => "sgd-momentum" | "sgd_momentum",
        /// Adafactor: factored second moment (rows + columns), no first moment.
        Adafactor => "adafactor",
        /// 8-bit AdamW (bitsandbytes): two 1-byte moments plus block-wise scales.
        AdamW8bit => "adamw-8bit" | "adamw8bit" | "adamw_8bit" | "adam8bit" | "paged-adamw-8bit",
        /// 8-bit AdamW of torchao (`low_bit_optim.AdamW8bit`): the same states, stepped one
        /// tensor at a time with fp32 copies of both moments.
        AdamW8bitTorchao => "adamw-8bit-torchao" | "torchao-adamw-8bit" | "torchao-adamw8bit",
    }
}

named_enum! {
    /// How the trainer computes the loss over the vocabulary: what the `B·S·V` logits cost.
    Loss {
        /// The whole logits tensor, upcast to fp32 for the cross-entropy (transformers'
        /// `ForCausalLMLoss`, torchtune's `CEWithChunkedOutputLoss` absent, plain PyTorch).
        Standard => "standard" | "cross-entropy",
        /// The whole logits tensor in the compute dtype, not upcast: transformers before
        /// 4.46 (before `ForCausalLMLoss`) for GPT-2 and GPT-BigCode, whose heads pass the
        /// 16-bit logits straight to `CrossEntropyLoss`. Under autocast `log_softmax` runs
        /// in fp32 all the same, so it differs from `standard` in pure 16 bits only.
        Narrow => "narrow" | "no-upcast",
        /// As `narrow`, and the trainer lets go of the model's output before backward
        /// (transformers' `Trainer.training_step` keeps only what `compute_loss` returns, the
        /// loss; universal-llm-trainer deletes the output, `del_logits_after_forward`): the
        /// logits are freed once the loss holds its log-softmax, so the step holds three
        /// logit-sized tensors instead of four. Differs from `standard` without autocast only.
        NarrowReleased => "narrow-released",
        /// The cross-entropy over chunks of the sequence (torchtune's
        /// `CEWithChunkedOutputLoss`, LitGPT's `chunked_cross_entropy`): the 16-bit logits and
        /// one saved fp32-or-narrower log-softmax per element, one chunk's gradients at a time.
        Chunked => "chunked" | "chunked-ce",
        /// The LM head and the loss fused, logits never materialised (Liger's
        /// `FusedLinearCrossEntropy`, Apple's Cut Cross-Entropy).
        Fused => "fused" | "liger" | "fused-linear-ce" | "cut-ce",
    }
}

impl Default for Loss {
    /// `standard`: what a trainer does unless told otherwise.
    fn default() -> Self {
        Loss::Standard
    }
}

named_enum! {
    /// Which norms a transformer block has and what they keep for backward.
    Norms {
        /// RMSNorm before attention and before the FFN, in sequence, upcasting its input to
        /// fp32 (Llama, Mistral, Qwen: `hidden_states.to(torch.float32)` in
        /// `LlamaRMSNorm.forward`).
        RmsNorm => "rmsnorm" | "rms-norm",
        /// `torch.nn.LayerNorm` before attention and before the FFN, in sequence (GPT-2,
        /// GPT-BigCode, BLOOM): no upcast of its own, so in pure 16-bit it keeps its 16-bit
        /// input.
        LayerNorm => "layernorm" | "layer-norm",
        /// Attention and FFN in parallel on the same input, each behind its own LayerNorm
        /// (GPT-NeoX's `use_parallel_residual`, StableLM Alpha): one input for both norms.
        ParallelLayerNorm => "parallel-layernorm",
        /// Attention and FFN in parallel behind one shared LayerNorm (phi-1/1.5/2's
        /// `input_layernorm`, GPT-J's `ln_1`, LitGPT's `shared_attention_norm`).
        SharedLayerNorm => "shared-layernorm",
    }
}

impl Default for Norms {
    /// `rmsnorm`: the modern decoders'.
    fn default() -> Self {
        Norms::RmsNorm
    }
}

impl Norms {
    /// Norms per block, and the distinct inputs they normalise.
    pub fn per_block(self) -> (u32, u32) {
        match self {
            Norms::RmsNorm | Norms::LayerNorm => (2, 2),
            Norms::ParallelLayerNorm => (2, 1),
            Norms::SharedLayerNorm => (1, 1),
        }
    }

    /// The norm upcasts its input to fp32 whatever the compute dtype (RMSNorm), rather
    /// than running in it (LayerNorm).
    pub fn upcasts(self) -> bool {
        self == Norms::RmsNorm
    }
}

named_enum! {
    /// How gradients are synchronised across data-parallel ranks while micro-batches accumulate.
    GradSync {
        /// The accumulating micro-batches skip synchronisation (`no_sync()`, FSDP2's
        /// `set_requires_gradient_sync(False)`) and the last one reduces: what HF Accelerate,
        /// the HF Trainer and LitGPT do by default. Under FSDP every rank then holds full,
        /// unsharded gradients until the last micro-batch.
        Accumulate => "accumulate" | "no-sync",
        /// Every micro-batch reduce-scatters its gradients (Accelerate's
        /// `GradientAccumulationPlugin(sync_each_batch=True)`): FSDP keeps them sharded, at
        /// the cost of one reduction per micro-batch.
        EachBatch => "each-batch" | "sync-each-batch",
    }
}

impl Default for GradSync {
    /// `accumulate`: what Accelerate and LitGPT do unless told otherwise.
    fn default() -> Self {
        GradSync::Accumulate
    }
}

named_enum! {
    /// The numeric regime of training (the static part differs by 2× between them).
    Precision {
        /// Everything in fp32.
        Fp32 => "fp32" | "float32" | "32",
        /// fp32 master weights, gradients and optimizer states; bf16 compute (HF Trainer, PEFT).
        Bf16Mixed => "bf16-mixed" | "bf16_mixed" | "amp-bf16",
        /// fp32 master weights, gradients and optimizer states; fp16 compute.
        Fp16Mixed => "fp16-mixed" | "fp16_mixed" | "amp-fp16" | "16-mixed",
        /// Parameters, gradients and states all in bf16 (torchtune, LitGPT `bf16-true`).
        Bf16 => "bf16" | "bf16-true" | "bfloat16",
        /// Parameters, gradients and states all in fp16.
        Fp16 => "fp16" | "fp16-true" | "float16",
    }
}

named_enum! {
    /// Where the step runs; each has its own fixed runtime overhead.
    Device {
        /// An NVIDIA GPU (CUDA context and caching allocator).
        Cuda => "cuda" | "gpu",
        /// The host CPU (process baseline: interpreter and framework).
        Cpu => "cpu",
        /// Apple silicon (unified memory, Metal).
        Metal => "metal" | "mps" | "mlx",
        /// An AMD GPU (ROCm/HIP context and PyTorch's caching allocator).
        Rocm => "rocm" | "hip",
    }
}

named_enum! {
    /// Data parallelism across `world_size` devices.
    Parallelism {
        /// One device, or replicas that do not shard anything.
        None => "none" | "single",
        /// DistributedDataParallel: full replica per device, plus gradient buckets.
        Ddp => "ddp",
        /// Fully sharded data parallel: parameters, gradients and states sharded.
        Fsdp => "fsdp",
        /// ZeRO stage 1: optimizer states sharded.
        Zero1 => "zero1",
        /// ZeRO stage 2: optimizer states and gradients sharded.
        Zero2 => "zero2",
        /// ZeRO stage 3: parameters, gradients and states sharded.
        Zero3 => "zero3",
    }
}

/// Which linear projections of each transformer layer get adapters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct LoraTargets {
    /// Query projection.
    pub q: bool,
    /// Key projection.
    pub k: bool,
    /// Value projection.
    pub v: bool,
    /// Attention output projection.
    pub o: bool,
    /// FFN gate projection (gated FFNs only).
    pub gate: bool,
    /// FFN up projection.
    pub up: bool,
    /// FFN down projection.
    pub down: bool,
}

impl LoraTargets {
    /// q and v: the PEFT default for Llama-family models.
    pub const QV: LoraTargets = LoraTargets {
        q: true,
        k: false,
        v: true,
        o: false,
        gate: false,
        up: false,
        down: false,
    };
    /// Every linear layer of the block (`all-linear`).
    pub const ALL_LINEAR: LoraTargets = LoraTargets {
        q: true,
        k: true,
        v: true,
        o: true,
        gate: true,
        up: true,
        down: true,
    };

    /// The canonical comma list, e.g. `q,k,v,o`.
    pub fn to_list(&self) -> String {
        let names = [
            (self.q, "q"),
            (self.k, "k"),
            (self.v, "v"),
            (self.o, "o"),
            (self.gate, "gate"),
            (self.up, "up"),
            (self.down, "down"),
        ];
        names
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl FromStr for LoraTargets {
    type Err = ConfigError;
    /// `q,k,v,o,gate,up,down` (HF module names `q_proj`, `gate_proj`, … accepted) or `all-linear`.
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let s = s.trim().to_ascii_lowercase();
        if s == "all-linear" || s == "all_linear" || s == "all" {
            return Ok(LoraTargets::ALL_LINEAR);
        }
        let mut t = LoraTargets {
            q: false,
            k: false,
            v: false,
            o: false,
            gate: false,
            up: false,
            down: false,
        };
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let name = part.strip_suffix("_proj").unwrap_or(part);
            match name {
                "q" => t.q = true,
                "k" => t.k = true,
                "v" => t.v = true,
                "o" => t.o = true,
                "gate" => t.gate = true,
                "up" => t.up = true,
                "down" => t.down = true,
                _ => {
                    return Err(ConfigError::UnknownValue {
                        field: "lora-targets",
                        value: part.to_string(),
                        expected: "q k v o gate up down all-linear",
                    });
                }
            }
        }
        if t.to_list().is_empty() {
            return Err(ConfigError::Invalid {
                field: "lora-targets",
                reason: "names no projection".into(),
            });
        }
        Ok(t)
    }
}

impl fmt::Display for LoraTargets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_list())
    }
}

/// The shape of a decoder-only transformer (or an encoder, with `lm_head` off).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ModelShape {
    /// Catalog name, when it came from the catalog.
    pub name: Option<String>,
    /// Total parameter count (all experts included). `None`: derive it from the shape.
    pub params: Option<u64>,
    /// Model width.
    pub hidden_size: u64,
    /// Number of transformer blocks.
    pub num_layers: u64,
    /// Attention heads.
    pub num_heads: u64,
    /// Key/value heads (GQA); equal to `num_heads` for classic multi-head attention.
    pub num_kv_heads: u64,
    /// Width of one FFN branch.
    pub intermediate_size: u64,
    /// Vocabulary size.
    pub vocab_size: u64,
    /// Gated FFN (SwiGLU/GeGLU: gate, up and down) rather than a plain two-matrix MLP.
    pub ffn_gated: bool,
    /// Experts per MoE layer; 1 for a dense model.
    pub num_experts: u64,
    /// Experts each token is routed to; 1 for a dense model.
    pub experts_per_token: u64,
    /// Input and output embeddings share one matrix.
    pub tie_embeddings: bool,
    /// The model ends in a vocabulary projection (B·S·V logits); false for classifiers.
    pub lm_head: bool,
    /// Width of one attention head when it is not `hidden_size / num_heads` (Gemma 2: 256).
    /// `None`: `hidden_size / num_heads`.
    pub head_dim: Option<u64>,
    /// Width of one routed expert's FFN when it differs from `intermediate_size` (Qwen3-MoE,
    /// DeepSeek: `moe_intermediate_size`). `None`: `intermediate_size`.
    #[cfg_attr(feature = "serde", serde(default))]
    pub moe_intermediate_size: Option<u64>,
    /// Shared experts every token passes through besides the routed ones (DeepSeek), each as
    /// wide as a routed expert.
    #[cfg_attr(feature = "serde", serde(default))]
    pub shared_experts: u64,
    /// Leading layers of an MoE model that keep a dense FFN of `intermediate_size` (DeepSeek's
    /// `first_k_dense_replace`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub dense_layers: u64,
    /// Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value projections.
    #[cfg_attr(feature = "serde", serde(default))]
    pub mla: Option<Mla>,
    /// Parameters outside the language model (a vision encoder and its projector), loaded
    /// with it and held frozen in 16 bits.
    #[cfg_attr(feature = "serde", serde(default))]
    pub extra_params: u64,
    /// The model trains with dropout on the attention probabilities (its config's
    /// `attention_dropout`/`attn_pdrop` above 0: GPT-2, BERT). Eager attention then keeps a
    /// mask and the dropped copy of the `S²` probabilities; with 0 it keeps neither.
    #[cfg_attr(feature = "serde", serde(default))]
    pub attention_dropout: bool,
    /// The attention scores are soft-capped, `tanh(s/c)·c` (Gemma 2's
    /// `attn_logit_softcapping`). Eager attention then keeps the tanh output as well; flash
    /// kernels without a soft-cap cannot run it, so LitGPT computes the scores itself.
    #[cfg_attr(feature = "serde", serde(default))]
    pub attention_softcapping: bool,
    /// The block's norms: what they keep for backward.
    #[cfg_attr(feature = "serde", serde(default))]
    pub norms: Norms,
}

/// Multi-head latent attention (DeepSeek-V2/V3), as its `config.json` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Mla {
    /// Rank of the query compression (`q_lora_rank`); `None`: a plain query projection.
    pub q_lora_rank: Option<u64>,
    /// Rank of the joint key/value compression (`kv_lora_rank`).
    pub kv_lora_rank: u64,
    /// Per-head query/key width without rotary (`qk_nope_head_dim`).
    pub qk_nope_head_dim: u64,
    /// Per-head rotary width, shared by all heads for the key (`qk_rope_head_dim`).
    pub qk_rope_head_dim: u64,
    /// Per-head value width (`v_head_dim`).
    pub v_head_dim: u64,
}

impl Default for ModelShape {
    /// A dense decoder with zero sizes, to be filled in (`validate` rejects the zeros).
    fn default() -> Self {
        ModelShape {
            name: None,
            params: None,
            hidden_size: 0,
            num_layers: 0,
            num_heads: 0,
            num_kv_heads: 0,
            intermediate_size: 0,
            vocab_size: 0,
            ffn_gated: true,
            num_experts: 1,
            experts_per_token: 1,
            tie_embeddings: false,
            lm_head: true,
            head_dim: None,
            moe_intermediate_size: None,
            shared_experts: 0,
            dense_layers: 0,
            mla: None,
            extra_params: 0,
            attention_dropout: false,
            attention_softcapping: false,
            norms: Norms::RmsNorm,
        }
    }
}

impl ModelShape {
    /// Width of one attention head (for MLA the query/key head, `nope + rope`).
    pub fn head_dim(&self) -> u64 {
        if let Some(mla) = self.mla {
            return mla.qk_nope_head_dim + mla.qk_rope_head_dim;
        }
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_heads.max(1))
    }

    /// Width of one routed (or shared) expert's FFN.
    pub fn expert_ffn_size(&self) -> u64 {
        self.moe_intermediate_size.unwrap_or(self.intermediate_size)
    }

    /// Whether the FFNs are mixtures of experts.
    pub fn is_moe(&self) -> bool {
        self.num_experts > 1
    }

    /// Layers whose FFN is a mixture of experts (all but the leading dense ones).
    pub fn moe_layers(&self) -> u64 {
        if self.is_moe() {
            self.num_layers.saturating_sub(self.dense_layers)
        } else {
            0
        }
    }

    /// FFN width one token passes through, averaged over the layers: `e·I_e + shared·I_e` in
    /// MoE layers, `I` in dense ones.
    pub fn ffn_width_per_token(&self) -> f64 {
        let layers = self.num_layers.max(1) as f64;
        let moe = self.moe_layers() as f64;
        let routed =
            (self.experts_per_token + self.shared_experts) as f64 * self.expert_ffn_size() as f64;
        (moe * routed + (layers - moe) * self.intermediate_size as f64) / layers
    }

    /// Width of the query projection's output (`num_heads · head_dim`).
    pub fn q_dim(&self) -> u64 {
        self.num_heads * self.head_dim()
    }

    /// Width of the key (and of the value) projection's output (`num_kv_heads · head_dim`).
    pub fn kv_dim(&self) -> u64 {
        self.num_kv_heads * self.head_dim()
    }
}

/// Upper bounds that no real run reaches: absurd input is an error, not a loop or an overflow.
pub mod limits {
    /// Largest accepted per-device batch (2²⁰).
    pub const BATCH_SIZE: u64 = 1 << 20;
    /// Longest accepted sequence (2²⁴ tokens).
    pub const SEQ_LENGTH: u64 = 1 << 24;
    /// Widest accepted hidden, head, FFN or vocabulary size (2²⁰; vocabularies up to 2²⁴).
    pub const WIDTH: u64 = 1 << 20;
    /// Largest accepted vocabulary (2²⁴).
    pub const VOCAB: u64 = 1 << 24;
    /// Deepest accepted model.
    pub const LAYERS: u64 = 10_000;
    /// Most heads, experts, LoRA rank, devices, accumulation steps.
    pub const COUNT: u64 = 1 << 20;
    /// Largest accepted explicit parameter count (10¹⁵).
    pub const PARAMS: u64 = 1_000_000_000_000_000;
}

/// A training run, as far as memory is concerned.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct TrainingConfig {
    /// The model.
    pub model: ModelShape,
    /// Storage bits of the frozen base weights (4, 8, 16, 32). `None`: follow the precision
    /// (and 4 for QLoRA).
    pub model_bits: Option<u32>,
    /// Numeric regime.
    pub precision: Precision,
    /// Training method.
    pub method: Method,
    /// LoRA rank (LoRA, QLoRA, DoRA).
    pub lora_rank: u64,
    /// Number of adapted layers; `None`: all layers.
    pub lora_layers: Option<u64>,
    /// Adapted projections.
    pub lora_targets: LoraTargets,
    /// QLoRA double quantization of the NF4 block scales.
    pub double_quant: bool,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Per-device micro-batch size.
    pub batch_size: u64,
    /// Tokens per sequence.
    pub seq_length: u64,
    /// Gradient accumulation steps (does not change peak memory; kept so plans keep the
    /// effective batch).
    pub grad_accumulation: u64,
    /// Activation (gradient) checkpointing.
    pub grad_checkpointing: bool,
    /// Memory-efficient attention (flash / SDPA): no S² score matrix kept.
    pub flash_attention: bool,
    /// Device kind.
    pub device: Device,
    /// Data-parallel scheme.
    pub parallelism: Parallelism,
    /// Devices taking part in data parallelism.
    pub world_size: u64,
    /// How the loss over the vocabulary is computed.
    #[cfg_attr(feature = "serde", serde(default))]
    pub loss: Loss,
    /// Activations saved for backward are moved to host memory as they are saved and brought
    /// back for backward (torchtune `enable_activation_offloading`, DeepSpeed
    /// `cpu_checkpointing`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub activation_offload: bool,
    /// Optimizer states (and ZeRO's fp32 master weights) live in host memory and the step runs
    /// there (DeepSpeed `offload_optimizer`, FSDP `CPUOffload`, torchao `CPUOffloadOptimizer`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub optimizer_offload: bool,
    /// The optimizer steps each parameter as soon as its gradient is ready and frees it
    /// (torchtune `optimizer_in_bwd`): no full set of gradients is ever alive.
    #[cfg_attr(feature = "serde", serde(default))]
    pub optimizer_in_backward: bool,
    /// `torch.compile`: Inductor fuses element-wise chains and recomputes them in backward, so
    /// norms and the FFN activation keep only their inputs.
    #[cfg_attr(feature = "serde", serde(default))]
    pub compile: bool,
    /// The adapters apply dropout to their input (`lora_dropout` above 0: LitGPT's configs use
    /// 0.05; PEFT's default is 0). Each adapted projection then keeps a dropout mask and the
    /// dropped copy of its input for LoRA A's gradient.
    #[cfg_attr(feature = "serde", serde(default))]
    pub lora_dropout: bool,
    /// How gradients are synchronised while micro-batches accumulate (only FSDP with several
    /// ranks and accumulation above 1 is affected: unsharded gradients under `accumulate`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub grad_sync: GradSync,
    /// A 4- or 8-bit base quantizes the LM head too (Lightning Fabric's
    /// `BitsandbytesPrecision`, which LitGPT uses, swaps every `nn.Linear` built under
    /// `init_module`, the head's included; transformers' bitsandbytes integration skips
    /// `lm_head`, the default here). The head is then a separate quantized copy and is
    /// dequantized whole for its matmuls.
    #[cfg_attr(feature = "serde", serde(default))]
    pub quantized_head: bool,
    /// A 4-bit base was quantized from fp16 (Lightning Fabric's `BitsandbytesPrecision`
    /// always, `weight.to(torch.half)`; bitsandbytes up to 0.42 too, `Params4bit.cuda`'s
    /// `.half()`), so its quant state is fp16 and `dequantize_4bit` returns fp16, which
    /// `MatMul4Bit` copies to the compute dtype: each dequantized matrix is held twice for a
    /// moment. Default `false` (bitsandbytes 0.43+ quantizes from the loaded dtype).
    #[cfg_attr(feature = "serde", serde(default))]
    pub quant_from_fp16: bool,
    /// The trainer keeps the LM head as its own parameter even when the checkpoint ties it to
    /// the embedding (LitGPT: `GPT` has separate `transformer.wte` and `lm_head`, and
    /// `convert_hf_checkpoint` copies the embedding into `lm_head.weight`): a tied model then
    /// holds `V·h` more parameters. Default `false` (transformers keeps the tie).
    #[cfg_attr(feature = "serde", serde(default))]
    pub untied_head: bool,
    /// How much the batches' padded lengths vary, `(longest − shortest) / longest` in [0, 1]
    /// (0: every batch the same shape, the default). Varying shapes fragment the CUDA caching
    /// allocator's blocks: `max_memory_reserved` grows above `max_memory_allocated`.
    #[cfg_attr(feature = "serde", serde(default))]
    pub seq_length_spread: f64,
    /// Sequences are packed into fixed-length batches (every batch one shape, whatever the
    /// data's lengths): the spread does not fragment.
    #[cfg_attr(feature = "serde", serde(default))]
    pub packing: bool,
    /// PyTorch's caching allocator runs with `expandable_segments:True`
    /// (`PYTORCH_CUDA_ALLOC_CONF`): one segment grows and shrinks by pages, so blocks freed at
    /// one shape serve the next; varying shapes no longer fragment.
    #[cfg_attr(feature = "serde", serde(default))]
    pub expandable_segments: bool,
}

impl TrainingConfig {
    /// A config with memguard's defaults: full fine-tuning in bf16-mixed with AdamW, batch 1,
    /// sequence 2048, flash attention on, one CUDA device, the standard loss, nothing offloaded,
    /// no `torch.compile`, gradients synchronised at the last micro-batch only.
    pub fn new(model: ModelShape) -> Self {
        TrainingConfig {
            model,
            model_bits: None,
            precision: Precision::Bf16Mixed,
            method: Method::Full,
            lora_rank: 16,
            lora_layers: None,
            lora_targets: LoraTargets::QV,
            double_quant: false,
            optimizer: Optimizer::AdamW,
            batch_size: 1,
            seq_length: 2048,
            grad_accumulation: 1,
            grad_checkpointing: false,
            flash_attention: true,
            device: Device::Cuda,
            parallelism: Parallelism::None,
            world_size: 1,
            loss: Loss::Standard,
            activation_offload: false,
            optimizer_offload: false,
            optimizer_in_backward: false,
            compile: false,
            lora_dropout: false,
            grad_sync: GradSync::Accumulate,
            quantized_head: false,
            quant_from_fp16: false,
            untied_head: false,
            seq_length_spread: 0.0,
            packing: false,
            expandable_segments: false,
        }
    }

    /// Whether the method trains adapters on a frozen base.
    pub fn is_adapter(&self) -> bool {
        matches!(self.method, Method::Lora | Method::Qlora | Method::Dora)
    }

    /// Adapted layers, capped at the model's depth.
    pub fn adapted_layers(&self) -> u64 {
        self.lora_layers
            .unwrap_or(self.model.num_layers)
            .min(self.model.num_layers)
    }

    /// Whether FSDP holds full, unsharded gradients across accumulating micro-batches: several
    /// ranks, accumulation above 1, and the micro-batches run under `no_sync()`
    /// ([`GradSync::Accumulate`]).
    pub fn fsdp_accumulates_unsharded(&self) -> bool {
        self.parallelism == Parallelism::Fsdp
            && self.world_size > 1
            && self.grad_accumulation > 1
            && self.grad_sync == GradSync::Accumulate
    }

    /// Checks every field and returns every problem, each naming its field.
    pub fn validate(&self) -> Result<(), Vec<ConfigError>> {
        let mut errors = Vec::new();
        let m = &self.model;
        let positive = [
            ("hidden-size", m.hidden_size),
            ("num-layers", m.num_layers),
            ("num-heads", m.num_heads),
            ("num-kv-heads", m.num_kv_heads),
            ("intermediate-size", m.intermediate_size),
            ("vocab-size", m.vocab_size),
            ("num-experts", m.num_experts),
            ("experts-per-token", m.experts_per_token),
            ("batch-size", self.batch_size),
            ("seq-length", self.seq_length),
            ("grad-accumulation", self.grad_accumulation),
            ("world-size", self.world_size),
        ];
        for (field, value) in positive {
            if value == 0 {
                errors.push(ConfigError::Invalid {
                    field,
                    reason: "must be at least 1".into(),
                });
            }
        }
        let caps = [
            ("hidden-size", m.hidden_size, limits::WIDTH),
            ("num-layers", m.num_layers, limits::LAYERS),
            ("num-heads", m.num_heads, limits::COUNT),
            ("num-kv-heads", m.num_kv_heads, limits::COUNT),
            ("intermediate-size", m.intermediate_size, limits::WIDTH),
            ("vocab-size", m.vocab_size, limits::VOCAB),
            ("num-experts", m.num_experts, limits::COUNT),
            ("experts-per-token", m.experts_per_token, limits::COUNT),
            ("head-dim", m.head_dim.unwrap_or(0), limits::WIDTH),
            ("model-params", m.params.unwrap_or(0), limits::PARAMS),
            ("batch-size", self.batch_size, limits::BATCH_SIZE),
            ("seq-length", self.seq_length, limits::SEQ_LENGTH),
            ("grad-accumulation", self.grad_accumulation, limits::COUNT),
            ("world-size", self.world_size, limits::COUNT),
            ("lora-rank", self.lora_rank, limits::WIDTH),
            ("lora-layers", self.lora_layers.unwrap_or(0), limits::LAYERS),
        ];
        for (field, value, cap) in caps {
            if value > cap {
                errors.push(ConfigError::Invalid {
                    field,
                    reason: format!("{value} exceeds the sanity limit {cap}"),
                });
            }
        }
        if m.head_dim == Some(0) {
            errors.push(ConfigError::Invalid {
                field: "head-dim",
                reason: "must be at least 1".into(),
            });
        }
        if m.head_dim.is_none() && m.num_heads > 0 && !m.hidden_size.is_multiple_of(m.num_heads) {
            errors.push(ConfigError::Invalid {
                field: "num-heads",
                reason: format!(
                    "{} heads do not divide hidden size {}",
                    m.num_heads, m.hidden_size
                ),
            });
        }
        if m.num_kv_heads > 0 && !m.num_heads.is_multiple_of(m.num_kv_heads) {
            errors.push(ConfigError::Invalid {
                field: "num-kv-heads",
                reason: format!(
                    "{} KV heads do not divide {} attention heads",
                    m.num_kv_heads, m.num_heads
                ),
            });
        }
        if m.moe_intermediate_size == Some(0) {
            errors.push(ConfigError::Invalid {
                field: "moe-intermediate-size",
                reason: "must be at least 1".into(),
            });
        }
        if m.moe_intermediate_size.unwrap_or(0) > limits::WIDTH {
            errors.push(ConfigError::Invalid {
                field: "moe-intermediate-size",
                reason: format!("exceeds the sanity limit {}", limits::WIDTH),
            });
        }
        if !(0.0..=1.0).contains(&self.seq_length_spread) {
            errors.push(ConfigError::Invalid {
                field: "seq-length-spread",
                reason: format!(
                    "{} is not in [0, 1] ((longest − shortest) / longest)",
                    self.seq_length_spread
                ),
            });
        }
        if m.dense_layers > m.num_layers {
            errors.push(ConfigError::Invalid {
                field: "dense-layers",
                reason: format!("{} exceeds num-layers {}", m.dense_layers, m.num_layers),
            });
        }
        if m.shared_experts > limits::COUNT || m.extra_params > limits::PARAMS {
            errors.push(ConfigError::Invalid {
                field: "model",
                reason: "shared experts or extra parameters exceed the sanity limits".into(),
            });
        }
        if let Some(mla) = m.mla {
            let dims = [
                mla.kv_lora_rank,
                mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                mla.v_head_dim,
                mla.q_lora_rank.unwrap_or(1),
            ];
            if dims.iter().any(|&d| d == 0 || d > limits::WIDTH) {
                errors.push(ConfigError::Invalid {
                    field: "mla",
                    reason: "every rank and head width must be in 1..=2^20".into(),
                });
            }
        }
        if m.experts_per_token > m.num_experts {
            errors.push(ConfigError::Invalid {
                field: "experts-per-token",
                reason: format!(
                    "{} exceeds num-experts {}",
                    m.experts_per_token, m.num_experts
                ),
            });
        }
        if let Some(bits) = self.model_bits
            && ![4, 8, 16, 32].contains(&bits)
        {
            errors.push(ConfigError::Invalid {
                field: "model-bits",
                reason: format!("{bits} is not one of 4, 8, 16, 32"),
            });
        }
        if self.is_adapter() {
            if self.lora_rank == 0 {
                errors.push(ConfigError::Invalid {
                    field: "lora-rank",
                    reason: "must be at least 1".into(),
                });
            }
            if self.lora_layers == Some(0) {
                errors.push(ConfigError::Invalid {
                    field: "lora-layers",
                    reason: "must be at least 1".into(),
                });
            }
        }
        if self.parallelism == Parallelism::None && self.world_size > 1 {
            // Replicas without sharding hold what one device holds: allowed, nothing to check.
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// A problem with a configuration, naming the field (as spelled in annotations and flags).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A value outside the known set.
    #[error("{field}: unknown value `{value}` (expected one of: {expected})")]
    UnknownValue {
        /// The field.
        field: &'static str,
        /// What was given.
        value: String,
        /// The accepted values, space separated.
        expected: &'static str,
    },
    /// A value that is known but not acceptable.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// A model name not in the catalog.
    #[error("model: unknown model `{0}` (run `memguard estimate --list-models`)")]
    UnknownModel(String),
}

impl ConfigError {
    /// The field the error is about.
    pub fn field(&self) -> &'static str {
        match self {
            ConfigError::UnknownValue { field, .. } | ConfigError::Invalid { field, .. } => field,
            ConfigError::UnknownModel(_) => "model",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_names_round_trip() {
        for m in Method::ALL {
            assert_eq!(m.name().parse::<Method>(), Ok(*m));
        }
        for o in Optimizer::ALL {
            assert_eq!(o.name().parse::<Optimizer>(), Ok(*o));
        }
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>(), Ok(*p));
        }
        assert!("adamw9".parse::<Optimizer>().is_err());
    }

    #[test]
    fn lora_targets_parse_hf_names_and_all_linear() {
        let t: LoraTargets = "q_proj,v_proj".parse().expect("HF names parse");
        assert_eq!(t, LoraTargets::QV);
        assert_eq!(
            "all-linear".parse::<LoraTargets>(),
            Ok(LoraTargets::ALL_LINEAR)
        );
        assert!("q,bogus".parse::<LoraTargets>().is_err());
        assert!(",".parse::<LoraTargets>().is_err());
    }
}
