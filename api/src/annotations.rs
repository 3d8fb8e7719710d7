//! Pod annotations (`memguard.io/…`): the keys, and their parsing into a training config.
//!
//! The CLI's `estimate` flags are the same keys without the prefix, and go through the same
//! parser ([`TrainingAnnotations::parse_keys`]), so a pod and a command line can never disagree.

use crate::models::ModelCatalog;
use crate::quantity::Size;
use memguard_estimator::{
    Bytes, ConfigError, Device, GradSync, LoraTargets, Loss, Method, ModelShape, Optimizer,
    Parallelism, Precision, TrainingConfig, parse_count,
};
use std::collections::BTreeMap;
use std::fmt;

/// Prefix of every memguard annotation.
pub const PREFIX: &str = "memguard.io/";

/// Model name, e.g. `llama-3-8b` or `meta-llama/Llama-3.1-8B`: one of the policy's models
/// (`spec.models`), else of the built-in catalog.
pub const MODEL: &str = "memguard.io/model";
/// Total parameters (`7e9`, `7B`, `125M`).
pub const MODEL_PARAMS: &str = "memguard.io/model-params";
/// Storage bits of the base weights (4, 8, 16, 32).
pub const MODEL_BITS: &str = "memguard.io/model-bits";
/// Model width.
pub const HIDDEN_SIZE: &str = "memguard.io/hidden-size";
/// Transformer blocks.
pub const NUM_LAYERS: &str = "memguard.io/num-layers";
/// Attention heads.
pub const NUM_HEADS: &str = "memguard.io/num-heads";
/// Key/value heads (GQA).
pub const NUM_KV_HEADS: &str = "memguard.io/num-kv-heads";
/// Width of one FFN branch.
pub const INTERMEDIATE_SIZE: &str = "memguard.io/intermediate-size";
/// Vocabulary size.
pub const VOCAB_SIZE: &str = "memguard.io/vocab-size";
/// Gated FFN (SwiGLU): `true|false`.
pub const FFN_GATED: &str = "memguard.io/ffn-gated";
/// Input and output embeddings tied: `true|false`.
pub const TIE_EMBEDDINGS: &str = "memguard.io/tie-embeddings";
/// MoE experts per layer.
pub const NUM_EXPERTS: &str = "memguard.io/num-experts";
/// MoE experts per token.
pub const EXPERTS_PER_TOKEN: &str = "memguard.io/experts-per-token";
/// Per-device batch size.
pub const BATCH_SIZE: &str = "memguard.io/batch-size";
/// Sequence length.
pub const SEQ_LENGTH: &str = "memguard.io/seq-length";
/// Gradient accumulation steps.
pub const GRAD_ACCUMULATION: &str = "memguard.io/grad-accumulation";
/// `full|lora|qlora|dora`.
pub const METHOD: &str = "memguard.io/method";
/// LoRA rank.
pub const LORA_RANK: &str = "memguard.io/lora-rank";
/// Adapted layers.
pub const LORA_LAYERS: &str = "memguard.io/lora-layers";
/// Adapted projections: `q,k,v,o,gate,up,down` or `all-linear`.
pub const LORA_TARGETS: &str = "memguard.io/lora-targets";
/// QLoRA double quantization: `true|false`.
pub const DOUBLE_QUANT: &str = "memguard.io/double-quant";
/// `adamw|adam|sgd|sgd-momentum|adafactor|adamw-8bit`.
pub const OPTIMIZER: &str = "memguard.io/optimizer";
/// `true|false`.
pub const GRAD_CHECKPOINTING: &str = "memguard.io/grad-checkpointing";
/// `true|false`.
pub const FLASH_ATTENTION: &str = "memguard.io/flash-attention";
/// `standard|narrow|narrow-released|chunked|fused`: how the loss over the vocabulary is
/// computed (default `standard`: the whole logits upcast to fp32; `narrow`: not upcast,
/// transformers before 4.46 for GPT-2 and GPT-BigCode, or a trainer's own cross-entropy on
/// 16-bit logits without autocast; `narrow-released`: the same, with the model's output let
/// go before backward, as transformers' `Trainer` does).
pub const LOSS: &str = "memguard.io/loss";
/// `true|false`: the model trains with attention dropout (default: the catalog's or
/// config.json's value; GPT-2 and BERT do, current LLMs do not).
pub const ATTENTION_DROPOUT: &str = "memguard.io/attention-dropout";
/// `true|false`: activations offloaded to host memory (default `false`).
pub const ACTIVATION_OFFLOAD: &str = "memguard.io/activation-offload";
/// `true|false`: optimizer states and step on the host (default `false`).
pub const OPTIMIZER_OFFLOAD: &str = "memguard.io/optimizer-offload";
/// `true|false`: the optimizer steps each parameter during backward (default `false`).
pub const OPTIMIZER_IN_BACKWARD: &str = "memguard.io/optimizer-in-backward";
/// `true|false`: the model runs under `torch.compile` (default `false`).
pub const COMPILE: &str = "memguard.io/compile";
/// `true|false`: the LoRA adapters apply dropout to their input (`lora_dropout` above 0;
/// default `false`, PEFT's default of 0).
pub const LORA_DROPOUT: &str = "memguard.io/lora-dropout";
/// `accumulate|each-batch`: how the trainer synchronises gradients while micro-batches
/// accumulate (default `accumulate`: `no_sync()` until the last micro-batch, what HF
/// Accelerate, the HF Trainer and LitGPT do; `each-batch`: Accelerate's `sync_each_batch`).
/// Under FSDP with several ranks and accumulation above 1, `accumulate` holds full,
/// unsharded gradients.
pub const GRAD_SYNC: &str = "memguard.io/grad-sync";
/// `true|false`: a 4- or 8-bit base quantizes the LM head too (Lightning Fabric's
/// `BitsandbytesPrecision`, as LitGPT runs QLoRA); default `false` (transformers' bitsandbytes
/// integration keeps `lm_head` in 16 bits).
pub const QUANTIZED_HEAD: &str = "memguard.io/quantized-head";
/// `true|false`: a 4-bit base was quantized from fp16 (Fabric's `BitsandbytesPrecision`,
/// bitsandbytes up to 0.42), so each dequantized matrix is also copied to the compute dtype;
/// default `false` (bitsandbytes 0.43+).
pub const QUANT_FROM_FP16: &str = "memguard.io/quant-from-fp16";
/// `true|false`: the trainer keeps the LM head as its own parameter even when the checkpoint
/// ties it to the embedding (LitGPT); default `false` (transformers keeps the tie).
pub const UNTIED_HEAD: &str = "memguard.io/untied-head";
/// How much the batches' padded lengths vary, `(longest − shortest) / longest` in [0, 1]
/// (default 0: every batch one shape). Varying shapes fragment the CUDA caching allocator
/// unless the batches are packed or its segments are expandable.
pub const SEQ_LENGTH_SPREAD: &str = "memguard.io/seq-length-spread";
/// `true|false`: sequences are packed into fixed-length batches (default `false`: padded).
pub const PACKING: &str = "memguard.io/packing";
/// `fp32|bf16-mixed|fp16-mixed|bf16|fp16`.
pub const PRECISION: &str = "memguard.io/precision";
/// `cuda|cpu|metal|rocm`; default: `rocm` for AMD GPUs, `cuda` for NVIDIA GPUs, else `cpu`.
pub const DEVICE: &str = "memguard.io/device";
/// `none|ddp|fsdp|zero1|zero2|zero3`.
pub const PARALLELISM: &str = "memguard.io/parallelism";
/// Devices in data parallelism.
pub const WORLD_SIZE: &str = "memguard.io/world-size";
/// Memory per GPU, a number and a unit (`80GiB`, `24G`, `23028Mi`), overriding the policy's
/// product table.
pub const GPU_MEMORY: &str = "memguard.io/gpu-memory";
/// Fraction of the memory the plan may use, in (0, 1].
pub const SAFETY_RATIO: &str = "memguard.io/safety-ratio";
/// Name of the trainer container.
pub const CONTAINER: &str = "memguard.io/container";
/// The user's own env variables to rewrite: `batch-size=PER_DEVICE_TRAIN_BATCH_SIZE,…`.
pub const ENV_MAP: &str = "memguard.io/env-map";
/// `false` keeps the webhook from injecting the Python client into this pod (init container,
/// volume, `PYTHONPATH`); anything else, or no value, leaves the policy's choice.
pub const INJECT_CLIENT: &str = "memguard.io/inject-client";
/// `true|false`: the plan may cut quality knobs (sequence length, LoRA rank and layers) down to
/// the policy's floors, where a cut saves at least 2 % of the budget (default: the policy's
/// `floors.allowQuality`, itself false).
pub const ALLOW_QUALITY: &str = "memguard.io/allow-quality";
/// Output: compact JSON summary of the estimate and plan (written by the webhook).
pub const ESTIMATE: &str = "memguard.io/estimate";
/// Output: why the webhook left the pod unchanged (written by the webhook).
pub const ERROR: &str = "memguard.io/error";

