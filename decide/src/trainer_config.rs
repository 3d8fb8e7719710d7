//! The trainer's reported config (`Report.config`, the knobs of
//! [`memguard_api::signal::TRAINER_CONFIG_KNOBS`]) as the estimator's training config: one
//! mapping for the sidecar's plan at train start and for admission's plan on a past run's report
//! (issue 37). Pure.
//!
//! A value the estimate depends on that the trainer did not report is unknown: no config, and
//! the error names each missing or impossible value.

use memguard_api::signal::OPTIMIZER_CODES;
use memguard_estimator::{
    Device, Loss, Method, ModelShape, Optimizer, Parallelism, Precision, TrainingConfig,
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
    if trainable < params {
        // LoRA's targets and layers, or which part a script froze, are not reported.
        return Err(format!(
            "{trainable} of {params} parameters trainable: adapters and partly frozen models \
             are not planned at train start"
        ));
    }
    if quant_bits != 0 {
        return Err(format!(
            "a {quant_bits}-bit base trained in full is not planned at train start"
        ));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::tiny_llama_report as tiny_llama;

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
