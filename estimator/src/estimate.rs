//! The estimate of one training step's peak memory, with a readable breakdown.
//!
//! The step has two candidate peaks, and the estimate takes the larger:
//!
//! * **forward/backward** — at the start of the backward pass every saved activation, the
//!   logits and their loss gradients are live;
//! * **optimizer step** — the optimizer's workspace.
//!
//! Gradients are counted in both: they are kept across micro-batches by accumulation, by
//! ZeRO's contiguous buffers and by `zero_grad(set_to_none=False)`, and the measured runs
//! show them live at the backward peak even without those.
//!
//! Both sit on the **static** part that lives through the whole step: weights, quantization
//! scales, master weights and optimizer states. Every term below is a named function whose
//! doc comment gives its formula; `P` is a parameter count, `B` the batch, `S` the sequence
//! length, `h` the hidden size, `L` the layers, `V` the vocabulary, `p` the bytes of the
//! compute dtype.

use crate::config::{
    ConfigError, Device, Loss, Method, ModelShape, Optimizer, Parallelism, Precision,
    TrainingConfig,
};
use crate::params::{self, ParamCounts};
use crate::units::Bytes;
use std::fmt;

/// The few constants physics does not give; each is fitted or measured, see `docs/accuracy.md`.
pub mod constants {
    use crate::units::Bytes;

    /// CUDA context, kernels, cuBLAS/cuDNN handles and workspaces: what a PyTorch process
    /// holds on the GPU around its first tensor. NVML shows it, `max_memory_allocated` does
    /// not. Hugging Face measured 1343 MiB for a 1×1 tensor (nvidia-smi); lazy module
    /// loading makes it smaller on recent stacks, NCCL and quantization kernels larger.
    pub const CUDA_CONTEXT: Bytes = Bytes::mib(1343);
    /// PyTorch's caching allocator keeps freed blocks reserved: the reserve above live tensors
    /// as a fraction of the tensors that are allocated and freed every step (activations,
    /// logits, gradients, workspaces). Weights and optimizer states are allocated once and do
    /// not fragment, so they carry none.
    pub const CUDA_CACHE_FRACTION: f64 = 0.25;
    /// A process that has imported torch, transformers and peft holds about 444 MB before
    /// any model exists (a cgroup's peak usage: the median over 25 measured runs of the
    /// pre-training peak minus the model's bytes).
    pub const CPU_PROCESS_BASELINE: Bytes = Bytes(444_000_000);
    /// The CPU heap (glibc malloc arenas) does not return every freed block at once: the
    /// excess over live tensors as a fraction of the per-step tensors. Chosen as the smallest
    /// value that keeps every measured CPU run within −10 % (an under-estimate is an OOM);
    /// 0.20 fits the median better (3.3 %) but under-estimates LoRA + checkpointing by 14 %.
    pub const CPU_HEAP_FRACTION: f64 = 0.40;
    /// Apple silicon: Python, the framework and the Metal device; unified memory, no
    /// separate context. Not fitted on data (none published with a device-level figure).
    pub const METAL_RUNTIME: Bytes = Bytes(600_000_000);
    /// ROCm: the HIP context, rocBLAS/hipBLASLt handles and workspaces, and the kernel code
    /// objects, which ROCm loads eagerly (CUDA loads modules lazily since 11.7). Not fitted on
    /// data (no device-level figure published for a PyTorch process): set above
    /// [`CUDA_CONTEXT`] by design, since an under-estimate is an OOM kill.
    pub const ROCM_CONTEXT: Bytes = Bytes::mib(2048);
    /// NF4 quantization block: one fp32 absmax scale per 64 weights (QLoRA).
    pub const NF4_BLOCK: f64 = 64.0;
    /// Double quantization: the 8-bit scales are themselves quantized in blocks of 256, each
    /// with one fp32 scale.
    pub const DOUBLE_QUANT_BLOCK: f64 = 256.0;
    /// bitsandbytes 8-bit optimizers: one fp32 absmax per 256 state values.
    pub const ADAM8BIT_BLOCK: f64 = 256.0;
    /// DeepSpeed ZeRO's default reduce bucket, in elements.
    pub const ZERO_REDUCE_BUCKET: f64 = 5e8;
    /// Bytes per logit element of the usual loss in fp32, at its backward: the log-softmax
    /// output kept for backward, the loss's dense gradient w.r.t. it, and the gradient
    /// w.r.t. the upcast logits. The logits themselves (`p` bytes, held by the model's
    /// output in a plain training loop) come on top.
    pub const LOSS_BYTES_PER_LOGIT: f64 = 12.0;
    /// Bytes per logit element of a chunked loss: each chunk's saved log-softmax (fp32 when
    /// the chunk is upcast, as torchtune does; narrower in LitGPT's bf16), kept for every
    /// chunk until backward; the gradients exist for one chunk at a time.
    pub const CHUNKED_LOSS_BYTES_PER_LOGIT: f64 = 4.0;
    /// Logit-sized tensors in the compute dtype at the peak of a loss without upcast
    /// (`narrow`), the model's output held through backward: the logits, the log-softmax
    /// output and, at its backward, its gradient and the gradient w.r.t. the logits
    /// (`bench/accuracy/saved_tensors.py --only loss`: 3.99·`B·S·V·p`, bf16 and fp32).
    pub const NARROW_LOSS_TENSORS: f64 = 4.0;
    /// The same with the output let go before backward (`narrow-released`): the logits are
    /// gone by then (2.99·`B·S·V·p` measured, bf16 and fp32).
    pub const NARROW_RELEASED_LOSS_TENSORS: f64 = 3.0;
    /// The CUDA caching allocator's extra reserve when batch shapes vary, per unit of
    /// `seq_length_spread`, as a fraction of the per-step tensors: freed blocks cut for short
    /// batches cannot serve the long one. Fitted (with the other constants held) on the one
    /// source that measures `max_memory_reserved` on batches of varying length, ms-swift's
    /// benchmark (`docs/accuracy.md`, "Sets 1 and 2"); it was an unfitted 0.5 before.
    /// Packing and `expandable_segments:True` remove it.
    pub const CUDA_FRAGMENTATION_PER_SPREAD: f64 = 1.48;
}

use constants::*;

/// The constants fitted on measured runs rather than given by physics: the runtime's fixed
/// cost and the allocator's reserve, per device family. [`Fitted::SHIPPED`] is what
/// [`estimate`] uses; the accuracy tooling refits them without each source to score the
/// model on sources it has never seen (leave-one-source-out, `docs/accuracy.md`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fitted {
    /// See [`constants::CUDA_CONTEXT`].
    pub cuda_context: Bytes,
    /// See [`constants::CUDA_CACHE_FRACTION`].
    pub cuda_cache_fraction: f64,
    /// See [`constants::CPU_PROCESS_BASELINE`].
    pub cpu_process_baseline: Bytes,
    /// See [`constants::CPU_HEAP_FRACTION`].
    pub cpu_heap_fraction: f64,
    /// See [`constants::CUDA_FRAGMENTATION_PER_SPREAD`].
    pub cuda_fragmentation_per_spread: f64,
}