/// Every input key, for unknown-key detection and documentation.
pub const INPUT_KEYS: &[&str] = &[
    MODEL,
    MODEL_PARAMS,
    MODEL_BITS,
    HIDDEN_SIZE,
    NUM_LAYERS,
    NUM_HEADS,
    NUM_KV_HEADS,
    INTERMEDIATE_SIZE,
    VOCAB_SIZE,
    FFN_GATED,
    TIE_EMBEDDINGS,
    NUM_EXPERTS,
    EXPERTS_PER_TOKEN,
    BATCH_SIZE,
    SEQ_LENGTH,
    GRAD_ACCUMULATION,
    METHOD,
    LORA_RANK,
    LORA_LAYERS,
    LORA_TARGETS,
    DOUBLE_QUANT,
    OPTIMIZER,
    GRAD_CHECKPOINTING,
    FLASH_ATTENTION,
    LOSS,
    ATTENTION_DROPOUT,
    ACTIVATION_OFFLOAD,
    OPTIMIZER_OFFLOAD,
    OPTIMIZER_IN_BACKWARD,
    COMPILE,
    LORA_DROPOUT,
    GRAD_SYNC,
    QUANTIZED_HEAD,
    QUANT_FROM_FP16,
    UNTIED_HEAD,
    SEQ_LENGTH_SPREAD,
    PACKING,
    PRECISION,
    DEVICE,
    PARALLELISM,
    WORLD_SIZE,
    GPU_MEMORY,
    SAFETY_RATIO,
    ALLOW_QUALITY,
    CONTAINER,
    ENV_MAP,
];

/// Output keys the webhook writes; accepted on input so a re-invocation does not trip over them.
pub const OUTPUT_KEYS: &[&str] = &[ESTIMATE, ERROR];

/// Keys about how the pod is guarded, not what it trains: accepted, read by the webhook only.
pub const POD_OPTION_KEYS: &[&str] = &[INJECT_CLIENT];

