//! Scores the estimator against the measured runs of `bench/accuracy/data/`: shared by the
//! `accuracy` example (which prints the table) and the `accuracy` integration test (which
//! asserts the targets).

use memguard_estimator::{
    Bytes, Component, Device, Fitted, LoraTargets, Loss, Method, ModelShape, Norms, Optimizer,
    Parallelism, Precision, TrainingConfig, estimate_with,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The ground-truth files in `bench/accuracy/data/`: every row is part of the fit set.
pub const FILES: [&str; 4] = [
    "gpu-published-normalized.csv",
    "cpu-measured-normalized.csv",
    "gpu-published-set1-normalized.csv",
    "gpu-published-set2-normalized.csv",
];

/// Sets 1 and 2 (published measurements from sources the estimator had not seen when they
/// came, `data/gpu-published-set{1,2}-normalized.md`): fitting data now, scored apart too.
pub const NEW_SETS: [&str; 2] = [
    "gpu-published-set1-normalized.csv",
    "gpu-published-set2-normalized.csv",
];

/// Measurements collected for this repository (`bench/accuracy/collected/`), in the same
/// columns plus `split` (`fit` or `heldout`, fixed before the model was changed), `head_dim`
/// and `tie_embeddings`.
pub const COLLECTED: [&str; 5] = [
    "litgpt-confighub.csv",
    "peft-method-comparison.csv",
    "litgpt-resource-tables.csv",
    "torchtune-readme-2024.csv",
    "gpjt-fine-tune-2024.csv",
];

/// The trainer choices (loss, compile, offloading, attention and LoRA dropout) of ground-truth rows,
/// read from their sources, in `bench/accuracy/collected/` (the ground truth is kept as
/// copied). Collected rows carry theirs as `[loss=chunked]`-style tags in their notes.
pub const TRAINER_CHOICES: &str = "trainer-choices.csv";

/// `CUDA_FRAGMENTATION_PER_SPREAD` before any source measured it: half the per-step tensors
/// at spread 1 (a guess, kept as the prior of folds without varying batches).
pub const FRAGMENTATION_PRIOR: f64 = 0.5;

/// One row of `trainer-choices.csv`.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct Choices {
    pub id: String,
    #[serde(default)]
    pub loss: String,
    #[serde(default)]
    pub compile: String,
    #[serde(default)]
    pub activation_offload: String,
    #[serde(default)]
    pub optimizer_in_backward: String,
    #[serde(default)]
    pub optimizer_offload: String,
    #[serde(default)]
    pub attention_dropout: String,
    #[serde(default)]
    pub lora_dropout: String,
    #[serde(default)]
    pub quantized_head: String,
    #[serde(default)]
    pub quant_from_fp16: String,
    #[serde(default)]
    pub untied_head: String,
    /// The optimizer's implementation where the ground truth's column cannot say it
    /// (`adamw-8bit-torchao`).
    #[serde(default)]
    pub optimizer: String,
    /// The batches' length spread, `(longest − shortest) / longest`, where the source states
    /// the data's lengths but the row's notes carry no `[spread=…]`.
    #[serde(default)]
    pub spread: String,
    /// What the source says it measured, where the row's `compare_to` keeps the ground truth's
    /// coarser reading: `reserved` (`max_memory_reserved`, no CUDA context).
    #[serde(default)]
    pub measurement: String,
}

impl Choices {
    /// Whether any choice is stated: a row whose UNMODELLED techniques are all stated here is
    /// scored like any other.
    fn any(&self) -> bool {
        [
            &self.loss,
            &self.compile,
            &self.activation_offload,
            &self.optimizer_in_backward,
            &self.optimizer_offload,
            &self.optimizer,
        ]
        .iter()
        .any(|v| !v.trim().is_empty())
    }

    fn apply(&self, cfg: &mut TrainingConfig) -> Result<(), String> {
        let flag = |v: &str| v.trim() == "true";
        if !self.loss.trim().is_empty() {
            cfg.loss = self.loss.parse::<Loss>().map_err(|e| e.to_string())?;
        }
        if !self.optimizer.trim().is_empty() {
            cfg.optimizer = self
                .optimizer
                .parse::<Optimizer>()
                .map_err(|e| e.to_string())?;
        }
        cfg.compile |= flag(&self.compile);
        cfg.activation_offload |= flag(&self.activation_offload);
        cfg.optimizer_in_backward |= flag(&self.optimizer_in_backward);
        cfg.optimizer_offload |= flag(&self.optimizer_offload);
        cfg.model.attention_dropout |= flag(&self.attention_dropout);
        cfg.lora_dropout |= flag(&self.lora_dropout);
        cfg.quantized_head |= flag(&self.quantized_head);
        cfg.quant_from_fp16 |= flag(&self.quant_from_fp16);
        cfg.untied_head |= flag(&self.untied_head);
        if !self.spread.trim().is_empty() {
            cfg.seq_length_spread = self
                .spread
                .trim()
                .parse()
                .map_err(|e| format!("spread `{}`: {e}", self.spread))?;
        }
        Ok(())
    }