impl Fitted {
    /// The values the estimator ships with.
    pub const SHIPPED: Fitted = Fitted {
        cuda_context: CUDA_CONTEXT,
        cuda_cache_fraction: CUDA_CACHE_FRACTION,
        cpu_process_baseline: CPU_PROCESS_BASELINE,
        cpu_heap_fraction: CPU_HEAP_FRACTION,
        cuda_fragmentation_per_spread: CUDA_FRAGMENTATION_PER_SPREAD,
    };
}

impl Default for Fitted {
    fn default() -> Self {
        Fitted::SHIPPED
    }
}

/// A named part of the peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Component {
    /// Model weights as stored on the device (frozen base and/or trainable).
    Weights,
    /// Quantization block scales (QLoRA NF4).
    QuantScales,
    /// fp32 master copy of trainable weights under mixed precision.
    MasterWeights,
    /// Gradients of the trainable parameters.
    Gradients,
    /// Optimizer states.
    OptimizerStates,
    /// Activations kept for the backward pass.
    Activations,
    /// Output logits and their loss intermediates (B·S·V).
    Logits,
    /// Transient buffers at the peak (backward workspace, communication buckets).
    Transient,
    /// Fixed runtime cost: CUDA context, CPU process baseline.
    RuntimeOverhead,
    /// Caching-allocator reserve above live tensors.
    AllocatorCache,
    /// Inference serving: the key/value cache at its ceiling (never part of a training step).
    KvCache,
}

impl Component {
    /// snake_case name used in JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Component::Weights => "weights",
            Component::QuantScales => "quant_scales",
            Component::MasterWeights => "master_weights",
            Component::Gradients => "gradients",
            Component::OptimizerStates => "optimizer_states",
            Component::Activations => "activations",
            Component::Logits => "logits",
            Component::Transient => "transient",
            Component::RuntimeOverhead => "runtime_overhead",
            Component::AllocatorCache => "allocator_cache",
            Component::KvCache => "kv_cache",
        }
    }

    /// Whether the component is a live tensor (counted in `tensor_peak`).
    pub const fn is_tensor(self) -> bool {
        !matches!(self, Component::RuntimeOverhead | Component::AllocatorCache)
    }

    /// Whether the component is allocated once and kept (no allocator churn).
    pub const fn is_static(self) -> bool {
        matches!(
            self,
            Component::Weights
                | Component::QuantScales
                | Component::MasterWeights
                | Component::OptimizerStates
        )
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The peak of one training step on one device.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Estimate {
    /// What the device must hold: tensors plus runtime overhead and allocator cache.
    pub total: Bytes,
    /// The peak of live tensors alone (`torch.cuda.max_memory_allocated`).
    pub tensor_peak: Bytes,
    /// The parts live at the peak, largest first.
    pub components: Vec<(Component, Bytes)>,
}

impl Estimate {
    /// An estimate from its parts: zero parts dropped, largest first, `total` the sum of all,
    /// `tensor_peak` the sum of the live tensors.
    pub fn from_components(mut components: Vec<(Component, Bytes)>) -> Estimate {
        components.retain(|(_, b)| *b > Bytes::ZERO);
        components.sort_by_key(|(_, b)| std::cmp::Reverse(*b));
        let tensor_peak = components
            .iter()
            .filter(|(c, _)| c.is_tensor())
            .map(|(_, b)| *b)
            .sum();
        let total = components.iter().map(|(_, b)| *b).sum();
        Estimate {
            total,
            tensor_peak,
            components,
        }
    }

    /// Bytes of one component (zero when absent).
    pub fn component(&self, c: Component) -> Bytes {
        self.components
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, b)| *b)
            .unwrap_or(Bytes::ZERO)
    }
}

/// Byte widths of one numeric regime (precision × sharding scheme).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Regime {
    /// Compute (activation) dtype.
    compute: f64,
    /// Trainable weights as held by the module.
    weight: f64,
    /// Gradients of trainable weights.
    grad: f64,
    /// One optimizer state value.
    state: f64,
    /// fp32 master copy kept by the optimizer (ZeRO mixed precision).
    master: f64,
    /// fp32 gradient partition made for the optimizer step (ZeRO mixed precision).
    step_grad: f64,
}

impl Regime {
    /// HF Trainer / PEFT AMP keeps fp32 weights, gradients and states and computes in 16 bits;
    /// DeepSpeed ZeRO holds 16-bit weights and gradients with fp32 master weights and states;
    /// torch FSDP shards fp32 weights and reduces gradients to fp32; pure 16-bit keeps
    /// everything (states included) in the parameter dtype.
    fn of(precision: Precision, parallelism: Parallelism) -> Regime {
        let zero = matches!(
            parallelism,
            Parallelism::Zero1 | Parallelism::Zero2 | Parallelism::Zero3
        );
        match precision {
            Precision::Fp32 => Regime {
                compute: 4.0,
                weight: 4.0,
                grad: 4.0,
                state: 4.0,
                master: 0.0,
                step_grad: 0.0,
            },
            Precision::Bf16 | Precision::Fp16 => Regime {
                compute: 2.0,
                weight: 2.0,
                grad: 2.0,
                state: 2.0,
                master: 0.0,
                step_grad: 0.0,
            },
            Precision::Bf16Mixed | Precision::Fp16Mixed if zero => Regime {
                compute: 2.0,
                weight: 2.0,
                grad: 2.0,
                state: 4.0,
                master: 4.0,
                step_grad: 4.0,
            },
            Precision::Bf16Mixed | Precision::Fp16Mixed => Regime {
                compute: 2.0,
                weight: 4.0,
                grad: 4.0,
                state: 4.0,
                master: 0.0,
                step_grad: 0.0,
            },
        }
    }

    /// Whether autocast makes 16-bit copies of fp32 weights during forward/backward.
    fn autocasts(self) -> bool {
        self.weight > self.compute && self.master == 0.0
    }
}

/// How data parallelism divides each kind of state over `world_size` devices.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shards {
    weights: f64,
    grads: f64,
    states: f64,
}

impl Shards {
    /// ZeRO-1: states (and master weights) / N; ZeRO-2: + gradients / N; ZeRO-3 and FSDP:
    /// + parameters / N. DDP and no parallelism shard nothing.
    fn of(parallelism: Parallelism, world_size: u64) -> Shards {
        let n = world_size.max(1) as f64;
        let (weights, grads, states) = match parallelism {
            Parallelism::None | Parallelism::Ddp => (1.0, 1.0, 1.0),
            Parallelism::Zero1 => (1.0, 1.0, n),
            Parallelism::Zero2 => (1.0, n, n),
            Parallelism::Zero3 | Parallelism::Fsdp => (n, n, n),
        };
        Shards {
            weights,
            grads,
            states,
        }
    }
}