/// The shape keys required when no catalog `model` is given.
const REQUIRED_SHAPE_KEYS: &[&str] = &[HIDDEN_SIZE, NUM_LAYERS, NUM_HEADS, VOCAB_SIZE];

/// A problem with one annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationError {
    /// The key without the `memguard.io/` prefix (also the CLI flag name).
    pub key: String,
    /// What is wrong, for a person.
    pub message: String,
}

impl fmt::Display for AnnotationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

impl std::error::Error for AnnotationError {}

impl AnnotationError {
    fn new(key: &str, message: impl Into<String>) -> Self {
        AnnotationError {
            key: key.strip_prefix(PREFIX).unwrap_or(key).to_string(),
            message: message.into(),
        }
    }
}

pub use crate::knobs::Knob;

/// `env-map`: the user's own variables to rewrite in place, knob → variable name.
pub type EnvMap = BTreeMap<Knob, String>;

/// Everything the annotations say, parsed and validated.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingAnnotations {
    /// The training config (device set only when `device` was given; see [`Self::device_given`]).
    pub config: TrainingConfig,
    /// Whether `device` was given explicitly (otherwise the webhook infers it from resources).
    pub device_given: bool,
    /// `gpu-memory`, when given.
    pub gpu_memory: Option<Bytes>,
    /// `safety-ratio`, when given.
    pub safety_ratio: Option<f64>,
    /// `allow-quality`, when given: the pod's own permission to cut quality knobs.
    pub allow_quality: Option<bool>,
    /// `container`, when given.
    pub container: Option<String>,
    /// `env-map` entries.
    pub env_map: EnvMap,
    /// The knobs whose annotation was given: they override what the trainer's config says.
    pub knobs_given: std::collections::BTreeSet<Knob>,
}

/// The pod's own planning options, which admission honours whether or not the pod names a
/// model (a Guarded pod's sidecar plans at train start with them too).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PlanOptions {
    /// `safety-ratio`, when given.
    pub safety_ratio: Option<f64>,
    /// `allow-quality`, when given.
    pub allow_quality: Option<bool>,
}

impl PlanOptions {
    /// The options among a pod's annotations (other keys are not looked at); every error of
    /// a given option, named by its key.
    pub fn parse(annotations: &BTreeMap<String, String>) -> Result<Self, Vec<AnnotationError>> {
        let keys: BTreeMap<String, String> = PLAN_OPTION_KEYS
            .iter()
            .filter_map(|k| {
                Some((
                    k.strip_prefix(PREFIX)?.to_string(),
                    annotations.get(*k)?.clone(),
                ))
            })
            .collect();
        let mut p = Parser {
            keys: &keys,
            errors: Vec::new(),
        };
        let options = Self::read(&mut p);
        if p.errors.is_empty() {
            Ok(options)
        } else {
            Err(p.errors)
        }
    }

    fn read(p: &mut Parser) -> Self {
        let safety_ratio = p.parse_with(SAFETY_RATIO, |s| {
            let r: f64 = s
                .trim()
                .parse()
                .map_err(|_| format!("`{s}` is not a number"))?;
            if r > 0.0 && r <= 1.0 {
                Ok(r)
            } else {
                Err(format!("{r} is not in (0, 1]"))
            }
        });
        let allow_quality = p.boolean(ALLOW_QUALITY);
        PlanOptions {
            safety_ratio,
            allow_quality,
        }
    }
}

/// Whether a pod's annotations name the model: by name, or by its shape.
pub fn names_model(annotations: &BTreeMap<String, String>) -> bool {
    annotations.contains_key(MODEL)
        || REQUIRED_SHAPE_KEYS
            .iter()
            .any(|k| annotations.contains_key(*k))
}

/// Whether a pod's annotations say anything of its training: any memguard input but the
/// [`PlanOptions`], which say how to plan it, so that a pod that gives only those and whose
/// launch cannot be read is guarded (with them) rather than refused for lack of a model.
pub fn has_training_input(annotations: &BTreeMap<String, String>) -> bool {
    annotations
        .keys()
        .any(|k| INPUT_KEYS.contains(&k.as_str()) && !PLAN_OPTION_KEYS.contains(&k.as_str()))
}

/// The keys of [`PlanOptions`].
const PLAN_OPTION_KEYS: &[&str] = &[SAFETY_RATIO, ALLOW_QUALITY];

impl TrainingAnnotations {
    /// Parses pod annotations, `model` resolved in `models` (the policy's, then the built-in
    /// catalog). Keys outside `memguard.io/` are ignored; unknown `memguard.io/` keys are errors
    /// (a typo must not silently fall back to a default). Returns every error.
    pub fn parse(
        annotations: &BTreeMap<String, String>,
        models: &ModelCatalog,
    ) -> Result<Self, Vec<AnnotationError>> {
        let mut keys = BTreeMap::new();
        let mut errors = Vec::new();
        for (key, value) in annotations {
            let Some(short) = key.strip_prefix(PREFIX) else {
                continue;
            };
            if OUTPUT_KEYS.contains(&key.as_str()) || POD_OPTION_KEYS.contains(&key.as_str()) {
                continue;
            }
            if !INPUT_KEYS.contains(&key.as_str()) {
                errors.push(AnnotationError::new(key, unknown_key_message(short)));
                continue;
            }
            keys.insert(short.to_string(), value.clone());
        }
        match Self::parse_keys(&keys, models) {
            Ok(parsed) if errors.is_empty() => Ok(parsed),
            Ok(_) => Err(errors),
            Err(more) => {
                errors.extend(more);
                Err(errors)
            }
        }
    }

