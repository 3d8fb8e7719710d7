//! The trainer's reported config (`Report.config`, the knobs of
//! [`memguard_api::signal::TRAINER_CONFIG_KNOBS`]) as the estimator's training config: one
//! mapping for the sidecar's plan at train start and for admission's plan on a past run's report
//! (issue 37). Pure.
//!
//! A value the estimate depends on that the trainer did not report is unknown: no config, and
//! the error names each missing or impossible value.

use memguard_api::signal::{LORA_TARGET_BITS, OPTIMIZER_CODES};
use memguard_estimator::estimate::trainable_params;
use memguard_estimator::{
    Device, LoraTargets, Loss, Method, ModelShape, Optimizer, Parallelism, Precision,
    TrainingConfig,
};
use std::collections::BTreeMap;
use std::str::FromStr;

/// The knobs every estimate needs: without any of them there is no plan.
pub const REQUIRED: [&str; 23] = [
    "batch-size",
    "grad-accumulation",
    "seq-length",
    "grad-checkpointing",
    "world-size",
    "params",
    "trainable-params",
    "hidden-size",
    "num-layers",
    "num-heads",
    "num-kv-heads",
    "head-dim",
    "intermediate-size",
    "vocab-size",
    "num-experts",
    "tie-embeddings",
    "gated-ffn",
    "param-bits",
    "quant-bits",
    "optimizer",
    "fused-loss",
    "flash-attention",
    "gpu",
];