/// Everything the terms need, derived once from a validated config.
#[derive(Debug, Clone, Copy)]
struct Ctx<'a> {
    cfg: &'a TrainingConfig,
    m: &'a ModelShape,
    counts: ParamCounts,
    /// Parameters of the model (published count when given).
    params: f64,
    /// Trainable parameters.
    trainable: f64,
    regime: Regime,
    shards: Shards,
    /// Tokens per micro-batch, `B·S`.
    tokens: f64,
}

impl<'a> Ctx<'a> {
    fn new(cfg: &'a TrainingConfig) -> Ctx<'a> {
        let m = &cfg.model;
        let params = params::total_params(m) as f64;
        Ctx {
            cfg,
            m,
            counts: ParamCounts::of(m),
            params,
            trainable: trainable_params(cfg, params),
            regime: Regime::of(cfg.precision, cfg.parallelism),
            shards: Shards::of(cfg.parallelism, cfg.world_size),
            tokens: cfg.batch_size as f64 * cfg.seq_length as f64,
        }
    }

    /// Parameters of the blocks' linear layers (what 4-bit quantization applies to):
    /// `P − (embeddings + head + norms)`.
    fn quantizable(&self) -> f64 {
        (self.params - self.counts.unquantized(self.m.num_layers) as f64).max(0.0)
    }
}

/// Trainable parameters: `P` for full fine-tuning; for adapters `layers · Σ r·(in + out)`
/// over the targeted projections, plus DoRA's magnitude vectors `layers · Σ out`.
pub fn trainable_params(cfg: &TrainingConfig, params: f64) -> f64 {
    let m = &cfg.model;
    let layers = cfg.adapted_layers() as f64;
    match cfg.method {
        Method::Full => params,
        Method::Lora | Method::Qlora => {
            layers * params::lora_params_per_layer(m, &cfg.lora_targets, cfg.lora_rank) as f64
        }
        Method::Dora => {
            layers
                * (params::lora_params_per_layer(m, &cfg.lora_targets, cfg.lora_rank)
                    + params::dora_magnitude_per_layer(m, &cfg.lora_targets))
                    as f64
        }
    }
}

/// Storage bits of the frozen base: `model_bits` when given, 4 for QLoRA, 32 under fp32 and
/// 16 otherwise (a LoRA base is loaded in the compute dtype).
fn base_bits(cfg: &TrainingConfig) -> f64 {
    match (cfg.model_bits, cfg.method, cfg.precision) {
        (Some(bits), _, _) => f64::from(bits),
        (None, Method::Qlora, _) => 4.0,
        (None, _, Precision::Fp32) => 32.0,
        (None, _, _) => 16.0,
    }
}

/// Weights held by the device: the frozen base for adapter methods — `Pq·bits/8 + Pu·2`
/// when quantized to 4 or 8 bits (`Pq` the blocks' linear weights; `Pu` embeddings, head,
/// norms and a vision tower, which bitsandbytes and GPTQ leave unquantized), `P·bits/8`
/// otherwise — plus the trainable weights `Pt·w`; both `/N` under ZeRO-3/FSDP.
///
/// Not modelled: PEFT's `prepare_model_for_kbit_training` casts the unquantized parameters
/// of a bitsandbytes model to fp32 (`Pu·2` more), but not those of a GPTQ model, and no field
/// says which quantizer a run uses (the Qwen-1 Q-LoRA rows, GPTQ, show no upcast).
///
/// With [`TrainingConfig::quantized_head`] the head is quantized too: an untied head moves from
/// `Pu` to the quantized part; a tied one becomes a separate quantized copy `V·h·bits/8`
/// beside the 16-bit embedding (LitGPT never ties: its checkpoint converter copies the
/// embedding into `lm_head.weight`, and Fabric swaps that `nn.Linear` for a 4-bit one).
fn weights(x: &Ctx) -> Bytes {
    let base = if x.cfg.is_adapter() {
        let bits = base_bits(x.cfg);
        if bits <= 8.0 {
            let head = quantized_head_params(x);
            // An untied head leaves the 16-bit part when it is quantized.
            let moved = if head > 0.0 {
                x.counts.lm_head as f64
            } else {
                0.0
            };
            let unq = x.params - x.quantizable() - moved;
            (x.quantizable() + head) * bits / 8.0 + unq * 2.0
        } else {
            x.params * bits / 8.0
        }
    } else {
        0.0
    };
    Bytes::from_f64((base + x.trainable * x.regime.weight) / x.shards.weights)
}

/// Parameters of an LM head quantized with the base ([`TrainingConfig::quantized_head`] on
/// an adapter of 8 bits or less): `V·h`, else 0.
fn quantized_head_params(x: &Ctx) -> f64 {
    if x.cfg.quantized_head && x.m.lm_head && x.cfg.is_adapter() && base_bits(x.cfg) <= 8.0 {
        (x.m.vocab_size * x.m.hidden_size) as f64
    } else {
        0.0
    }
}

/// NF4 block scales of a 4-bit base (and of a quantized head): `Pq/64 · 4` (one fp32 absmax per 64 weights); with
/// double quantization `Pq/64 · 1 + Pq/(64·256) · 4` (8-bit scales, one fp32 per 256).
fn quant_scales(x: &Ctx) -> Bytes {
    if !x.cfg.is_adapter() || base_bits(x.cfg) > 4.0 {
        return Bytes::ZERO;
    }
    let blocks = (x.quantizable() + quantized_head_params(x)) / NF4_BLOCK;
    let bytes = if x.cfg.double_quant {
        blocks + blocks / DOUBLE_QUANT_BLOCK * 4.0
    } else {
        blocks * 4.0
    };
    Bytes::from_f64(bytes / x.shards.weights)
}

/// fp32 master weights kept by the optimizer under ZeRO mixed precision: `Pt·4 / N`
/// (HF AMP's fp32 weights are the model itself and are counted as weights).
fn master_weights(x: &Ctx) -> Bytes {
    if x.cfg.optimizer_offload {
        return Bytes::ZERO;
    }
    Bytes::from_f64(x.trainable * x.regime.master / x.shards.states)
}

/// Gradients of the trainable parameters: `Pt·g / N` (N under ZeRO-2/3 and FSDP); with the
/// optimizer in backward only the largest tensor's gradient is alive at once.
///
/// FSDP with gradient accumulation holds them unsharded, `Pt·g`: the accumulating
/// micro-batches run under `no_sync()` (Fabric's `no_backward_sync`, HF Accelerate's
/// `accumulate`), which skips the reduce-scatter, so every unit keeps its full gradient
/// until the last micro-batch's backward reduces it ("FSDP will accumulate the full model
/// gradients (instead of gradient shards) until the eventual sync", torch's FSDP
/// `no_sync` documentation). ZeRO reduces into its partitions at every micro-batch, and so
/// does FSDP under `grad-sync: each-batch` (Accelerate's `sync_each_batch`).
fn gradients(x: &Ctx) -> Bytes {
    if x.cfg.optimizer_in_backward {
        return Bytes::from_f64(largest_trainable_tensor(x) * x.regime.grad);
    }
    let shards = if fsdp_accumulates_unsharded(x) {
        1.0
    } else {
        x.shards.grads
    };
    Bytes::from_f64(x.trainable * x.regime.grad / shards)
}

/// Whether FSDP accumulates full, unsharded gradients over micro-batches (see [`gradients`]).
fn fsdp_accumulates_unsharded(x: &Ctx) -> bool {
    x.cfg.fsdp_accumulates_unsharded()
}

/// Elements of the largest trainable tensor: `r·max(h, I)` for adapters, `h·max(V, I)`
/// otherwise.
fn largest_trainable_tensor(x: &Ctx) -> f64 {
    if x.cfg.is_adapter() {
        let r = x.cfg.lora_rank as f64;
        r * (x.m.hidden_size.max(x.m.intermediate_size)) as f64
    } else {
        let h = x.m.hidden_size as f64;
        h * (x.m.vocab_size.max(x.m.intermediate_size)) as f64
    }
}

/// Optimizer states per trainable parameter, `/N` under ZeRO/FSDP. AdamW/Adam: `2·s`;
/// SGD: 0; SGD with momentum: `s`; Adafactor: factored second moment, `(rows + cols)·s` per
/// matrix; 8-bit AdamW (bitsandbytes or torchao): `2·1 + 2·4/256` (two 8-bit moments and
/// their fp32 block absmax).
/// `s` is 4 under fp32 and mixed precision, the parameter's 2 under pure 16-bit.
fn optimizer_states(x: &Ctx) -> Bytes {
    if x.cfg.optimizer_offload {
        return Bytes::ZERO;
    }
    let s = x.regime.state;
    let bytes = match x.cfg.optimizer {
        Optimizer::AdamW | Optimizer::Adam => x.trainable * 2.0 * s,
        Optimizer::Sgd => 0.0,
        Optimizer::SgdMomentum => x.trainable * s,
        Optimizer::Adafactor => adafactor_elements(x) * s,
        Optimizer::AdamW8bit | Optimizer::AdamW8bitTorchao => {
            x.trainable * (2.0 + 2.0 * 4.0 / ADAM8BIT_BLOCK)
        }
    };
    Bytes::from_f64(bytes / x.shards.states)
}

/// Adafactor's state elements: `Σ (rows + cols)` over the trainable matrices. Full
/// fine-tuning: every layer matrix, the embedding and the head (`V + h` each); adapters:
/// LoRA's `A` (`in + r`) and `B` (`r + out`) per targeted projection.
fn adafactor_elements(x: &Ctx) -> f64 {
    let m = x.m;
    let h = m.hidden_size as f64;
    let v = m.vocab_size as f64;
    if x.cfg.is_adapter() {
        let r = x.cfg.lora_rank as f64;
        let per_layer: f64 = params::lora_matrices(m, &x.cfg.lora_targets)
            .iter()
            .filter(|(on, ..)| *on)
            .map(|&(_, i, o, n)| n as f64 * (i as f64 + o as f64 + 2.0 * r))
            .sum();
        return per_layer * x.cfg.adapted_layers() as f64;
    }
    let per_layer: f64 = params::layer_matrices(m)
        .iter()
        .map(|&(i, o, n)| n as f64 * (i as f64 + o as f64))
        .sum::<f64>()
        + x.counts.norms_per_layer as f64;
    let heads = if x.counts.lm_head > 0 { 2.0 } else { 1.0 };
    per_layer * m.num_layers as f64 + heads * (v + h)
}

/// Bytes one transformer layer keeps for backward, per token, without checkpointing:
///
/// * norms: [`norm_bytes_per_token`];
/// * attention: `p·(q + kv)` for q and k after rotary, `p·kv` for v, `p·q` for the attention
///   output (the output projection's input), with `q = heads·d`, `kv = kv_heads·d`;
///   without flash attention also `heads·S·(4 + c)`: the fp32 softmax probabilities and
///   their 16-bit cast for `P·V` (`c = p` under 16-bit compute, 0 in fp32), plus `1 + 4`
///   for the dropout mask and the dropped probabilities when the model trains with
///   attention dropout (BERT, GPT-2; PyTorch's dropout with `p = 0` returns its input),
///   plus `p` for soft-capped scores (Gemma 2: `tanh(s/c)·c` keeps its tanh output, LitGPT's
///   `scaled_dot_product_attention`); and the k, v repeated to every head, `2·p·(q − kv)`;
/// * with `torch.compile`, norms keep their 16-bit input only (`2·p·h`) and the FFN the
///   gate and up outputs (`2·p·I` gated, `p·I` plain): Inductor recomputes the rest;
/// * FFN, per routed and shared expert (`I` is then `(e + shared)·I_e`, averaged with the
///   dense layers): gated `4·p·I` (gate and up outputs, the activation, their product),
///   plain `2·p·I` (fc1 output and the activation); MoE layers add fp32 router logits and
///   probabilities, `2·4·E`;
/// * adapters: `p·r` per adapted projection (LoRA A's output); with LoRA dropout also the
///   mask and the dropped input, `(1 + p)·Σ in` (`2·p·Σ in` off CUDA/ROCm); DoRA also keeps
///   the base and LoRA outputs for its magnitude rescale, `2·p·Σ out`.
pub fn layer_activation_bytes_per_token(cfg: &TrainingConfig, compute_bytes: f64) -> f64 {
    let m = &cfg.model;
    let p = compute_bytes;
    let q = m.q_dim() as f64;
    let kv = m.kv_dim() as f64;
    let i = m.ffn_width_per_token();
    let norms = norm_bytes_per_token(cfg, p);
    let mut attention = p * (q + kv) + p * kv + p * q;
    if !cfg.flash_attention {
        let cast = if p < 4.0 { p } else { 0.0 };
        let dropout = if m.attention_dropout { 1.0 + 4.0 } else { 0.0 };
        // Soft-capped scores (Gemma 2) keep the tanh output too, in the compute dtype.
        let softcap = if m.attention_softcapping { p } else { 0.0 };
        attention += m.num_heads as f64 * cfg.seq_length as f64 * (4.0 + dropout + cast + softcap);
        attention += 2.0 * p * (q - kv);
    }
    let ffn_matrices = match (m.ffn_gated, cfg.compile) {
        (true, false) => 4.0,
        (true, true) | (false, false) => 2.0,
        (false, true) => 1.0,
    };
    let mut ffn = ffn_matrices * p * i;
    if m.is_moe() {
        let share = m.moe_layers() as f64 / m.num_layers.max(1) as f64;
        ffn += 2.0 * 4.0 * m.num_experts as f64 * share;
    }
    let adapters = if cfg.is_adapter() {
        let t = &cfg.lora_targets;
        let projections = params::lora_matrices(m, t)
            .iter()
            .filter(|(on, ..)| *on)
            .count() as f64;
        let mut extra = p * cfg.lora_rank as f64 * projections;
        if cfg.lora_dropout {
            // Per adapted projection: the dropout mask (a bool on CUDA and ROCm, whose fused
            // kernel returns one; a noise tensor in the input dtype elsewhere) and the dropped
            // copy LoRA A keeps. Measured (bench/accuracy/saved_tensors.py, CPU, LitGPT): all
            // targets keep 27.4·h per token-layer over the frozen model, `(p + p)·Σ in`.
            let mask = match cfg.device {
                Device::Cuda | Device::Rocm => 1.0,
                Device::Cpu | Device::Metal => p,
            };
            let inputs: f64 = params::lora_matrices(m, t)
                .iter()
                .filter(|(on, ..)| *on)
                .map(|&(_, i, _, _)| i as f64)
                .sum();
            extra += (mask + p) * inputs;
        }
        if cfg.method == Method::Dora {
            extra += 2.0 * p * params::adapted_out_width_per_token(m, t) as f64;
        }
        // Adapted layers only; averaged over all layers.
        extra * cfg.adapted_layers() as f64 / m.num_layers as f64
    } else {
        0.0
    };
    norms + attention + ffn + adapters
}

/// Whether the step runs under autocast (mixed precision), which runs `log_softmax` in fp32.
fn under_autocast(cfg: &TrainingConfig) -> bool {
    matches!(cfg.precision, Precision::Bf16Mixed | Precision::Fp16Mixed)
}

/// Parameters and compute in one 16-bit dtype with no autocast: what `torch.autocast`
/// would run in fp32 (`layer_norm`, `log_softmax`) runs in 16 bits.
fn pure_16bit(cfg: &TrainingConfig) -> bool {
    matches!(cfg.precision, Precision::Bf16 | Precision::Fp16)
}

/// Bytes one block's norms keep for backward, per token, with `n` norms over `d` distinct
/// inputs ([`crate::config::Norms::per_block`]: 2 over 2 in sequence, 2 over 1 for parallel attention and
/// FFN, 1 over 1 for a shared norm):
/// * upcast, `n·(4·h + p·h)`: each norm keeps its own fp32 copy of the input and its
///   normalised output (the next projections' input). RMSNorm always upcasts; so does a
///   LayerNorm under autocast (`layer_norm` is on autocast's fp32 list) or in fp32;
/// * a LayerNorm in pure 16 bits, `(d + n)·p·h`: `native_layer_norm` keeps its 16-bit input
///   (with per-row mean and rstd) and no fp32 copy, plus the normalised output. Parallel
///   blocks normalise one input: GPT-NeoX keeps `x` once for both norms, phi one norm.
/// * with `torch.compile`, `d·p·h`: Inductor recomputes the normalised output from the
///   16-bit input.
///
/// Why: LitGPT 2023's phi-1.5 (one shared `nn.LayerNorm`) and StableLM Alpha (two, on the
/// same input) in `bf16-true` read +13 % to +24 % with every block counted as two upcast
/// RMSNorms; the difference is these norms' `8·h` and `6·h` bytes per token-layer.
fn norm_bytes_per_token(cfg: &TrainingConfig, p: f64) -> f64 {
    let h = cfg.model.hidden_size as f64;
    let (norms, inputs) = cfg.model.norms.per_block();
    let (norms, inputs) = (f64::from(norms), f64::from(inputs));
    if cfg.compile {
        return inputs * p * h;
    }
    if cfg.model.norms.upcasts() || !pure_16bit(cfg) {
        norms * (4.0 * h + p * h)
    } else {
        (inputs + norms) * p * h
    }
}

/// Activations kept for backward: `B·S·(L·layer + (4 + p)·h)` (the last term: final norm
/// and LM-head input). With gradient checkpointing each layer keeps only its input,
/// `B·S·(L·p·h + 2·layer + (4 + p)·h)`: the inputs of every layer, plus one layer's full
/// activations and their gradients while that layer is recomputed and back-propagated.
///
/// With activation offloading the saved tensors go to host memory; the device keeps the
/// layer in use and the next one in flight: `B·S·(2·layer + head)`, or with checkpointing
/// `B·S·(2·p·h + layer + head)` (two layer inputs and the recomputed layer).
fn activations(x: &Ctx) -> Bytes {
    let p = x.regime.compute;
    let layer = layer_activation_bytes_per_token(x.cfg, p);
    let h = x.m.hidden_size as f64;
    let layers = x.m.num_layers as f64;
    let head = (4.0 + p) * h;
    let kept_layers = if x.cfg.activation_offload {
        layers.min(2.0)
    } else {
        layers
    };
    let per_token = if x.cfg.grad_checkpointing {
        kept_layers * p * h + layer + head
    } else {
        kept_layers * layer + head
    };
    let quantized = layers * quantized_linear_inputs_per_token(x);
    Bytes::from_f64(x.tokens * (per_token + quantized))
}

/// Inputs that a bitsandbytes 4- or 8-bit linear keeps for backward on top of what the same
/// LoRA model keeps in 16 bits, per token and layer: `p·(2h + q + I)`, one copy of each
/// distinct input of the block's linears (the two norm outputs, the attention output, the
/// FFN's product; gate and up share theirs). Only for adapters on a base of 8 bits or less
/// and without gradient checkpointing.
///
/// Why: `MatMul4Bit` (bitsandbytes up to 0.43.1, fixed by bitsandbytes PR #1270) and
/// `MatMul8bitLt` (still) keep their input as a plain ctx attribute,
/// `ctx.tensors = (A, B)` / `(CAt, subA, A)`, although the frozen weight needs no
/// gradient; a frozen 16-bit `nn.Linear` keeps only its weight. Measured with
/// `bench/accuracy/saved_tensors.py` (LitGPT blocks, h 256, q 256, I 704, bf16): QLoRA
/// keeps 13,176 B per token-layer, LoRA 10,232 B, a difference of exactly
/// `2·(2·256 + 256 + 704)` = 2,944 B. Reentrant checkpointing (HF's and PEFT's default in
/// that bitsandbytes era) runs the forward without a graph and frees them (measured:
/// 4.0·h per token-layer, as without quantization); non-reentrant checkpointing cannot see
/// ctx attributes and keeps them, which is not modelled.
fn quantized_linear_inputs_per_token(x: &Ctx) -> f64 {
    if !x.cfg.is_adapter() || base_bits(x.cfg) > 8.0 || x.cfg.grad_checkpointing {
        return 0.0;
    }
    let m = x.m;
    let inputs = 2.0 * m.hidden_size as f64 + m.q_dim() as f64 + m.ffn_width_per_token();
    x.regime.compute * inputs
}

/// Logits and their loss, by how the trainer computes it:
/// * `standard`: `B·S·V·(p + 12)` — the logits in the compute dtype plus the loss's three
///   fp32 tensors (see [`LOSS_BYTES_PER_LOGIT`]);
/// * `narrow` (no upcast, in pure 16 bits): `B·S·V·4·p` — the same four tensors all in the
///   compute dtype: `log_softmax` of a bf16 input returns bf16, and so do both gradients
///   (transformers 4.40's `GPTBigCodeForCausalLM.forward`: `CrossEntropyLoss()` on
///   `lm_logits[..., :-1, :].contiguous()`, no `.float()`; Llama's head upcast since 4.36).
///   Under autocast or in fp32, as `standard`;
/// * `chunked`: `B·S·V·(p + 4)` — the logits plus each chunk's saved log-softmax
///   ([`CHUNKED_LOSS_BYTES_PER_LOGIT`]); one chunk's gradients at a time are noise;
///   compiled (torchtune's `compile_loss` compiles each chunk's upcast and cross-entropy as
///   one graph) `B·S·V·p`: the graph saves its 16-bit input and a per-row log-sum-exp and
///   recomputes the fp32 log-softmax in backward, so no fp32 tensor outlives its chunk. (The
///   torchtune LoRA and QLoRA rows GT068/GT069 leave 1.2 and 0.5 GB at their peak for
///   everything of the loss: `B·S·V·(p + 4)` there is 6.3 GB.)
/// * `fused`: no `B·S·V` tensor; the hidden states' gradient computed in forward and one
///   chunk of fp32 logits with their gradient, the chunk sized so that it holds about
///   `B·S·h` elements: `B·S·h·(p + 8)`.
///
/// Zero for models without an LM head (classifiers: B·classes).
fn logits(x: &Ctx) -> Bytes {
    if !x.m.lm_head {
        return Bytes::ZERO;
    }
    let p = x.regime.compute;
    let per_token = match x.cfg.loss {
        Loss::Standard => x.m.vocab_size as f64 * (p + LOSS_BYTES_PER_LOGIT),
        Loss::Narrow if !under_autocast(x.cfg) => x.m.vocab_size as f64 * NARROW_LOSS_TENSORS * p,
        Loss::NarrowReleased if !under_autocast(x.cfg) => {
            x.m.vocab_size as f64 * NARROW_RELEASED_LOSS_TENSORS * p
        }
        // Autocast runs `log_softmax` in fp32 whatever the head returns: the standard loss.
        Loss::Narrow | Loss::NarrowReleased => x.m.vocab_size as f64 * (p + LOSS_BYTES_PER_LOGIT),
        Loss::Chunked if x.cfg.compile => x.m.vocab_size as f64 * p,
        Loss::Chunked => x.m.vocab_size as f64 * (p + CHUNKED_LOSS_BYTES_PER_LOGIT),
        Loss::Fused => x.m.hidden_size as f64 * (p + 8.0),
    };
    Bytes::from_f64(x.tokens * per_token)
}

/// Workspace live with the activations at the start of backward:
/// * autocast's 16-bit copies of fp32 trainable weights (HF AMP full fine-tuning without
///   ZeRO or FSDP), `Pt·p`; under FSDP its mixed-precision policy casts per unit instead
///   (see [`gathered_units`]), under ZeRO the module's weights are 16-bit already;
/// * ZeRO-3/FSDP: the units gathered unsharded at once, [`gathered_units`]; FSDP over more
///   than one device also one unit's unsharded gradient before its reduce-scatter
///   ([`fsdp_unit_gradient`]) and the root unit ([`fsdp_root_unit`]);
/// * DoRA: `W + B·A` of the largest adapted matrix, materialised for its norm, `in·out·p`;
/// * a 4- or 8-bit base: each matrix is dequantized to `p` bytes for its matmul, forward
///   and backward (bitsandbytes `MatMul4Bit`, and LLM.int8's `CB·SCB/127`), one at a time,
///   `in·out·p` of the largest (`in·out·(2 + p)` quantized from fp16, see
///   [`dequantized_bytes`]; a quantized head, see [`quantized_head_dequant_excess`]);
/// * the optimizer in backward: its per-tensor temporary, see [`optimizer_workspace`].
fn forward_backward_workspace(x: &Ctx) -> Bytes {
    let p = x.regime.compute;
    let mut bytes = 0.0;
    if x.regime.autocasts() && !x.cfg.is_adapter() && x.cfg.parallelism != Parallelism::Fsdp {
        bytes += x.trainable * p;
    }
    bytes += gathered_units(x) + fsdp_unit_gradient(x) + fsdp_root_unit(x);
    if x.cfg.method == Method::Dora {
        bytes += params::largest_adapted_matrix(x.m, &x.cfg.lora_targets) as f64 * p;
    }
    if x.cfg.is_adapter() && base_bits(x.cfg) <= 8.0 {
        let m = x.m;
        let widest = m.q_dim().max(m.intermediate_size) as f64;
        let block = m.hidden_size as f64 * widest * dequantized_bytes(x);
        bytes += block.max(quantized_head_dequant_excess(x, block));
    }
    if x.cfg.optimizer_in_backward {
        bytes += optimizer_temporary(x);
    }
    Bytes::from_f64(bytes)
}

/// Whether parameters are sharded (ZeRO-3, FSDP) and gathered unit by unit.
fn shards_parameters(x: &Ctx) -> bool {
    matches!(x.cfg.parallelism, Parallelism::Zero3 | Parallelism::Fsdp)
}

/// FSDP over more than one device: the blocks are its units and the rest is the root unit.
fn fsdp_across_ranks(x: &Ctx) -> bool {
    x.cfg.parallelism == Parallelism::Fsdp && x.cfg.world_size > 1
}

/// Parameters outside the blocks, `R`: embeddings, an untied head and the final norm (FSDP's
/// root unit when the blocks are wrapped, as HF Accelerate's transformer auto-wrap and
/// torchtune/LitGPT's per-block `fully_shard` do).
fn root_params(x: &Ctx) -> f64 {
    (x.counts.embedding + x.counts.lm_head + x.m.hidden_size) as f64
}

/// Parameters of one block, `U = (P − R − extra)/L`: one FSDP unit, and what ZeRO-3 gathers
/// for one block's forward or backward.
fn block_params(x: &Ctx) -> f64 {
    let outside = root_params(x) + x.counts.extra as f64;
    (x.params - outside).max(0.0) / x.m.num_layers.max(1) as f64
}

/// ZeRO-3 and FSDP: the units unsharded at once, the one computing and the one prefetched
/// (FSDP's `backward_prefetch=BACKWARD_PRE` with `limit_all_gathers`, ZeRO-3's prefetch):
/// `2·U·g`, with `g` the bytes per gathered parameter (`p`, or the storage of a 4/8-bit
/// base). Both gather in the compute dtype: ZeRO-3's module weights are 16-bit, and FSDP's
/// mixed-precision policy (`param_dtype`) casts each unit's local shard before its
/// all-gather, so a unit in flight also holds that cast shard, `U·p/N`: per unit, never per
/// model. Not divided by `N`: an unsharded unit is whole on every rank.
fn gathered_units(x: &Ctx) -> f64 {
    if !shards_parameters(x) {
        return 0.0;
    }
    let p = x.regime.compute;
    let storage = if x.cfg.is_adapter() && base_bits(x.cfg) <= 8.0 {
        base_bits(x.cfg) / 8.0
    } else {
        p
    };
    let unit = block_params(x);
    let cast_shards = if x.cfg.parallelism == Parallelism::Fsdp && x.regime.weight > p {
        unit * p / x.shards.weights
    } else {
        0.0
    };
    2.0 * (unit * storage + cast_shards)
}

/// FSDP over ranks, at the start of backward: one unit's unsharded gradient in the compute
/// dtype until its reduce-scatter, `Ut·p` with `Ut` the unit's trainable parameters (`U`
/// for full fine-tuning, `Pt` over the adapted layers for adapters). None while gradients
/// accumulate unsharded (they are among the gradients). ZeRO-3 copies each gradient into its
/// reduce bucket instead, counted in [`communication_buckets`].
fn fsdp_unit_gradient(x: &Ctx) -> f64 {
    if !fsdp_across_ranks(x) || fsdp_accumulates_unsharded(x) {
        return 0.0;
    }
    let trainable_unit = if x.cfg.is_adapter() {
        x.trainable / x.cfg.adapted_layers().max(1) as f64
    } else {
        block_params(x)
    };
    trainable_unit * x.regime.compute
}

/// FSDP over ranks: the root unit (embeddings, head, final norm: `R`) stays unsharded from
/// forward through backward (FSDP does not reshard the root after forward: its parameters
/// are needed at once by backward), `R·p`, and, under full fine-tuning, its unsharded
/// gradient in the compute dtype waits for the embedding's, the last one computed, before
/// its reduce-scatter, `R·p` more. Adapters leave the root frozen: no gradient. Accumulating
/// unsharded, the root's gradient is already among the gradients.
fn fsdp_root_unit(x: &Ctx) -> f64 {
    if !fsdp_across_ranks(x) {
        return 0.0;
    }
    let p = x.regime.compute;
    let grad = if x.cfg.is_adapter() || fsdp_accumulates_unsharded(x) {
        0.0
    } else {
        p
    };
    root_params(x) * (p + grad)
}

/// A quantized LM head ([`TrainingConfig::quantized_head`]) is dequantized whole, `V·h·p`,
/// for its matmul in forward and again in backward (bitsandbytes `MatMul4Bit`:
/// `grad_A = grad_output @ dequantize_4bit(B)`). Its backward runs after every chunk's loss
/// backward (autograd takes the latest nodes first), so at that moment the logits and their
/// gradient are alive, `2·p·B·S·V` (none under a fused loss), instead of the loss's
/// [`logits`] term, on top of the activations. Returns what that moment needs beyond the
/// logits term (at least `block`, the blocks' own dequantized matrix it replaces).
///
/// Measured (bench/accuracy/saved_tensors.py `head_step_peak`, LitGPT `lora.GPT` as
/// `finetune/lora.py` runs it, h 256, S 64, V 32768 and 65536, CPU): quantizing the head
/// raises the step's peak by 0.58·`V·h·p`, with the dequantized head, the logits and their
/// gradient alive at the peak; this term predicts `V·h·p + 2·p·S·V − 4·p·S·V` = 0.50·`V·h·p`
/// there (the bf16-head peak holds four logit-sized tensors).
fn quantized_head_dequant_excess(x: &Ctx, block: f64) -> f64 {
    let head = quantized_head_params(x);
    if head == 0.0 {
        return block;
    }
    let p = x.regime.compute;
    let kept_logits = match x.cfg.loss {
        Loss::Fused => 0.0,
        Loss::Standard | Loss::Narrow | Loss::NarrowReleased | Loss::Chunked => {
            2.0 * p * x.tokens * x.m.vocab_size as f64
        }
    };
    (head * dequantized_bytes(x) + kept_logits - logits(x).as_f64()).max(block)
}

/// Bytes per weight of a matrix being dequantized: `p`, or `2 + p` when a 4-bit base was
/// quantized from fp16 ([`TrainingConfig::quant_from_fp16`]) and computes in another dtype:
/// `dequantize_4bit(B).to(A.dtype)` (bitsandbytes 0.42.0 `MatMul4Bit`, forward and backward)
/// holds the fp16 result and its copy at once.
///
/// Measured (bench/accuracy/saved_tensors.py `head_step_peak`, V 32768, h 256, S 64, CPU):
/// with the head and blocks quantized from fp16 instead of bf16 the step's peak rises by
/// another 0.97·`V·h·p` (1.55 against 0.58), two `V·h` tensors alive at the peak.
fn dequantized_bytes(x: &Ctx) -> f64 {
    let p = x.regime.compute;
    let copy = x.cfg.quant_from_fp16
        && base_bits(x.cfg) <= 4.0
        && !matches!(x.cfg.precision, Precision::Fp16 | Precision::Fp16Mixed);
    if copy { 2.0 + p } else { p }
}

/// Optimizer workspace at the step. Adam/AdamW as HF Trainer and torchtune run it (fused,
/// or one tensor at a time) makes `sqrt(v)` and `sqrt(v)/c` for one tensor at a time:
/// `2·s·max tensor` with the largest trainable tensor `max(V·h, I·h)` (the `foreach`
/// implementation, plain PyTorch's default on CUDA, would make `Pt·s` at once); Adafactor
/// squares one gradient at a time in fp32, `2·4·max tensor`; ZeRO mixed precision makes an
/// fp32 gradient partition, `Pt·4 / N`, and steps with a fused kernel (no temporary).
/// With the optimizer offloaded the step runs on the host (nothing here); with the optimizer
/// in backward its temporary is counted at the backward peak instead.
fn optimizer_workspace(x: &Ctx) -> Bytes {
    if x.cfg.optimizer_offload || x.cfg.optimizer_in_backward {
        return Bytes::ZERO;
    }
    Bytes::from_f64(optimizer_temporary(x)) + zero_step_gradient(x)
}

/// ZeRO mixed precision's fp32 gradient partition, `Pt·4 / N`: one flat buffer made at the
/// step (none with the optimizer offloaded or in backward, or outside ZeRO).
fn zero_step_gradient(x: &Ctx) -> Bytes {
    if x.cfg.optimizer_offload || x.cfg.optimizer_in_backward {
        return Bytes::ZERO;
    }
    Bytes::from_f64(x.trainable * x.regime.step_grad / x.shards.states)
}

/// What the caching allocator holds for ZeRO's step gradient beyond the peak of live tensors:
/// `backward + buffer − max(backward, step)`, with the backward's and the step's per-step
/// tensors and the buffer of [`zero_step_gradient`]. The buffer is one allocation of
/// `Pt·4 / N`, made after the backward freed its activations and logits into the cache; those
/// blocks belong to segments cut to the backward's own tensors, and the default allocator
/// neither merges blocks of different segments nor returns segments, so the buffer takes a new
/// segment and the reserve holds the backward's segments and the buffer at once: the step's
/// tensors that the backward shares (gradients, buckets) are counted once. With
/// `expandable_segments:True` the freed pages serve the buffer: nothing here. No fitted
/// constant: S (`bench/accuracy/collected/gpjt-fine-tune-2024.csv`, DeepSpeed ZeRO-3, the
/// only source with allocated and reserved peaks of the same runs) shows it, reserved above
/// allocated by 3.3–4.9 GiB with the default allocator and 2.0–3.1 GiB with expandable
/// segments.
fn zero_step_segment(cfg: &TrainingConfig, backward: Bytes, step: Bytes, buffer: Bytes) -> Bytes {
    let caching = matches!(cfg.device, Device::Cuda | Device::Rocm);
    if !caching || cfg.expandable_segments || buffer == Bytes::ZERO {
        return Bytes::ZERO;
    }
    Bytes((backward + buffer).0.saturating_sub(backward.max(step).0))
}

/// The optimizer's per-tensor temporary: Adam `2·s·` the largest tensor (none under ZeRO's
/// fused step), Adafactor `2·4·` the largest tensor, none for SGD and bitsandbytes' 8-bit
/// AdamW (one fused kernel). torchao's 8-bit AdamW `2·4·` the largest tensor: its compiled
/// `single_param_adam` dequantizes both moments to fp32 and keeps them ("keep high precision
/// copy for param update") to requantize them block-wise and to update the weight.
fn optimizer_temporary(x: &Ctx) -> f64 {
    let s = x.regime.state;
    let largest = largest_trainable_tensor(x);
    let zero = x.regime.step_grad > 0.0;
    match x.cfg.optimizer {
        Optimizer::AdamW | Optimizer::Adam if zero => 0.0,
        Optimizer::AdamW | Optimizer::Adam => 2.0 * largest * s,
        Optimizer::Adafactor | Optimizer::AdamW8bitTorchao => 2.0 * 4.0 * largest,
        Optimizer::Sgd | Optimizer::SgdMomentum | Optimizer::AdamW8bit => 0.0,
    }
}

/// Communication buckets, allocated once: DDP keeps a flat copy of every gradient, `Pt·g`;
/// ZeRO reduces through a bucket of `min(Pt, 5·10⁸)` 16-bit elements.
fn communication_buckets(x: &Ctx) -> Bytes {
    let bytes = match x.cfg.parallelism {
        Parallelism::Ddp if x.cfg.world_size > 1 => x.trainable * x.regime.grad,
        Parallelism::Zero1 | Parallelism::Zero2 | Parallelism::Zero3 => {
            x.trainable.min(ZERO_REDUCE_BUCKET) * x.regime.compute
        }
        _ => 0.0,
    };
    Bytes::from_f64(bytes)
}

/// Fixed runtime cost of the device kind: the CUDA context; the CPU process baseline
/// (interpreter, torch, transformers, peft); the Metal runtime; the ROCm context.
pub fn runtime_overhead(device: Device) -> Bytes {
    runtime_overhead_with(device, &Fitted::SHIPPED)
}

fn runtime_overhead_with(device: Device, fitted: &Fitted) -> Bytes {
    match device {
        Device::Cuda => fitted.cuda_context,
        Device::Cpu => fitted.cpu_process_baseline,
        Device::Metal => METAL_RUNTIME,
        Device::Rocm => ROCM_CONTEXT,
    }
}

/// Allocator reserve above live tensors: `fraction · per-step tensors` (activations,
/// logits, gradients, workspaces), with the CUDA caching allocator's or the CPU heap's
/// fraction (PyTorch's HIP build uses the same caching allocator as CUDA). Metal's unified
/// memory is reported at the allocation level: none. On the caching allocator, batches whose
/// shapes vary add [`CUDA_FRAGMENTATION_PER_SPREAD`] per unit of spread, unless they are
/// packed or the allocator's segments are expandable.
fn allocator_cache(cfg: &TrainingConfig, per_step: Bytes, fitted: &Fitted) -> Bytes {
    let fragmenting = !cfg.packing && !cfg.expandable_segments;
    let spread = if fragmenting {
        cfg.seq_length_spread
    } else {
        0.0
    };
    let fraction = match cfg.device {
        Device::Cuda | Device::Rocm => {
            fitted.cuda_cache_fraction + fitted.cuda_fragmentation_per_spread * spread
        }
        Device::Cpu => fitted.cpu_heap_fraction,
        Device::Metal => 0.0,
    };
    Bytes::from_f64(per_step.as_f64() * fraction)
}

/// Estimates the peak memory of one training step of `cfg` on one device.
pub fn estimate(cfg: &TrainingConfig) -> Result<Estimate, Vec<ConfigError>> {
    estimate_with(cfg, &Fitted::SHIPPED)
}

/// [`estimate`] with other values of the fitted constants (cross-validation, refits).
pub fn estimate_with(cfg: &TrainingConfig, fitted: &Fitted) -> Result<Estimate, Vec<ConfigError>> {
    cfg.validate()?;
    if cfg.untied_head && cfg.model.tie_embeddings && cfg.model.lm_head {
        // The trainer's model has its own head: the same model untied, with `V·h` more
        // parameters (a published count is of the tied checkpoint).
        let mut untied = cfg.clone();
        untied.model.tie_embeddings = false;
        let head = cfg.model.vocab_size.saturating_mul(cfg.model.hidden_size);
        untied.model.params = cfg.model.params.map(|p| p.saturating_add(head));
        return estimate_with(&untied, fitted);
    }
    let x = Ctx::new(cfg);
    let grads = gradients(&x);
    let buckets = communication_buckets(&x);

    let backward = [
        (Component::Gradients, grads),
        (Component::Activations, activations(&x)),
        (Component::Logits, logits(&x)),
        (
            Component::Transient,
            forward_backward_workspace(&x) + buckets,
        ),
    ];
    let step = [
        (Component::Gradients, grads),
        (Component::Transient, optimizer_workspace(&x) + buckets),
    ];
    let sum = |v: &[(Component, Bytes)]| v.iter().map(|(_, b)| *b).sum::<Bytes>();
    let per_step: &[(Component, Bytes)] = if sum(&backward) >= sum(&step) {
        &backward
    } else {
        &step
    };
    let per_step_total = sum(per_step);
    let step_segment = zero_step_segment(cfg, sum(&backward), sum(&step), zero_step_gradient(&x));

    let mut components = Vec::with_capacity(10);
    components.extend_from_slice(&[
        (Component::Weights, weights(&x)),
        (Component::QuantScales, quant_scales(&x)),
        (Component::MasterWeights, master_weights(&x)),
        (Component::OptimizerStates, optimizer_states(&x)),
    ]);
    components.extend_from_slice(per_step);
    components.push((
        Component::RuntimeOverhead,
        runtime_overhead_with(cfg.device, fitted),
    ));
    components.push((
        Component::AllocatorCache,
        allocator_cache(cfg, per_step_total, fitted) + step_segment,
    ));
    Ok(Estimate::from_components(components))
}

#[cfg(test)]
mod tests;