    /// Parses keys without the prefix (`batch-size` → `4`): the CLI's flags and annotations alike.
    pub fn parse_keys(
        keys: &BTreeMap<String, String>,
        models: &ModelCatalog,
    ) -> Result<Self, Vec<AnnotationError>> {
        Self::parse_keys_with_model(keys, models, None)
    }

    /// As [`Self::parse_keys`], with the model given as a shape (a Hugging Face `config.json`
    /// read by the CLI) instead of `model`; shape keys still override it, and giving `model`
    /// as well is an error.
    pub fn parse_keys_with_model(
        keys: &BTreeMap<String, String>,
        models: &ModelCatalog,
        model: Option<ModelShape>,
    ) -> Result<Self, Vec<AnnotationError>> {
        let mut p = Parser {
            keys,
            errors: Vec::new(),
        };

        let (model, storage) = p.model_shape(model, models);
        let mut config = TrainingConfig::new(model.unwrap_or_else(placeholder_shape));
        // A policy model's `quantization_config` sets the storage unless the keys say otherwise.
        config.model_bits = storage.model_bits;
        config.double_quant = storage.double_quant;
        if let Some(v) = p.parse_with(MODEL_BITS, |s| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| format!("`{s}` is not one of 4, 8, 16, 32"))
        }) {
            config.model_bits = Some(v);
        }
        if let Some(v) = p.enum_value::<Precision>(PRECISION) {
            config.precision = v;
        }
        if let Some(v) = p.enum_value::<Method>(METHOD) {
            config.method = v;
        }
        if let Some(v) = p.whole(LORA_RANK) {
            config.lora_rank = v;
        }
        config.lora_layers = p.whole(LORA_LAYERS);
        if let Some(v) = p.enum_value::<LoraTargets>(LORA_TARGETS) {
            config.lora_targets = v;
        }
        if let Some(v) = p.boolean(DOUBLE_QUANT) {
            config.double_quant = v;
        }
        if let Some(v) = p.enum_value::<Optimizer>(OPTIMIZER) {
            config.optimizer = v;
        }
        if let Some(v) = p.whole(BATCH_SIZE) {
            config.batch_size = v;
        }
        if let Some(v) = p.whole(SEQ_LENGTH) {
            config.seq_length = v;
        }
        if let Some(v) = p.whole(GRAD_ACCUMULATION) {
            config.grad_accumulation = v;
        }
        if let Some(v) = p.boolean(GRAD_CHECKPOINTING) {
            config.grad_checkpointing = v;
        }
        if let Some(v) = p.boolean(FLASH_ATTENTION) {
            config.flash_attention = v;
        }
        if let Some(v) = p.enum_value::<Loss>(LOSS) {
            config.loss = v;
        }
        if let Some(v) = p.boolean(ATTENTION_DROPOUT) {
            config.model.attention_dropout = v;
        }
        if let Some(v) = p.boolean(ACTIVATION_OFFLOAD) {
            config.activation_offload = v;
        }
        if let Some(v) = p.boolean(OPTIMIZER_OFFLOAD) {
            config.optimizer_offload = v;
        }
        if let Some(v) = p.boolean(OPTIMIZER_IN_BACKWARD) {
            config.optimizer_in_backward = v;
        }
        if let Some(v) = p.boolean(COMPILE) {
            config.compile = v;
        }
        if let Some(v) = p.boolean(LORA_DROPOUT) {
            config.lora_dropout = v;
        }
        if let Some(v) = p.enum_value::<GradSync>(GRAD_SYNC) {
            config.grad_sync = v;
        }
        if let Some(v) = p.boolean(QUANTIZED_HEAD) {
            config.quantized_head = v;
        }
        if let Some(v) = p.boolean(QUANT_FROM_FP16) {
            config.quant_from_fp16 = v;
        }
        if let Some(v) = p.boolean(UNTIED_HEAD) {
            config.untied_head = v;
        }
        if let Some(v) = p.parse_with(SEQ_LENGTH_SPREAD, |s| {
            s.trim()
                .parse::<f64>()
                .map_err(|_| format!("`{s}` is not a number"))
        }) {
            // Range checked with the config (`seq-length-spread: … is not in [0, 1]`).
            config.seq_length_spread = v;
        }
        if let Some(v) = p.boolean(PACKING) {
            config.packing = v;
        }
        let device = p.enum_value::<Device>(DEVICE);
        if let Some(v) = device {
            config.device = v;
        }
        if let Some(v) = p.enum_value::<Parallelism>(PARALLELISM) {
            config.parallelism = v;
        }
        if let Some(v) = p.whole(WORLD_SIZE) {
            config.world_size = v;
        }
        // The one size parser (`crate::quantity`): a bare number is refused, never bytes.
        let gpu_memory = p.parse_with(GPU_MEMORY, |s| {
            Size::parse(s).map(|s| s.bytes()).map_err(|e| e.to_string())
        });
        let PlanOptions {
            safety_ratio,
            allow_quality,
        } = PlanOptions::read(&mut p);
        let container = p.get(CONTAINER).map(|s| s.trim().to_string());
        let env_map = p.env_map().unwrap_or_default();

        // Config-level checks (heads dividing hidden size, rank 0, …) name the same keys.
        if p.errors.is_empty()
            && let Err(errs) = config.validate()
        {
            p.errors.extend(
                errs.into_iter()
                    .map(|e: ConfigError| AnnotationError::new(e.field(), config_message(&e))),
            );
        }
        if p.errors.is_empty() {
            Ok(TrainingAnnotations {
                config,
                device_given: device.is_some(),
                gpu_memory,
                safety_ratio,
                allow_quality,
                container,
                env_map,
                knobs_given: Knob::ALL
                    .into_iter()
                    .filter(|k| keys.contains_key(k.name()))
                    .collect(),
            })
        } else {
            Err(p.errors)
        }
    }
}