/// The reported knobs as the estimator's training config, or why not (each missing or
/// impossible value named).
pub fn training_config(knobs: &BTreeMap<String, f64>) -> Result<TrainingConfig, String> {
    let missing: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|k| !knobs.contains_key(*k))
        .collect();
    if !missing.is_empty() {
        return Err(format!("not reported: {}", missing.join(", ")));
    }
    let whole = |k: &str| -> Result<u64, String> {
        let v = knobs[k];
        if v.fract() != 0.0 || !(0.0..9.0e15).contains(&v) {
            return Err(format!("{k} is {v}, not a whole number"));
        }
        Ok(v as u64)
    };
    let flag = |k: &str| -> Result<bool, String> {
        match whole(k)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(format!("{k} is {v}, not 0 or 1")),
        }
    };
    let optional_flag = |k: &str| knobs.contains_key(k).then(|| flag(k)).transpose();
    let experts = whole("num-experts")?;
    if experts > 1 {
        return Err(format!(
            "a mixture of {experts} experts: its routing is not reported"
        ));
    }
    let params = whole("params")?;
    let trainable = whole("trainable-params")?;
    let quant_bits = whole("quant-bits")?;
    let lora = trainable < params;
    if lora && !(knobs.contains_key("lora-rank") && knobs.contains_key("lora-targets")) {
        // Which part a script froze, or an adapter the client could not read, is not reported.
        return Err(format!(
            "{trainable} of {params} parameters trainable and no LoRA rank and targets \
             reported: adapters and partly frozen models are not planned at train start"
        ));
    }
    if quant_bits != 0 {
        return Err(if lora {
            format!("LoRA on a {quant_bits}-bit base is not planned at train start")
        } else {
            format!("a {quant_bits}-bit base trained in full is not planned at train start")
        });
    }
    let model = ModelShape {
        params: Some(params),
        hidden_size: whole("hidden-size")?,
        num_layers: whole("num-layers")?,
        num_heads: whole("num-heads")?,
        num_kv_heads: whole("num-kv-heads")?,
        head_dim: Some(whole("head-dim")?),
        intermediate_size: whole("intermediate-size")?,
        vocab_size: whole("vocab-size")?,
        tie_embeddings: flag("tie-embeddings")?,
        ffn_gated: flag("gated-ffn")?,
        ..ModelShape::default()
    };
    let mut cfg = TrainingConfig::new(model);
    let optimizer_code = whole("optimizer")?;
    let name = usize::try_from(optimizer_code)
        .ok()
        .and_then(|i| OPTIMIZER_CODES.get(i))
        .ok_or_else(|| {
            format!("optimizer code {optimizer_code} is not one of {OPTIMIZER_CODES:?}")
        })?;
    cfg.optimizer = Optimizer::from_str(name).map_err(|e| e.to_string())?;
    let (bf16, fp16) = (optional_flag("bf16")?, optional_flag("fp16")?);
    cfg.precision = match (whole("param-bits")?, bf16, fp16) {
        (32, Some(true), _) => Precision::Bf16Mixed,
        (32, _, Some(true)) => Precision::Fp16Mixed,
        (32, Some(false), Some(false)) => Precision::Fp32,
        (16, _, Some(true)) => Precision::Fp16,
        (16, _, _) => Precision::Bf16,
        (32, _, _) => return Err("mixed precision (bf16, fp16) not reported".into()),
        (bits, _, _) => return Err(format!("param-bits is {bits}, not 16 or 32")),
    };
    cfg.method = Method::Full;
    if lora {
        cfg.method = Method::Lora;
        cfg.lora_rank = whole("lora-rank")?;
        cfg.lora_targets = lora_targets(whole("lora-targets")?)?;
        cfg.lora_dropout = if knobs.contains_key("lora-dropout") {
            flag("lora-dropout")?
        } else {
            return Err("not reported: lora-dropout".into());
        };
        // The adapter the estimate sizes must be the one that trains: a rank that varies by
        // layer, a subset of layers, biases or whole modules trained beside it are not reported.
        let sized = trainable_params(&cfg, params as f64);
        if (sized - trainable as f64).abs() > 0.01 * trainable as f64 {
            return Err(format!(
                "{trainable} parameters trainable, not the {sized:.0} of a rank-{} LoRA on {}: \
                 other trainable modules, per-layer ranks or a subset of layers are not planned \
                 at train start",
                cfg.lora_rank,
                cfg.lora_targets.to_list()
            ));
        }
    }
    cfg.loss = if flag("fused-loss")? {
        Loss::Fused
    } else {
        Loss::Standard
    };
    cfg.flash_attention = flag("flash-attention")?;
    cfg.device = if flag("gpu")? {
        Device::Cuda
    } else {
        Device::Cpu
    };
    cfg.batch_size = whole("batch-size")?.max(1);
    cfg.grad_accumulation = whole("grad-accumulation")?.max(1);
    cfg.seq_length = whole("seq-length")?;
    cfg.grad_checkpointing = flag("grad-checkpointing")?;
    cfg.world_size = whole("world-size")?.max(1);
    let stage = if knobs.contains_key("deepspeed-stage") {
        whole("deepspeed-stage")?
    } else {
        0
    };
    cfg.parallelism = match (optional_flag("fsdp")?.unwrap_or(false), stage) {
        (true, _) => Parallelism::Fsdp,
        (false, 1) => Parallelism::Zero1,
        (false, 2) => Parallelism::Zero2,
        (false, 3) => Parallelism::Zero3,
        (false, 0) if cfg.world_size > 1 => Parallelism::Ddp,
        (false, 0) => Parallelism::None,
        (false, s) => return Err(format!("deepspeed-stage is {s}, not 0 to 3")),
    };
    cfg.validate().map_err(|errs| {
        errs.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    })?;
    Ok(cfg)
}

