//! Inference serving: weights plus the KV-cache ceiling for a maximum number of sequences.

use crate::config::{ConfigError, Device, ModelShape, TrainingConfig};
use crate::estimate::{Component, Estimate, runtime_overhead};
use crate::params::{self, ParamCounts};
use crate::units::Bytes;

/// Tokens a serving engine pushes through one forward at most (a prefill chunk; vLLM's
/// `max_num_batched_tokens` is of this order).
pub const PREFILL_CHUNK_TOKENS: u64 = 8192;

/// What a model server must hold.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ServingConfig {
    /// The model.
    pub model: ModelShape,
    /// Storage bits of the weights (4, 8, 16, 32).
    pub model_bits: u32,
    /// Sequences served at once (the engine's `max_num_seqs`).
    pub max_sequences: u64,
    /// Longest sequence, prompt and output together (`max_model_len`).
    pub max_seq_length: u64,
    /// Bits of one cached key or value element (16, or 8 for an fp8 cache).
    pub kv_cache_bits: u32,
    /// Device kind.
    pub device: Device,
}

impl ServingConfig {
    /// 16-bit weights and cache, one sequence of 4096 tokens, on CUDA.
    pub fn new(model: ModelShape) -> ServingConfig {
        ServingConfig {
            model,
            model_bits: 16,
            max_sequences: 1,
            max_seq_length: 4096,
            kv_cache_bits: 16,
            device: Device::Cuda,
        }
    }