    /// Choices tagged in a collected row's notes: `[loss=chunked]`, `[compile]`, …
    fn from_notes(id: &str, notes: &str) -> Choices {
        let tag = |t: &str| notes.contains(&format!("[{t}]"));
        let loss = ["standard", "narrow", "narrow-released", "chunked", "fused"]
            .into_iter()
            .find(|l| notes.contains(&format!("[loss={l}]")))
            .unwrap_or("")
            .to_string();
        let yes = |on: bool| {
            if on {
                "true".to_string()
            } else {
                String::new()
            }
        };
        Choices {
            id: id.to_string(),
            loss,
            compile: yes(tag("compile")),
            activation_offload: yes(tag("activation-offload")),
            optimizer_in_backward: yes(tag("optimizer-in-backward")),
            optimizer_offload: yes(tag("optimizer-offload")),
            attention_dropout: yes(tag("attention-dropout")),
            lora_dropout: yes(tag("lora-dropout")),
            quantized_head: yes(tag("quantized-head")),
            quant_from_fp16: yes(tag("quant-from-fp16")),
            untied_head: yes(tag("untied-head")),
            optimizer: String::new(),
            spread: String::new(),
            measurement: String::new(),
        }
    }
}

/// Which part of the data a row belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Rows the model may be tuned on (the ground truth and the collected `fit` rows).
    Fit,
    /// Rows never looked at while changing the model.
    HeldOut,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Fit => "fit",
            Split::HeldOut => "held-out",
        }
    }
}

/// Rows whose notes carry this tag use a technique no config field expresses.
pub const UNMODELLED_TAG: &str = "UNMODELLED:";

/// The folder holding the ground-truth CSV files.
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/accuracy/data")
}

/// The folder holding the collected CSV files.
pub fn collected_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/accuracy/collected")
}

/// One row of a `*-normalized.csv` file, as written.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Row {
    pub id: String,
    #[serde(default)]
    pub source_group: String,
    pub model: String,
    pub params: String,
    pub hidden_size: u64,
    pub num_layers: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub intermediate_size: u64,
    pub vocab_size: u64,
    pub ffn_gated: bool,
    pub num_experts: String,
    pub experts_per_token: String,
    pub model_bits: String,
    pub precision: String,
    pub method: String,
    pub lora_rank: String,
    pub lora_targets: String,
    pub lora_layers: String,
    pub optimizer: String,
    pub batch_size: u64,
    pub grad_accumulation: String,
    pub seq_length: u64,
    pub grad_checkpointing: bool,
    pub flash_attention: bool,
    pub parallelism: String,
    pub world_size: String,
    pub device: String,
    pub device_memory_bytes: String,
    pub outcome: String,
    pub measured_bytes: String,
    pub compare_to: String,
    #[serde(default)]
    pub notes: String,
    /// Collected files only: explicit head width (Gemma).
    #[serde(default)]
    pub head_dim: String,
    /// Collected files only: `true` when input and output embeddings are one matrix.
    #[serde(default)]
    pub tie_embeddings: String,
    /// Collected files only: `fit` or `heldout`.
    #[serde(default)]
    pub split: String,
}

/// What the estimate of one row is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compare {
    /// `tensor_peak` vs a `max_memory_allocated`-type figure.
    TensorPeak,
    /// `tensor_peak` plus the allocator cache vs `max_memory_reserved` (no CUDA context).
    Reserved,
    /// `total` vs a device-level figure (NVML, cgroup peak, an unstated tool).
    Total,
}

impl Compare {
    /// The figure kind the upper bound is kept per.
    pub fn figure(self) -> memguard_estimator::bound::Figure {
        use memguard_estimator::bound::Figure;
        match self {
            Compare::TensorPeak => Figure::TensorPeak,
            Compare::Reserved => Figure::Reserved,
            Compare::Total => Figure::Device,
        }
    }
}