/// `lora-targets` ([`LORA_TARGET_BITS`]) as the estimator's targets.
fn lora_targets(bits: u64) -> Result<LoraTargets, String> {
    let all = (1u64 << LORA_TARGET_BITS.len()) - 1;
    if bits == 0 || bits & !all != 0 {
        return Err(format!(
            "lora-targets is {bits}: not a set of {LORA_TARGET_BITS:?} (bit i for the i-th)"
        ));
    }
    let on = |name: &str| {
        LORA_TARGET_BITS
            .iter()
            .position(|n| *n == name)
            .is_some_and(|i| bits & (1 << i) != 0)
    };
    Ok(LoraTargets {
        q: on("q"),
        k: on("k"),
        v: on("v"),
        o: on("o"),
        gate: on("gate"),
        up: on("up"),
        down: on("down"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::tiny_llama_report as tiny_llama;

    /// The tiny Llama with a rank-8 LoRA on q and v: 2 layers × 8·(64 + 64) × 2 trainable.
    fn tiny_lora() -> BTreeMap<String, f64> {
        let mut knobs = tiny_llama();
        for (k, v) in [
            ("trainable-params", 4096.0),
            ("lora-rank", 8.0),
            ("lora-targets", 1.0 + 4.0),
            ("lora-dropout", 1.0),
        ] {
            knobs.insert(k.into(), v);
        }
        knobs
    }

    #[test]
    fn a_reported_lora_is_planned_as_the_lora_that_trains() {
        let cfg = training_config(&tiny_lora()).expect("a LoRA config");
        assert_eq!(cfg.method, Method::Lora);
        assert_eq!(cfg.lora_rank, 8);
        assert_eq!(cfg.lora_targets, LoraTargets::QV);
        assert!(cfg.lora_dropout);
        assert_eq!(trainable_params(&cfg, 4_300_000.0), 4096.0);
        let all = lora_targets(127).expect("all seven");
        assert_eq!(all, LoraTargets::ALL_LINEAR);
    }

    #[test]
    fn a_lora_that_is_not_what_trains_or_not_read_whole_is_not_planned() {
        let says = |knobs: &BTreeMap<String, f64>| training_config(knobs).expect_err("no plan");
        // More trainable than the LoRA: modules_to_save, biases, per-layer ranks.
        let mut more = tiny_lora();
        more.insert("trainable-params".into(), 4096.0 + 64.0 * 32_000.0);
        assert!(
            says(&more).contains("not the 4096 of a rank-8 LoRA on q,v"),
            "{}",
            says(&more)
        );
        // Targets the client could not name (not reported), or impossible ones.
        let mut unnamed = tiny_lora();
        unnamed.remove("lora-targets");
        assert!(says(&unnamed).contains("no LoRA rank and targets reported"));
        for bad in [0.0, 128.0, 2.5] {
            let mut knobs = tiny_lora();
            knobs.insert("lora-targets".into(), bad);
            assert!(
                says(&knobs).contains("lora-targets"),
                "{bad}: {}",
                says(&knobs)
            );
        }
        let mut no_dropout = tiny_lora();
        no_dropout.remove("lora-dropout");
        assert_eq!(says(&no_dropout), "not reported: lora-dropout");
        // A quantized base under LoRA (QLoRA) is not planned at train start yet.
        let mut qlora = tiny_lora();
        qlora.insert("quant-bits".into(), 4.0);
        assert!(
            says(&qlora).contains("LoRA on a 4-bit base"),
            "{}",
            says(&qlora)
        );
    }

    #[test]
    fn the_reported_knobs_map_onto_the_estimators_config() {
        let cfg = training_config(&tiny_llama()).expect("a config");
        assert_eq!(cfg.model.hidden_size, 64);
        assert_eq!(cfg.model.num_layers, 2);
        assert_eq!(cfg.model.head_dim, Some(16));
        assert_eq!(cfg.model.vocab_size, 32_000);
        assert_eq!(cfg.model.params, Some(4_300_000));
        assert!(cfg.model.ffn_gated && !cfg.model.tie_embeddings);
        assert_eq!(
            (cfg.batch_size, cfg.grad_accumulation, cfg.seq_length),
            (16, 1, 512)
        );
        assert_eq!(cfg.precision, Precision::Fp32);
        assert_eq!(cfg.optimizer, Optimizer::AdamW);
        assert_eq!(cfg.device, Device::Cpu);
        assert_eq!(cfg.parallelism, Parallelism::None);
        assert_eq!(cfg.method, Method::Full);

        let mut gpu = tiny_llama();
        for (k, v) in [
            ("gpu", 1.0),
            ("bf16", 1.0),
            ("world-size", 4.0),
            ("fsdp", 1.0),
        ] {
            gpu.insert(k.into(), v);
        }
        gpu.insert("optimizer".into(), 5.0);
        gpu.insert("fused-loss".into(), 1.0);
        let cfg = training_config(&gpu).expect("a config");
        assert_eq!(cfg.device, Device::Cuda);
        assert_eq!(cfg.precision, Precision::Bf16Mixed);
        assert_eq!(cfg.parallelism, Parallelism::Fsdp);
        assert_eq!(cfg.optimizer, Optimizer::AdamW8bit);
        assert_eq!(cfg.loss, Loss::Fused);
        gpu.remove("fsdp");
        gpu.insert("deepspeed-stage".into(), 3.0);
        assert_eq!(
            training_config(&gpu).map(|c| c.parallelism),
            Ok(Parallelism::Zero3)
        );
        gpu.insert("deepspeed-stage".into(), 0.0);
        assert_eq!(
            training_config(&gpu).map(|c| c.parallelism),
            Ok(Parallelism::Ddp)
        );
    }
}