    /// Checks the model's shape and the serving fields, returning every problem.
    pub fn validate(&self) -> Result<(), Vec<ConfigError>> {
        let mut shape = TrainingConfig::new(self.model.clone());
        shape.seq_length = self.max_seq_length;
        shape.batch_size = self.max_sequences;
        let mut errors = shape.validate().err().unwrap_or_default();
        for e in &mut errors {
            if let ConfigError::Invalid { field, .. } = e {
                *field = match *field {
                    "seq-length" => "max-seq-length",
                    "batch-size" => "max-sequences",
                    other => other,
                };
            }
        }
        if ![4, 8, 16, 32].contains(&self.model_bits) {
            errors.push(ConfigError::Invalid {
                field: "model-bits",
                reason: format!("{} is not one of 4, 8, 16, 32", self.model_bits),
            });
        }
        if ![4, 8, 16, 32].contains(&self.kv_cache_bits) {
            errors.push(ConfigError::Invalid {
                field: "kv-cache-bits",
                reason: format!("{} is not one of 4, 8, 16, 32", self.kv_cache_bits),
            });
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// Weights: `P·bits/8`; a 4-bit model keeps embeddings, head and norms in 16 bits.
pub(crate) fn serving_weights(cfg: &ServingConfig) -> Bytes {
    let m = &cfg.model;
    let p = params::total_params(m) as f64;
    let bits = f64::from(cfg.model_bits);
    if cfg.model_bits <= 4 {
        let unq = ParamCounts::of(m).unquantized(m.num_layers) as f64;
        Bytes::from_f64((p - unq).max(0.0) * bits / 8.0 + unq.min(p) * 2.0)
    } else {
        Bytes::from_f64(p * bits / 8.0)
    }
}

/// 4-bit block scales: one fp32 per 64 quantized weights.
pub(crate) fn serving_scales(cfg: &ServingConfig) -> Bytes {
    if cfg.model_bits > 4 {
        return Bytes::ZERO;
    }
    let m = &cfg.model;
    let q = params::total_params(m).saturating_sub(ParamCounts::of(m).unquantized(m.num_layers));
    Bytes::from_f64(q as f64 / 64.0 * 4.0)
}

/// The KV-cache ceiling: `2 · L · kv_heads · head_dim · bytes · max_seq_length ·
/// max_sequences` (keys and values of every layer for every token of every sequence); with
/// multi-head latent attention serving engines cache the compressed latent and the shared
/// rotary key, `L · (kv_lora_rank + qk_rope_head_dim) · bytes` per token.
pub fn kv_cache(cfg: &ServingConfig) -> Bytes {
    let m = &cfg.model;
    let width = match m.mla {
        Some(mla) => (mla.kv_lora_rank + mla.qk_rope_head_dim) as f64,
        None => 2.0 * m.kv_dim() as f64,
    };
    let per_token = m.num_layers as f64 * width * f64::from(cfg.kv_cache_bits) / 8.0;
    Bytes::from_f64(per_token * cfg.max_seq_length as f64 * cfg.max_sequences as f64)
}

/// One forward's workspace, nothing kept for backward: a prefill chunk of
/// `T = min(sequences·length, 8192)` tokens through the widest layer, `T·(h + 2·q + 2·e·I)·2`
/// (residual, attention in/out, FFN branches of the routed experts), plus fp32 logits of the
/// last position of every sequence, `sequences·V·4`.
fn serving_workspace(cfg: &ServingConfig) -> (Bytes, Bytes) {
    let tokens = (cfg.max_sequences.saturating_mul(cfg.max_seq_length)).min(PREFILL_CHUNK_TOKENS);
    forward_workspace(&cfg.model, tokens, cfg.max_sequences)
}

/// One forward of `tokens` tokens for `sequences` sequences: the widest layer's workspace and
/// the last positions' fp32 logits (the formula of [`estimate_serving`]'s workspace).
pub(crate) fn forward_workspace(m: &ModelShape, tokens: u64, sequences: u64) -> (Bytes, Bytes) {
    let width = m.hidden_size as f64 + 2.0 * m.q_dim() as f64 + 2.0 * m.ffn_width_per_token();
    let workspace = Bytes::from_f64(tokens as f64 * width * 2.0);
    let logits = if m.lm_head {
        Bytes::from_f64(sequences as f64 * m.vocab_size as f64 * 4.0)
    } else {
        Bytes::ZERO
    };
    (workspace, logits)
}

/// Estimates what a server of `cfg` holds at its ceiling: weights, the full KV cache, one
/// forward's workspace, and the device's runtime overhead (serving engines preallocate, so
/// there is no allocator reserve on top).
pub fn estimate_serving(cfg: &ServingConfig) -> Result<Estimate, Vec<ConfigError>> {
    cfg.validate()?;
    let (workspace, logits) = serving_workspace(cfg);
    let components = vec![
        (Component::Weights, serving_weights(cfg)),
        (Component::QuantScales, serving_scales(cfg)),
        (Component::KvCache, kv_cache(cfg)),
        (Component::Activations, workspace),
        (Component::Logits, logits),
        (Component::RuntimeOverhead, runtime_overhead(cfg.device)),
    ];
    Ok(Estimate::from_components(components))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;

    fn serving(name: &str) -> ServingConfig {
        ServingConfig::new(catalog::lookup(name).expect("catalog"))
    }

    #[test]
    fn kv_cache_follows_its_formula_with_gqa_heads() {
        let mut cfg = serving("llama-3-8b");
        cfg.max_sequences = 16;
        cfg.max_seq_length = 8192;
        // 2 · 32 layers · 8 kv heads · 128 · 2 bytes = 128 KiB per token.
        let expected = 2 * 32 * 8 * 128 * 2 * 8192 * 16;
        assert_eq!(kv_cache(&cfg), Bytes(expected));
        let e = estimate_serving(&cfg).expect("valid");
        assert_eq!(e.component(Component::KvCache), Bytes(expected));
    }

    #[test]
    fn kv_cache_grows_linearly_with_sequences_and_halves_in_fp8() {
        let mut cfg = serving("llama-2-7b");
        let one = kv_cache(&cfg);
        cfg.max_sequences = 4;
        assert_eq!(kv_cache(&cfg).0, 4 * one.0);
        cfg.kv_cache_bits = 8;
        assert_eq!(kv_cache(&cfg).0, 2 * one.0);
    }

    #[test]
    fn serving_weights_follow_the_storage_bits() {
        let mut cfg = serving("llama-3-8b");
        let w16 = estimate_serving(&cfg)
            .expect("valid")
            .component(Component::Weights);
        assert_eq!(w16, Bytes(8_030_261_248 * 2));
        cfg.model_bits = 4;
        let e4 = estimate_serving(&cfg).expect("valid");
        assert!(e4.component(Component::Weights).as_f64() < w16.as_f64() / 2.5);
        assert!(e4.component(Component::QuantScales) > Bytes::ZERO);
    }

    #[test]
    fn a_7b_server_fits_a_24_gib_card_with_a_modest_cache() {
        let mut cfg = serving("mistral-7b");
        cfg.max_sequences = 8;
        cfg.max_seq_length = 4096;
        let e = estimate_serving(&cfg).expect("valid");
        assert!(e.total < Bytes::gib(24), "{}", e.total);
        assert!(e.total > Bytes::gib(15), "{}", e.total);
        assert!(e.tensor_peak < e.total);
    }

    #[test]
    fn bad_serving_input_names_its_field() {
        let mut cfg = serving("gpt2");
        cfg.max_sequences = 0;
        cfg.kv_cache_bits = 12;
        let errors = estimate_serving(&cfg).expect_err("invalid");
        let fields: Vec<&str> = errors.iter().map(|e| e.field()).collect();
        assert!(fields.contains(&"max-sequences"), "{fields:?}");
        assert!(fields.contains(&"kv-cache-bits"), "{fields:?}");
    }
}
