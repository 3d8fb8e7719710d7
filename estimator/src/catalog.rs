//! Built-in catalog of common architectures, with their real config numbers.
//!
//! SCAFFOLD: to be completed by the estimator work (issue 2).

use crate::config::ModelShape;

/// Looks up a model by name (case-insensitive; `_` and `.` accepted for `-`).
pub fn lookup(name: &str) -> Option<ModelShape> {
    let key = name.trim().to_ascii_lowercase().replace(['_', '.'], "-");
    match key.as_str() {
        "llama-3-8b" => Some(ModelShape {
            name: Some("llama-3-8b".into()),
            params: Some(8_030_261_248),
            hidden_size: 4096,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            intermediate_size: 14336,
            vocab_size: 128256,
            ffn_gated: true,
            num_experts: 1,
            experts_per_token: 1,
            tie_embeddings: false,
            lm_head: true,
            head_dim: None,
        }),
        _ => None,
    }
}

/// Every catalog name.
pub fn names() -> Vec<&'static str> {
    vec!["llama-3-8b"]
}
