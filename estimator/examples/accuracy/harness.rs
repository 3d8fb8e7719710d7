//! Scores the estimator against the measured runs of `bench/accuracy/data/`: shared by the
//! `accuracy` example (which prints the table) and the `accuracy` integration test (which
//! asserts the targets).

use memguard_estimator::{
    Bytes, Component, Device, LoraTargets, Loss, Method, ModelShape, Optimizer, Parallelism,
    Precision, TrainingConfig, estimate,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The ground-truth files in `bench/accuracy/data/`: every row is part of the fit set.
pub const FILES: [&str; 2] = [
    "gpu-published-normalized.csv",
    "cpu-measured-normalized.csv",
];

/// Measurements collected for this repository (`bench/accuracy/collected/`), in the same
/// columns plus `split` (`fit` or `heldout`, fixed before the model was changed), `head_dim`
/// and `tie_embeddings`.
pub const COLLECTED: [&str; 2] = ["litgpt-confighub.csv", "peft-method-comparison.csv"];

/// The trainer choices (loss, compile, offloading, attention and LoRA dropout) of ground-truth rows,
/// read from their sources, in `bench/accuracy/collected/` (the ground truth is kept as
/// copied). Collected rows carry theirs as `[loss=chunked]`-style tags in their notes.
pub const TRAINER_CHOICES: &str = "trainer-choices.csv";

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
        ]
        .iter()
        .any(|v| !v.trim().is_empty())
    }

    fn apply(&self, cfg: &mut TrainingConfig) -> Result<(), String> {
        let flag = |v: &str| v.trim() == "true";
        if !self.loss.trim().is_empty() {
            cfg.loss = self.loss.parse::<Loss>().map_err(|e| e.to_string())?;
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
        Ok(())
    }

    /// Choices tagged in a collected row's notes: `[loss=chunked]`, `[compile]`, …
    fn from_notes(id: &str, notes: &str) -> Choices {
        let tag = |t: &str| notes.contains(&format!("[{t}]"));
        let loss = ["standard", "chunked", "fused"]
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

/// The result of one row.
#[derive(Debug, Clone)]
pub struct Scored {
    pub id: String,
    pub source: String,
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
    // A model fact with no column: Gemma 2's soft-capped attention scores.
    cfg.model.attention_softcapping = row.notes.contains("[attention-softcapping]");
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

/// Scores one row, with the trainer choices stated for it.
pub fn score(row: &Row, choices: Option<&Choices>) -> Result<Scored, String> {
    let mut cfg = config(row)?;
    let tagged = Choices::from_notes(&row.id, &row.notes);
    let choices = choices.unwrap_or(&tagged);
    choices.apply(&mut cfg)?;
    let est = estimate(&cfg).map_err(|errs| format!("{errs:?}"))?;
    let split = match row.split.trim() {
        "" | "fit" => Split::Fit,
        "heldout" => Split::HeldOut,
        other => return Err(format!("split: `{other}` is not fit or heldout")),
    };
    let oom = row.outcome.trim().eq_ignore_ascii_case("oom");
    let compare = match row.compare_to.trim() {
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
            out.push(score(&row, choices.get(&row.id)).map_err(|e| format!("{}: {e}", row.id))?);
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