/// The result of one row.
#[derive(Debug, Clone)]
pub struct Scored {
    pub id: String,
    pub source: String,
    /// The file the row came from (`gpu-published-set1-normalized.csv`, …).
    pub file: String,
    pub split: Split,
    /// From `bench/accuracy/collected/` rather than the ground truth in `data/`.
    pub collected: bool,
    pub model: String,
    pub device: Device,
    pub compare: Compare,
    /// `None` for OOM fit tests.
    pub measured: Option<Bytes>,
    /// The output compared (tensor_peak or total).
    pub estimated: Bytes,
    /// For OOM rows: the device's memory.
    pub device_memory: Option<Bytes>,
    /// The row uses something no config field expresses.
    pub unmodelled: bool,
    /// The full estimate, for breakdowns.
    pub estimate: memguard_estimator::Estimate,
    /// The estimate's tensors, which no fitted constant touches.
    pub tensor_peak: Bytes,
    /// The per-step tensors the allocator's reserve is a fraction of.
    pub per_step: Bytes,
    /// The allocator's reserve that no fitted constant scales (ZeRO's step segment; the
    /// fragmentation term, whose constant is a prior).
    pub fixed_reserve: Bytes,
    /// The class of configuration the upper bound is kept per.
    pub class: memguard_estimator::bound::Class,
    /// The row's sequence-length spread (`[spread=…]`), which the fragmentation term needs.
    pub spread: f64,
    /// The spread that fragments the caching allocator: none when the batches are packed or
    /// the segments expandable.
    pub fragmenting_spread: f64,
}

impl Scored {
    /// `(estimate − measured) / measured`: negative is an under-estimate.
    pub fn signed_error(&self) -> Option<f64> {
        self.measured
            .map(|m| (self.estimated.as_f64() - m.as_f64()) / m.as_f64())
    }

    /// For OOM rows: whether the estimate exceeds the device's memory.
    pub fn oom_predicted(&self) -> Option<bool> {
        self.device_memory.map(|d| self.estimated > d)
    }

    /// The compared output under other values of the fitted constants: the tensors, plus the
    /// allocator's reserve for reserved and device-level figures, plus the runtime's fixed cost
    /// for device-level figures.
    pub fn estimated_with(&self, fitted: &Fitted) -> Bytes {
        let (context, fraction) = match self.device {
            Device::Cpu => (fitted.cpu_process_baseline, fitted.cpu_heap_fraction),
            _ => (fitted.cuda_context, fitted.cuda_cache_fraction),
        };
        let fraction = match self.device {
            Device::Cpu => fraction,
            _ => fraction + fitted.cuda_fragmentation_per_spread * self.fragmenting_spread,
        };
        let cache = self.fixed_reserve + Bytes::from_f64(self.per_step.as_f64() * fraction);
        match self.compare {
            Compare::TensorPeak => self.tensor_peak,
            Compare::Reserved => self.tensor_peak + cache,
            Compare::Total => self.tensor_peak + cache + context,
        }
    }

    /// Whether the row can inform the fitted constants: a measured reserved or device-level
    /// figure (the tensor peak carries neither the reserve nor the runtime).
    /// From sets 1 and 2: scored, and fitting the fragmentation, but not yet the steady
    /// constants nor the bound's residuals (docs/accuracy.md, "Sets 1 and 2").
    pub fn in_new_set(&self) -> bool {
        NEW_SETS.contains(&self.file.as_str())
    }

    fn informs_fit(&self) -> bool {
        self.measured.is_some() && !self.unmodelled && self.compare != Compare::TensorPeak
    }
}

fn opt_u64(s: &str) -> Result<Option<u64>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    s.parse::<f64>()
        .map(|v| Some(v.round() as u64))
        .map_err(|e| format!("`{s}`: {e}"))
}

fn targets(list: &str) -> Result<LoraTargets, String> {
    // `lm_head` adapters are tiny next to the base; the config has no field for them.
    let kept: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty() && *t != "lm_head")
        .collect();
    if kept.is_empty() {
        return Ok(LoraTargets::QV);
    }
    kept.join(",").parse().map_err(|e| format!("{e}"))
}