/// `s` as a boolean in memguard's one vocabulary (`true|yes|on|1`, `false|no|off|0`, any case).
pub fn parse_boolean(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Some(true),
        "false" | "no" | "off" | "0" => Some(false),
        _ => None,
    }
}

/// The message of a config error without its leading `field: `.
fn config_message(e: &ConfigError) -> String {
    let full = e.to_string();
    let prefix = format!("{}: ", e.field());
    full.strip_prefix(&prefix).unwrap_or(&full).to_string()
}

/// A shape that never reaches the estimator: used only to keep parsing when the model is bad.
fn placeholder_shape() -> ModelShape {
    ModelShape {
        name: None,
        params: None,
        hidden_size: 1,
        num_layers: 1,
        num_heads: 1,
        num_kv_heads: 1,
        intermediate_size: 1,
        vocab_size: 1,
        ffn_gated: true,
        num_experts: 1,
        experts_per_token: 1,
        tie_embeddings: false,
        lm_head: true,
        head_dim: None,
        ..ModelShape::default()
    }
}

/// "unknown key" with a suggestion when a known key is one or two edits away.
fn unknown_key_message(short: &str) -> String {
    let best = INPUT_KEYS
        .iter()
        .map(|k| k.trim_start_matches(PREFIX))
        .map(|k| (edit_distance(short, k), k))
        .min();
    match best {
        Some((d, k)) if d <= 2 || k.replace('-', "") == short.replace(['-', '_'], "") => {
            format!("unknown key (did you mean `{k}`?)")
        }
        _ => "unknown key".to_string(),
    }
}

/// The known model (the policy's or the built-in catalog's) closest to `name`, when a few edits
/// away (up to a third of its length, at least 2): the "did you mean" of an unknown model.
fn closest_model(name: &str, models: &ModelCatalog) -> Option<String> {
    let wanted = memguard_estimator::catalog::normalize(name);
    let known = models.policy_models().iter().map(|m| m.name.clone()).chain(
        memguard_estimator::catalog::names()
            .into_iter()
            .map(str::to_string),
    );
    known
        .map(|k| {
            (
                edit_distance(&wanted, &memguard_estimator::catalog::normalize(&k)),
                k,
            )
        })
        .filter(|(d, _)| *d <= (wanted.len() / 3).max(2))
        .min()
        .map(|(_, k)| k)
}

pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur.push((prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The storage a named model's `config.json` states (`quantization_config`).
#[derive(Default)]
struct Storage {
    model_bits: Option<u32>,
    double_quant: bool,
}

struct Parser<'a> {
    keys: &'a BTreeMap<String, String>,
    errors: Vec<AnnotationError>,
}

impl Parser<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.keys
            .get(key.trim_start_matches(PREFIX))
            .map(String::as_str)
    }

    fn parse_with<T>(&mut self, key: &str, f: impl FnOnce(&str) -> Result<T, String>) -> Option<T> {
        let value = self.get(key)?.to_string();
        match f(&value) {
            Ok(v) => Some(v),
            Err(message) => {
                self.errors.push(AnnotationError::new(key, message));
                None
            }
        }
    }

    fn count(&mut self, key: &str) -> Option<u64> {
        self.parse_with(key, |s| {
            let n = parse_count(s).map_err(|e| e.to_string())?;
            if n == 0 {
                Err("must be at least 1".into())
            } else {
                Ok(n)
            }
        })
    }

    /// A training count (batch, sequence, accumulation, rank, layers, ranks): a plain whole
    /// number, not a size like `7B` (that is for `model-params`).
    fn whole(&mut self, key: &str) -> Option<u64> {
        self.parse_with(key, |s| match s.trim().parse::<u64>() {
            Ok(0) => Err("must be at least 1".into()),
            Ok(n) => Ok(n),
            Err(_) => Err(format!(
                "`{s}` is not a whole number of at least 1 (e.g. `8`; sizes like `7B` are for \
                 model-params)"
            )),
        })
    }

    /// A boolean in the vocabulary the sidecar and the Python client read too: `true|false`,
    /// `yes|no`, `on|off`, `1|0`, any case.
    fn boolean(&mut self, key: &str) -> Option<bool> {
        self.parse_with(key, |s| {
            parse_boolean(s)
                .ok_or_else(|| format!("`{s}` is not a boolean (true|false, yes|no, on|off, 1|0)"))
        })
    }

    fn enum_value<T: std::str::FromStr<Err = ConfigError>>(&mut self, key: &str) -> Option<T> {
        self.parse_with(key, |s| s.parse::<T>().map_err(|e| config_message(&e)))
    }

    /// The model: a named model (the policy's, else the built-in catalog's) with any shape keys
    /// overriding it, or the shape keys alone; and the storage the named model's config states.
    fn model_shape(
        &mut self,
        given: Option<ModelShape>,
        models: &ModelCatalog,
    ) -> (Option<ModelShape>, Storage) {
        let mut storage = Storage::default();
        if given.is_some() && self.get(MODEL).is_some() {
            self.errors.push(AnnotationError::new(
                MODEL,
                "give a model name or a config.json, not both".to_string(),
            ));
            return (None, storage);
        }
        let base = match (self.get(MODEL), given) {
            (_, Some(shape)) => Some(shape),
            (Some(name), None) => match models.lookup(name) {
                Some(found) => {
                    storage = Storage {
                        model_bits: found.model_bits,
                        double_quant: found.double_quant,
                    };
                    Some(found.shape)
                }
                None => {
                    self.errors.push(AnnotationError::new(
                        MODEL,
                        format!(
                            "unknown model `{name}`: {}{} (see `memguard estimate --list-models`)",
                            models.searched(),
                            closest_model(name, models)
                                .map(|m| format!("; did you mean `{m}`?"))
                                .unwrap_or_default()
                        ),
                    ));
                    return (None, storage);
                }
            },
            (None, None) => {
                let missing: Vec<&str> = REQUIRED_SHAPE_KEYS
                    .iter()
                    .filter(|k| self.get(k).is_none())
                    .map(|k| k.trim_start_matches(PREFIX))
                    .collect();
                if !missing.is_empty() {
                    self.errors.push(AnnotationError::new(
                        MODEL,
                        format!(
                            "give a model name, or the shape: missing {}",
                            missing.join(", ")
                        ),
                    ));
                }
                None
            }
        };
        // A catalog entry or a config.json: its own KV heads, FFN width and experts stand
        // unless a key overrides them.
        let from_catalog = base.is_some();
        let mut shape = base.unwrap_or_else(|| {
            let mut s = placeholder_shape();
            s.name = None;
            s
        });
        let hidden = self.count(HIDDEN_SIZE);
        let layers = self.count(NUM_LAYERS);
        let heads = self.count(NUM_HEADS);
        let kv_heads = self.count(NUM_KV_HEADS);
        let intermediate = self.count(INTERMEDIATE_SIZE);
        let vocab = self.count(VOCAB_SIZE);
        let experts = self.count(NUM_EXPERTS);
        let per_token = self.count(EXPERTS_PER_TOKEN);
        let gated = self.boolean(FFN_GATED);
        let tied = self.boolean(TIE_EMBEDDINGS);
        let params = self.count(MODEL_PARAMS);
        let shape_overridden = [hidden, layers, heads, intermediate, experts]
            .iter()
            .any(Option::is_some);
        if let Some(v) = hidden {
            shape.hidden_size = v;
        }
        if let Some(v) = layers {
            shape.num_layers = v;
        }
        if let Some(v) = heads {
            shape.num_heads = v;
        }
        shape.num_kv_heads = match (kv_heads, from_catalog) {
            (Some(v), _) => v,
            (None, true) if heads.is_none() => shape.num_kv_heads,
            _ => shape.num_heads,
        };
        if let Some(v) = intermediate {
            shape.intermediate_size = v;
        } else if !from_catalog {
            // A plain transformer's FFN is 4h wide; SwiGLU models keep ~8h/3 per branch.
            // Saturating: the width is derived before the shape's sanity limits are checked.
            shape.intermediate_size = if gated.unwrap_or(true) {
                (shape.hidden_size.saturating_mul(8) / 3).max(1)
            } else {
                shape.hidden_size.saturating_mul(4)
            };
        }
        if let Some(v) = vocab {
            shape.vocab_size = v;
        }
        if let Some(v) = experts {
            shape.num_experts = v;
        }
        if let Some(v) = per_token {
            shape.experts_per_token = v;
        } else if experts.is_some() && !from_catalog {
            shape.experts_per_token = shape.num_experts.min(2);
        }
        if let Some(v) = gated {
            shape.ffn_gated = v;
        }
        if let Some(v) = tied {
            shape.tie_embeddings = v;
        }
        // A catalog count no longer describes an overridden shape: derive it instead.
        if let Some(p) = params {
            shape.params = Some(p);
        } else if shape_overridden {
            shape.params = None;
        }
        if shape_overridden {
            shape.name = shape.name.map(|n| format!("{n} (modified)"));
        }
        (Some(shape), storage)
    }

    fn env_map(&mut self) -> Option<EnvMap> {
        self.parse_with(ENV_MAP, |s| {
            let mut map = EnvMap::new();
            for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
                let (knob, var) = entry
                    .split_once('=')
                    .ok_or_else(|| format!("`{entry}` is not `knob=VARIABLE`"))?;
                let (knob, var) = env_map_entry(knob, var)?;
                map.insert(knob, var);
            }
            Ok(map)
        })
    }
}

/// One `env-map` entry, knob name → the trainer's own variable, checked: the knob exists, the
/// variable is a plain name and not one of memguard's `MEMGUARD_*`. The one check for the
/// annotation and the policy's `envNames`.
pub fn env_map_entry(knob: &str, var: &str) -> Result<(Knob, String), String> {
    let knob = Knob::parse(knob.trim()).ok_or_else(|| {
        format!(
            "unknown knob `{}` (expected one of: {})",
            knob.trim(),
            Knob::ALL.map(Knob::name).join(", ")
        )
    })?;
    let var = var.trim();
    if !is_env_name(var) {
        return Err(format!("`{var}` is not a valid environment variable name"));
    }
    if var.starts_with("MEMGUARD_") {
        return Err(format!("`{var}`: MEMGUARD_* variables are memguard's own"));
    }
    Ok((knob, var.to_string()))
}