/// The training config a row describes.
pub fn config(row: &Row) -> Result<TrainingConfig, String> {
    let model = ModelShape {
        name: None,
        params: opt_u64(&row.params)?,
        hidden_size: row.hidden_size,
        num_layers: row.num_layers,
        num_heads: row.num_heads,
        num_kv_heads: row.num_kv_heads,
        intermediate_size: row.intermediate_size,
        vocab_size: row.vocab_size,
        ffn_gated: row.ffn_gated,
        num_experts: opt_u64(&row.num_experts)?.unwrap_or(1),
        experts_per_token: opt_u64(&row.experts_per_token)?.unwrap_or(1),
        tie_embeddings: row.tie_embeddings.trim() == "true",
        // Sequence classifiers (BERT here) have no vocabulary projection.
        lm_head: !row.model.contains("SequenceClassification"),
        head_dim: opt_u64(&row.head_dim)?,
        ..ModelShape::default()
    };
    let mut cfg = TrainingConfig::new(model);
    cfg.model_bits = opt_u64(&row.model_bits)?.map(|b| b as u32);
    cfg.precision = row
        .precision
        .parse::<Precision>()
        .map_err(|e| e.to_string())?;
    cfg.method = row.method.parse::<Method>().map_err(|e| e.to_string())?;
    if let Some(r) = opt_u64(&row.lora_rank)? {
        cfg.lora_rank = r;
    }
    cfg.lora_targets = targets(&row.lora_targets)?;
    cfg.lora_layers = opt_u64(&row.lora_layers)?;
    cfg.double_quant = row.notes.contains("[double-quant]");
    // Batch shapes (bench/gpu/measure.py's rows): `[spread=0.75]`, `[packing]`,
    // `[expandable-segments]`.
    if let Some(rest) = row.notes.split("[spread=").nth(1) {
        let value = rest.split(']').next().unwrap_or_default();
        cfg.seq_length_spread = value
            .trim()
            .parse()
            .map_err(|e| format!("[spread={value}]: {e}"))?;
    }
    cfg.packing = row.notes.contains("[packing]");
    cfg.expandable_segments = row.notes.contains("[expandable-segments]");
    // A model fact with no column: Gemma 2's soft-capped attention scores.
    cfg.model.attention_softcapping = row.notes.contains("[attention-softcapping]");
    cfg.model.norms = norms_of_family(&row.model);
    cfg.optimizer = row
        .optimizer
        .parse::<Optimizer>()
        .map_err(|e| e.to_string())?;
    cfg.batch_size = row.batch_size;
    cfg.grad_accumulation = opt_u64(&row.grad_accumulation)?.unwrap_or(1);
    cfg.seq_length = row.seq_length;
    cfg.grad_checkpointing = row.grad_checkpointing;
    cfg.flash_attention = row.flash_attention;
    cfg.parallelism = if row.parallelism.trim().is_empty() {
        Parallelism::None
    } else {
        row.parallelism
            .parse()
            .map_err(|e: memguard_estimator::ConfigError| e.to_string())?
    };
    cfg.world_size = opt_u64(&row.world_size)?.unwrap_or(1);
    cfg.device = row.device.parse::<Device>().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// The block norms of a model family (no column says them), from each family's code as the
/// rows' trainers ran it: LitGPT's `config.py` (`norm_class_name`, `parallel_residual`,
/// `shared_attention_norm`) and transformers' modelling files. Families not named here are
/// RMSNorm decoders (Llama, Mistral, Qwen, Yi, Baichuan 2, Gemma, Phi-3).
pub fn norms_of_family(model: &str) -> Norms {
    let m = model.to_ascii_lowercase();
    let any = |keys: &[&str]| keys.iter().any(|k| m.contains(k));
    if any(&["phi-1", "phi-2", "falcon-7b"]) {
        // phi-1.5/phi-2 and Falcon 7B: parallel attention and MLP behind one `norm_1`
        // (`shared_attention_norm=True`; transformers' `PhiDecoderLayer.input_layernorm`).
        Norms::SharedLayerNorm
    } else if any(&[
        "stablelm-base-alpha",
        "stablelm base alpha",
        "falcon-40b",
        "pythia",
    ]) {
        // GPT-NeoX-style parallel residual with two LayerNorms on the block input
        // (`parallel_residual=True, shared_attention_norm=False`; Falcon 40B's
        // `new_decoder_architecture` `ln_attn`/`ln_mlp`).
        Norms::ParallelLayerNorm
    } else if any(&[
        "gpt_bigcode",
        "santacoder",
        "gpt-2",
        "gpt2",
        "bloom",
        "bert",
    ]) {
        // `ln_1`/`ln_2` (GPT-2, GPT-BigCode), BLOOM's `input_layernorm` and
        // `post_attention_layernorm`, BERT's post-norms: LayerNorm in sequence.
        Norms::LayerNorm
    } else {
        Norms::RmsNorm
    }
}

/// Scores one row, with the trainer choices stated for it.
pub fn score(row: &Row, choices: Option<&Choices>) -> Result<Scored, String> {
    let mut cfg = config(row)?;
    let tagged = Choices::from_notes(&row.id, &row.notes);
    let choices = choices.unwrap_or(&tagged);
    choices.apply(&mut cfg)?;
    let est = estimate_with(&cfg, &Fitted::SHIPPED).map_err(|errs| format!("{errs:?}"))?;
    // The reserve is `fixed + fraction · per_step`: with a fraction of 0 it is the part no
    // fitted constant scales (ZeRO's step segment, fragmentation), with 1 that plus the
    // per-step tensors.
    let cache_at = |fraction: f64| -> Result<Bytes, String> {
        let fitted = Fitted {
            cuda_cache_fraction: fraction,
            cpu_heap_fraction: fraction,
            cuda_fragmentation_per_spread: 0.0,
            ..Fitted::SHIPPED
        };
        Ok(estimate_with(&cfg, &fitted)
            .map_err(|errs| format!("{errs:?}"))?
            .component(Component::AllocatorCache))
    };
    let fixed_reserve = cache_at(0.0)?;
    let per_step = Bytes(cache_at(1.0)?.0.saturating_sub(fixed_reserve.0));
    let split = match row.split.trim() {
        "" | "fit" => Split::Fit,
        "heldout" => Split::HeldOut,
        other => return Err(format!("split: `{other}` is not fit or heldout")),
    };
    let oom = row.outcome.trim().eq_ignore_ascii_case("oom");
    let stated = match choices.measurement.trim() {
        "" => row.compare_to.trim(),
        m => m,
    };
    let compare = match stated {
        "tensor_peak" if !oom => Compare::TensorPeak,
        "reserved" if !oom => Compare::Reserved,
        _ => Compare::Total,
    };
    let estimated = match compare {
        Compare::TensorPeak => est.tensor_peak,
        // `max_memory_reserved`: the caching allocator's blocks, without the CUDA context.
        Compare::Reserved => est.tensor_peak + est.component(Component::AllocatorCache),
        Compare::Total => est.total,
    };
    Ok(Scored {
        id: row.id.clone(),
        source: row.source_group.clone(),
        file: String::new(),
        split,
        collected: !row.split.trim().is_empty(),
        model: row.model.clone(),
        device: cfg.device,
        compare,
        measured: if oom {
            None
        } else {
            opt_u64(&row.measured_bytes)?.map(Bytes)
        },
        estimated,
        device_memory: if oom {
            opt_u64(&row.device_memory_bytes)?.map(Bytes)
        } else {
            None
        },
        unmodelled: row.notes.contains(UNMODELLED_TAG) && !choices.any(),
        tensor_peak: est.tensor_peak,
        per_step,
        fixed_reserve,
        class: memguard_estimator::bound::Class::of(&cfg, compare.figure()),
        spread: cfg.seq_length_spread,
        fragmenting_spread: if cfg.packing || cfg.expandable_segments {
            0.0
        } else {
            cfg.seq_length_spread
        },
        estimate: est,
    })
}

/// Every row of every file (ground truth, then collected), scored.
pub fn score_all() -> Result<Vec<Scored>, String> {
    let mut out = Vec::new();
    let path = collected_dir().join(TRAINER_CHOICES);
    let mut reader =
        csv::Reader::from_path(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut choices = BTreeMap::new();
    for c in reader.deserialize::<Choices>() {
        let c = c.map_err(|e| format!("{}: {e}", path.display()))?;
        choices.insert(c.id.clone(), c);
    }
    let files = FILES
        .iter()
        .map(|f| data_dir().join(f))
        .chain(COLLECTED.iter().map(|f| collected_dir().join(f)));
    for path in files {
        let mut reader =
            csv::Reader::from_path(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        for row in reader.deserialize::<Row>() {
            let row = row.map_err(|e| format!("{}: {e}", path.display()))?;
            let mut scored =
                score(&row, choices.get(&row.id)).map_err(|e| format!("{}: {e}", row.id))?;
            scored.file = path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.push(scored);
        }
    }
    Ok(out)
}

/// The figures of one device kind over the rows that count (measured, not UNMODELLED).
#[derive(Debug, Clone)]
pub struct Summary {
    pub device: Device,
    pub rows: usize,
    pub median_ape: f64,
    /// Most negative signed error, with its row id.
    pub worst_under: Option<(f64, String)>,
    /// Most positive signed error, with its row id.
    pub worst_over: Option<(f64, String)>,
    /// OOM fit tests: (passed, total).
    pub oom: (usize, usize),
    /// Rows within ±10 %.
    pub within_ten: usize,
}

/// Summarises the scored rows of `device`, leaving out UNMODELLED rows.
pub fn summarize(scored: &[Scored], device: Device) -> Summary {
    summarize_where(scored, device, |_| true)
}

/// Summarises the scored rows of `device` that `keep` selects, leaving out UNMODELLED rows.
pub fn summarize_where(
    scored: &[Scored],
    device: Device,
    keep: impl Fn(&Scored) -> bool,
) -> Summary {
    let counted: Vec<&Scored> = scored
        .iter()
        .filter(|s| s.device == device && !s.unmodelled && keep(s))
        .collect();
    let mut errors: Vec<(f64, String)> = counted
        .iter()
        .filter_map(|s| s.signed_error().map(|e| (e, s.id.clone())))
        .collect();
    let mut apes: Vec<f64> = errors.iter().map(|(e, _)| e.abs()).collect();
    apes.sort_by(f64::total_cmp);
    let median_ape = match apes.len() {
        0 => 0.0,
        n if n % 2 == 1 => apes[n / 2],
        n => (apes[n / 2 - 1] + apes[n / 2]) / 2.0,
    };
    errors.sort_by(|a, b| a.0.total_cmp(&b.0));
    let ooms: Vec<bool> = counted.iter().filter_map(|s| s.oom_predicted()).collect();
    Summary {
        device,
        rows: apes.len(),
        median_ape,
        worst_under: errors.first().filter(|(e, _)| *e < 0.0).cloned(),
        worst_over: errors.last().filter(|(e, _)| *e > 0.0).cloned(),
        oom: (ooms.iter().filter(|p| **p).count(), ooms.len()),
        within_ten: apes.iter().filter(|a| **a <= 0.10).count(),
    }
}

// ---- Leave-one-source-out cross-validation ------------------------------------------------

/// An under-estimate costs this many times an over-estimate of the same size in the fit (an
/// under-estimate is an OOM): the fit aims at the 75th percentile of measured / estimate.
pub const UNDER_WEIGHT: f64 = 3.0;

/// The CPU runtime's fixed cost when no CPU source is in the fit: the unfitted runtime figure
/// the estimator uses where no data exist (`METAL_RUNTIME`: Python and a framework).
pub const CPU_BASELINE_PRIOR: Bytes = memguard_estimator::estimate::constants::METAL_RUNTIME;

fn fit_loss(rows: &[&Scored], fitted: &Fitted) -> f64 {
    rows.iter()
        .filter_map(|r| {
            let m = r.measured?.as_f64();
            let e = (r.estimated_with(fitted).as_f64() - m) / m;
            Some(if e < 0.0 { -e * UNDER_WEIGHT } else { e })
        })
        .sum()
}

/// Fits the constants on `rows` (those with a reserved or device-level figure count): a grid
/// search of the context (0–3 GiB by 32 MiB) and the reserve fraction (0–0.8 by 0.01) per device
/// family, minimising the asymmetric loss. A family with no row keeps its prior: the CUDA
/// family's the shipped values, the CPU family's [`CPU_BASELINE_PRIOR`] and the CUDA fraction
/// just fitted (the analogous allocator reserve).
pub fn fit(rows: &[&Scored]) -> Fitted {
    // A fold with no varying batches must not inherit the shipped fragmentation (fitted on
    // every source): it keeps the prior the estimator had before any source measured it.
    let mut fitted = Fitted {
        cuda_fragmentation_per_spread: FRAGMENTATION_PRIOR,
        ..Fitted::SHIPPED
    };
    let informing = |cpu: bool| -> Vec<&Scored> {
        rows.iter()
            .copied()
            .filter(|r| r.informs_fit() && (r.device == Device::Cpu) == cpu)
            .collect()
    };
    let grid = |rows: &[&Scored], set: &dyn Fn(&mut Fitted, Bytes, f64), base: Fitted| {
        let mut best = (f64::INFINITY, base);
        for c in 0..=96u64 {
            for f in 0..=80u32 {
                let mut cand = base;
                set(&mut cand, Bytes::mib(32 * c), f64::from(f) / 100.0);
                let loss = fit_loss(rows, &cand);
                if loss < best.0 {
                    best = (loss, cand);
                }
            }
        }
        best.1
    };
    let cuda = informing(false);
    // The context and the steady reserve from batches of one shape; the fragmentation from
    // those whose lengths vary, on top (a fold with none keeps the prior).
    let (varying, steady): (Vec<&Scored>, Vec<&Scored>) =
        cuda.iter().partition(|r| r.fragmenting_spread > 0.0);
    let steady: Vec<&Scored> = steady.into_iter().filter(|r| !r.in_new_set()).collect();
    if !steady.is_empty() {
        fitted = grid(
            &steady,
            &|f, c, x| {
                f.cuda_context = c;
                f.cuda_cache_fraction = x;
            },
            fitted,
        );
    }
    if !varying.is_empty() {
        fitted = fit_fragmentation(&varying, fitted);
    }
    let cpu = informing(true);
    if cpu.is_empty() {
        fitted.cpu_process_baseline = CPU_BASELINE_PRIOR;
        fitted.cpu_heap_fraction = fitted.cuda_cache_fraction;
    } else {
        fitted = grid(
            &cpu,
            &|f, c, x| {
                f.cpu_process_baseline = c;
                f.cpu_heap_fraction = x;
            },
            fitted,
        );
    }
    fitted
}

/// `base` with the fragmentation (0–2 by 0.02) that minimises the asymmetric loss over
/// `varying`, rows whose batches vary in length.
pub fn fit_fragmentation(varying: &[&Scored], base: Fitted) -> Fitted {
    let mut best = (f64::INFINITY, base);
    for k in 0..=100u32 {
        let mut cand = base;
        cand.cuda_fragmentation_per_spread = f64::from(k) / 50.0;
        let loss = fit_loss(varying, &cand);
        if loss < best.0 {
            best = (loss, cand);
        }
    }
    best.1
}

/// The rows of `rows` that fit the fragmentation: a reserved or device-level CUDA figure of
/// batches whose lengths vary.
pub fn varying(rows: &[Scored]) -> Vec<&Scored> {
    rows.iter()
        .filter(|r| r.informs_fit() && r.device != Device::Cpu && r.fragmenting_spread > 0.0)
        .collect()
}

/// The source groups, in order of first appearance.
pub fn sources(rows: &[Scored]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in rows {
        if !out.contains(&r.source) {
            out.push(r.source.clone());
        }
    }
    out
}

/// One fold: the constants refitted without `source`.
pub fn fold(rows: &[Scored], source: &str) -> Fitted {
    let train: Vec<&Scored> = rows.iter().filter(|r| r.source != source).collect();
    fit(&train)
}

/// Every row estimated with the constants fitted without its own source.
pub fn cross_validate(rows: &[Scored]) -> Vec<Scored> {
    let mut out = rows.to_vec();
    for source in sources(rows) {
        let fitted = fold(rows, &source);
        for r in out.iter_mut().filter(|r| r.source == source) {
            r.estimated = r.estimated_with(&fitted);
        }
    }
    out
}

/// Which sources each fitted constant rests on (rows that inform it, by source).
pub fn support(rows: &[Scored]) -> Vec<(&'static str, Vec<String>)> {
    let by = |keep: &dyn Fn(&Scored) -> bool| -> Vec<String> {
        let mut s: Vec<String> = rows
            .iter()
            .filter(|r| r.informs_fit() && keep(r))
            .map(|r| r.source.clone())
            .collect();
        s.sort();
        s.dedup();
        s
    };
    vec![
        (
            "CUDA_CONTEXT",
            by(&|r| {
                r.device != Device::Cpu
                    && r.compare == Compare::Total
                    && r.fragmenting_spread == 0.0
                    && !r.in_new_set()
            }),
        ),
        (
            "CUDA_CACHE_FRACTION",
            by(&|r| r.device != Device::Cpu && r.fragmenting_spread == 0.0 && !r.in_new_set()),
        ),
        (
            "CPU_PROCESS_BASELINE",
            by(&|r| r.device == Device::Cpu && r.compare == Compare::Total),
        ),
        ("CPU_HEAP_FRACTION", by(&|r| r.device == Device::Cpu)),
        (
            "CUDA_FRAGMENTATION_PER_SPREAD",
            by(&|r| r.device != Device::Cpu && r.fragmenting_spread > 0.0),
        ),
    ]
}

/// Cross-validated figures of a set of rows (measured, not UNMODELLED).
#[derive(Debug, Clone)]
pub struct CvSummary {
    pub rows: usize,
    pub median_ape: f64,
    /// Rows under −10 %.
    pub under_ten: usize,
    /// OOM rows predicted not to fit, of all OOM rows.
    pub oom: (usize, usize),
}

/// The cross-validated figures of the rows `keep` selects, over every device kind.
pub fn cv_summary(cv: &[Scored], keep: impl Fn(&Scored) -> bool) -> CvSummary {
    let kept: Vec<&Scored> = cv.iter().filter(|r| !r.unmodelled && keep(r)).collect();
    let errors: Vec<f64> = kept.iter().filter_map(|r| r.signed_error()).collect();
    let mut apes: Vec<f64> = errors.iter().map(|e| e.abs()).collect();
    apes.sort_by(f64::total_cmp);
    let ooms: Vec<bool> = kept.iter().filter_map(|r| r.oom_predicted()).collect();
    CvSummary {
        rows: apes.len(),
        median_ape: median(&apes),
        under_ten: errors.iter().filter(|e| **e < -0.10).count(),
        oom: (ooms.iter().filter(|p| **p).count(), ooms.len()),
    }
}

fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The residual of every measured row: class, source, measured / cross-validated estimate.
/// (The source name is leaked once per distinct source: the residuals table holds them for
/// the life of the program.)
pub fn residuals(cv: &[Scored]) -> Vec<memguard_estimator::bound::Residual> {
    let mut names: BTreeMap<String, &'static str> = BTreeMap::new();
    cv.iter()
        .filter(|r| !r.unmodelled && !r.in_new_set())
        .filter_map(|r| {
            let source = *names
                .entry(r.source.clone())
                .or_insert_with(|| Box::leak(r.source.clone().into_boxed_str()));
            Some(memguard_estimator::bound::Residual {
                class: r.class,
                source,
                ratio: r.measured?.as_f64() / r.estimated.as_f64(),
            })
        })
        .collect()
}

/// The bound's coverage, itself cross-validated: each source's rows are bounded with the
/// factors of the other sources' residuals. (covered, rows, median bound / measured).
pub fn bound_coverage(cv: &[Scored], level: f64) -> (usize, usize, f64) {
    bound_coverage_where(cv, level, |r| !r.in_new_set())
}

/// [`bound_coverage`] over the rows `keep` selects (the residuals are always the other
/// sources' rows that the bound is made of).
pub fn bound_coverage_where(
    cv: &[Scored],
    level: f64,
    keep: impl Fn(&Scored) -> bool,
) -> (usize, usize, f64) {
    let mut covered = 0;
    let mut widths = Vec::new();
    for source in sources(cv) {
        let others: Vec<Scored> = cv.iter().filter(|r| r.source != source).cloned().collect();
        let res = residuals(&others);
        for r in cv
            .iter()
            .filter(|r| r.source == source && !r.unmodelled && keep(r))
        {
            let Some(m) = r.measured else { continue };
            let factor = memguard_estimator::bound::upper_factor_from(&res, &r.class, level);
            let upper = r.estimated.as_f64() * factor;
            covered += usize::from(upper >= m.as_f64());
            widths.push(upper / m.as_f64());
        }
    }
    widths.sort_by(f64::total_cmp);
    (covered, widths.len(), median(&widths))
}

/// `estimator/src/bound/residuals.rs` for these residuals.
pub fn residuals_source(res: &[memguard_estimator::bound::Residual]) -> String {
    use memguard_estimator::bound::Figure;
    let mut out = String::from(
        "//! Generated by `bench/accuracy/run.sh --write-residuals`: measured / cross-validated\n\
         //! estimate of every measured run, by class. `estimator/tests/accuracy.rs` fails when it is\n\
         //! not what the cross-validation gives. (`cargo fmt` lays it out.)\n\n\
         // Ratios near 1.047 are not π/3.\n\
         #![allow(clippy::approx_constant)]\n\n\
         use super::{Class, Figure, Residual};\n\n\
         /// Every measured run: class, source, measured / cross-validated estimate.\n\
         pub static RESIDUALS: &[Residual] = &[\n",
    );
    for r in res {
        let c = r.class;
        let fig = match c.figure {
            Figure::TensorPeak => "Figure::TensorPeak",
            Figure::Reserved => "Figure::Reserved",
            Figure::Device => "Figure::Device",
        };
        out.push_str(&format!(
            "    r(c({}, {}, {}, {}, {fig}), \"{}\", {:.4}),\n",
            c.full, c.quantized, c.parallel, c.cpu, r.source, r.ratio
        ));
    }
    out.push_str(
        "];\n\n\
         const fn c(full: bool, quantized: bool, parallel: bool, cpu: bool, figure: Figure) -> Class {\n    \
         Class {\n        full,\n        quantized,\n        parallel,\n        cpu,\n        figure,\n    }\n}\n\n\
         const fn r(class: Class, source: &'static str, ratio: f64) -> Residual {\n    \
         Residual {\n        class,\n        source,\n        ratio,\n    }\n}\n",
    );
    out
}

/// The rows the cross-validated bound at `level` does not cover: (id, class, measured / bound).
pub fn bound_misses(cv: &[Scored], level: f64) -> Vec<(String, String, f64)> {
    let mut out = Vec::new();
    for source in sources(cv) {
        let others: Vec<Scored> = cv.iter().filter(|r| r.source != source).cloned().collect();
        let res = residuals(&others);
        for r in cv.iter().filter(|r| r.source == source && !r.unmodelled) {
            let Some(m) = r.measured else { continue };
            let factor = memguard_estimator::bound::upper_factor_from(&res, &r.class, level);
            let upper = r.estimated.as_f64() * factor;
            if upper < m.as_f64() {
                out.push((r.id.clone(), r.class.name(), m.as_f64() / upper));
            }
        }
    }
    out
}

/// `docs/accuracy.md`, which holds the committed cross-validated figures.
pub fn docs_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/accuracy.md")
}

/// The committed cross-validated median |error| per source, in percent: the rows of the table
/// between `<!-- cv-baseline -->` and `<!-- /cv-baseline -->` in `docs/accuracy.md`
/// (`| source | rows | median % | …`).
pub fn committed_medians() -> Result<BTreeMap<String, f64>, String> {
    let text = std::fs::read_to_string(docs_path()).map_err(|e| e.to_string())?;
    let start = text
        .find("<!-- cv-baseline -->")
        .ok_or("no <!-- cv-baseline --> marker")?;
    let end = text
        .find("<!-- /cv-baseline -->")
        .ok_or("no <!-- /cv-baseline --> marker")?;
    let mut out = BTreeMap::new();
    for line in text[start..end].lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "", source, rows, median, …
        if cells.len() < 4 || !cells[1].contains('-') || cells[1].starts_with("--") {
            continue;
        }
        let median = cells[3]
            .trim_end_matches('%')
            .trim()
            .parse::<f64>()
            .map_err(|e| format!("{line}: {e}"))?;
        out.insert(cells[1].trim_matches('`').to_string(), median);
    }
    Ok(out)
}