/// `[A-Za-z_][A-Za-z0-9_]*`: what shells and Kubernetes accept without surprises.
fn is_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses against the built-in catalog only.
    fn parse(a: &BTreeMap<String, String>) -> Result<TrainingAnnotations, Vec<AnnotationError>> {
        TrainingAnnotations::parse(a, &ModelCatalog::default())
    }

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Found by the suite's mutation smoke run (fuzz-targets/tests/mutation_smoke.rs): the FFN
    /// width derived from a huge hidden size overflowed (a panic with overflow checks, a wrapped,
    /// tiny width in release) before the sanity limits could refuse the shape.
    #[test]
    fn a_huge_hidden_size_is_refused_not_overflowed() {
        for gated in ["true", "false"] {
            let errors = parse(&annotations(&[
                (MODEL_PARAMS, "7B"),
                (HIDDEN_SIZE, "9223372036854775807"),
                (NUM_LAYERS, "32"),
                (NUM_HEADS, "4294967296"),
                (VOCAB_SIZE, "3"),
                (FFN_GATED, gated),
            ]))
            .expect_err("an absurd shape is refused");
            assert!(
                errors.iter().any(|e| e.to_string().contains("hidden-size")
                    && e.to_string().contains("sanity limit")),
                "{errors:?}"
            );
        }
    }

    #[test]
    fn parses_a_catalog_model_with_training_keys() {
        let a = parse(&annotations(&[
            (MODEL, "llama-3-8b"),
            (METHOD, "lora"),
            (BATCH_SIZE, "8"),
            (SEQ_LENGTH, "4096"),
            (GRAD_CHECKPOINTING, "true"),
            (GPU_MEMORY, "80GiB"),
            (SAFETY_RATIO, "0.9"),
            (ENV_MAP, "batch-size=PER_DEVICE_TRAIN_BATCH_SIZE"),
            ("other.io/ignored", "x"),
        ]))
        .expect("valid");
        assert_eq!(a.config.method, Method::Lora);
        assert_eq!(a.config.batch_size, 8);
        assert_eq!(a.config.seq_length, 4096);
        assert!(a.config.grad_checkpointing);
        assert_eq!(a.gpu_memory, Some(Bytes::gib(80)));
        assert_eq!(a.safety_ratio, Some(0.9));
        assert_eq!(
            a.env_map.get(&Knob::BatchSize).map(String::as_str),
            Some("PER_DEVICE_TRAIN_BATCH_SIZE")
        );
        assert!(!a.device_given);
    }

    /// Issue 38: `memguard.io/gpu-memory: "24"` was 24 bytes; it is refused like the policy's
    /// sizes, by the same parser, and both spellings of a unit are read.
    #[test]
    fn gpu_memory_needs_a_unit() {
        let errors =
            parse(&annotations(&[(MODEL, "llama-3-8b"), (GPU_MEMORY, "24")])).expect_err("no unit");
        assert_eq!(
            errors[0].to_string(),
            "gpu-memory: `24` has no unit: did you mean `24Gi`? (sizes are like 24Gi, 80G, \
             23028Mi or 24GiB)"
        );
        for (text, bytes) in [("24Gi", Bytes::gib(24)), ("24G", Bytes(24_000_000_000))] {
            let a =
                parse(&annotations(&[(MODEL, "llama-3-8b"), (GPU_MEMORY, text)])).expect("valid");
            assert_eq!(a.gpu_memory, Some(bytes), "{text}");
        }
    }

    #[test]
    fn trainer_choices_have_documented_defaults_and_parse_strictly() {
        let base = [(MODEL, "meta-llama/Llama-3.1-8B")];
        let a = parse(&annotations(&base)).expect("valid");
        assert_eq!(a.config.model.name.as_deref(), Some("llama-3.1-8b"));
        assert_eq!(a.config.loss, Loss::Standard);
        assert!(!a.config.compile && !a.config.activation_offload);
        assert!(!a.config.optimizer_offload && !a.config.optimizer_in_backward);
        assert!(!a.config.model.attention_dropout && !a.config.lora_dropout);
        assert_eq!(a.config.grad_sync, GradSync::Accumulate);
        let a = parse(&annotations(&[
            (MODEL, "gpt2"),
            (LOSS, "chunked"),
            (COMPILE, "true"),
            (LORA_DROPOUT, "true"),
            (GRAD_SYNC, "each-batch"),
            (QUANTIZED_HEAD, "true"),
            (QUANT_FROM_FP16, "true"),
            (UNTIED_HEAD, "true"),
            (ACTIVATION_OFFLOAD, "true"),
            (OPTIMIZER_OFFLOAD, "true"),
            (OPTIMIZER_IN_BACKWARD, "true"),
        ]))
        .expect("valid");
        assert_eq!(a.config.loss, Loss::Chunked);
        assert!(a.config.compile && a.config.activation_offload);
        assert!(a.config.optimizer_offload && a.config.optimizer_in_backward);
        assert!(a.config.lora_dropout);
        assert_eq!(a.config.grad_sync, GradSync::EachBatch);
        assert!(a.config.quantized_head && a.config.quant_from_fp16 && a.config.untied_head);
        // GPT-2's config trains with attention dropout; the annotation can say otherwise.
        assert!(a.config.model.attention_dropout);
        let off = parse(&annotations(&[
            (MODEL, "gpt2"),
            (ATTENTION_DROPOUT, "false"),
        ]))
        .expect("valid");
        assert!(!off.config.model.attention_dropout);
        let errs = parse(&annotations(&[
            (MODEL, "gpt2"),
            (LOSS, "liger-ish"),
            (COMPILE, "perhaps"),
            (GRAD_SYNC, "sometimes"),
        ]))
        .expect_err("invalid");
        let keys: Vec<&str> = errs.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, vec!["loss", "compile", "grad-sync"], "{errs:?}");
        assert!(
            errs[2].message.contains("accumulate each-batch"),
            "{}",
            errs[2].message
        );
    }

    #[test]
    fn seq_length_spread_and_packing_are_read_and_checked() {
        let a = parse(&annotations(&[(MODEL, "llama-3-8b")])).expect("valid");
        assert_eq!(a.config.seq_length_spread, 0.0);
        assert!(!a.config.packing);
        let a = parse(&annotations(&[
            (MODEL, "llama-3-8b"),
            (SEQ_LENGTH_SPREAD, "0.75"),
            (PACKING, "true"),
        ]))
        .expect("valid");
        assert_eq!(a.config.seq_length_spread, 0.75);
        assert!(a.config.packing);
        for (bad, says) in [("wide", "not a number"), ("1.5", "not in [0, 1]")] {
            let errs = parse(&annotations(&[
                (MODEL, "llama-3-8b"),
                (SEQ_LENGTH_SPREAD, bad),
            ]))
            .expect_err("invalid");
            assert_eq!(errs[0].key, "seq-length-spread", "{errs:?}");
            assert!(errs[0].message.contains(says), "{}", errs[0].message);
        }
    }

    #[test]
    fn collects_every_error_not_just_the_first() {
        let errs = parse(&annotations(&[
            (MODEL, "llama-3-8b"),
            (BATCH_SIZE, "many"),
            (OPTIMIZER, "adamx"),
            (SAFETY_RATIO, "1.5"),
            ("memguard.io/batchsize", "4"),
        ]))
        .expect_err("invalid");
        let mut keys: Vec<&str> = errs.iter().map(|e| e.key.as_str()).collect();
        assert!(errs[0].message.contains("did you mean `batch-size`"));
        keys.sort();
        assert_eq!(
            keys,
            ["batch-size", "batchsize", "optimizer", "safety-ratio"]
        );
    }

    #[test]
    fn shape_without_model_needs_the_core_keys() {
        let errs = parse(&annotations(&[(HIDDEN_SIZE, "4096")])).expect_err("bad");
        assert_eq!(errs.len(), 1);
        assert!(
            errs[0]
                .message
                .contains("num-layers, num-heads, vocab-size")
        );
    }

    #[test]
    fn heads_not_dividing_hidden_size_names_the_key() {
        let errs = parse(&annotations(&[
            (HIDDEN_SIZE, "1000"),
            (NUM_LAYERS, "4"),
            (NUM_HEADS, "3"),
            (VOCAB_SIZE, "32000"),
        ]))
        .expect_err("bad");
        assert_eq!(errs[0].key, "num-heads");
    }

    #[test]
    fn rejects_bad_env_map_entries() {
        for bad in [
            "batch=X",
            "batch-size",
            "batch-size=1X",
            "batch-size=MEMGUARD_X",
        ] {
            let errs =
                parse(&annotations(&[(MODEL, "llama-3-8b"), (ENV_MAP, bad)])).expect_err(bad);
            assert_eq!(errs[0].key, "env-map", "{bad}");
        }
    }

    #[test]
    fn unknown_model_is_an_error() {
        let errs = parse(&annotations(&[(MODEL, "gpt-9")])).expect_err("bad");
        assert_eq!(errs[0].key, "model");
    }

    #[test]
    fn output_keys_are_not_unknown() {
        assert!(
            parse(&annotations(&[
                (MODEL, "llama-3-8b"),
                (ESTIMATE, "{}"),
                (ERROR, "x"),
            ]))
            .is_ok()
        );
    }

    /// One boolean vocabulary: what the sidecar and the Python client accept, annotations
    /// accept (`grad-checkpointing: "yes"` was refused); counts are plain whole numbers.
    #[test]
    fn booleans_share_one_vocabulary_and_counts_are_whole_numbers() {
        for (value, want) in [
            ("yes", true),
            ("On", true),
            ("1", true),
            ("no", false),
            ("OFF", false),
            ("0", false),
        ] {
            let a = parse(&annotations(&[
                (MODEL, "gpt2"),
                (GRAD_CHECKPOINTING, value),
            ]))
            .expect(value);
            assert_eq!(a.config.grad_checkpointing, want, "{value}");
        }
        let errs = parse(&annotations(&[
            (MODEL, "gpt2"),
            (GRAD_CHECKPOINTING, "perhaps"),
        ]))
        .expect_err("invalid");
        assert!(errs[0].message.contains("yes|no"), "{errs:?}");
        for (key, bad) in [(BATCH_SIZE, "7B"), (BATCH_SIZE, "7e9"), (SEQ_LENGTH, "-1")] {
            let errs = parse(&annotations(&[(MODEL, "gpt2"), (key, bad)])).expect_err(bad);
            assert!(
                errs[0]
                    .message
                    .contains("is not a whole number of at least 1"),
                "{bad}: {errs:?}"
            );
        }
    }

    #[test]
    fn an_unknown_model_gets_a_did_you_mean() {
        let errs = parse(&annotations(&[(MODEL, "llama-3-8")])).expect_err("unknown");
        assert!(
            errs[0].message.contains("did you mean `llama-3-8b`?"),
            "{errs:?}"
        );
        let errs = parse(&annotations(&[(MODEL, "zzzzzzzzzzzzzz")])).expect_err("unknown");
        assert!(!errs[0].message.contains("did you mean"), "{errs:?}");
    }
}
