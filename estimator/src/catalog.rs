//! Built-in catalog of common architectures, with their real config numbers (from each model's
//! published `config.json`) and published parameter counts.

use crate::config::ModelShape;

/// One catalog row. `params` is the published exact count (all experts included).
struct Entry {
    name: &'static str,
    aliases: &'static [&'static str],
    params: u64,
    hidden: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    intermediate: u64,
    vocab: u64,
    gated: bool,
    experts: u64,
    experts_per_token: u64,
    tied: bool,
    lm_head: bool,
    head_dim: Option<u64>,
}

/// A dense decoder with a gated FFN and an LM head: the common case.
#[allow(clippy::too_many_arguments)]
const fn dense(
    name: &'static str,
    params: u64,
    hidden: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    intermediate: u64,
    vocab: u64,
    tied: bool,
) -> Entry {
    Entry {
        name,
        aliases: &[],
        params,
        hidden,
        layers,
        heads,
        kv_heads,
        intermediate,
        vocab,
        gated: true,
        experts: 1,
        experts_per_token: 1,
        tied,
        lm_head: true,
        head_dim: None,
    }
}

/// GPT-2: plain GELU MLP (4h), multi-head attention, tied embeddings.
const fn gpt2(
    name: &'static str,
    aliases: &'static [&'static str],
    params: u64,
    h: u64,
    l: u64,
    a: u64,
) -> Entry {
    Entry {
        aliases,
        gated: false,
        ..dense(name, params, h, l, a, a, 4 * h, 50257, true)
    }
}

/// Gemma 2: explicit head_dim, tied embeddings, 256k vocabulary.
#[allow(clippy::too_many_arguments)]
const fn gemma2(
    name: &'static str,
    params: u64,
    h: u64,
    l: u64,
    a: u64,
    kv: u64,
    i: u64,
    head_dim: u64,
) -> Entry {
    Entry {
        head_dim: Some(head_dim),
        ..dense(name, params, h, l, a, kv, i, 256_000, true)
    }
}

const CATALOG: &[Entry] = &[
    gpt2("gpt2", &["gpt2-small"], 124_439_808, 768, 12, 12),
    gpt2("gpt2-medium", &[], 354_823_168, 1024, 24, 16),
    gpt2("gpt2-large", &[], 774_030_080, 1280, 36, 20),
    gpt2("gpt2-xl", &[], 1_557_611_200, 1600, 48, 25),
    dense(
        "llama-2-7b",
        6_738_415_616,
        4096,
        32,
        32,
        32,
        11008,
        32000,
        false,
    ),
    dense(
        "llama-2-13b",
        13_015_864_320,
        5120,
        40,
        40,
        40,
        13824,
        32000,
        false,
    ),
    dense(
        "llama-2-70b",
        68_976_648_192,
        8192,
        80,
        64,
        8,
        28672,
        32000,
        false,
    ),
    dense(
        "llama-3-8b",
        8_030_261_248,
        4096,
        32,
        32,
        8,
        14336,
        128_256,
        false,
    ),
    dense(
        "llama-3-70b",
        70_553_706_496,
        8192,
        80,
        64,
        8,
        28672,
        128_256,
        false,
    ),
    dense(
        "llama-3.1-8b",
        8_030_261_248,
        4096,
        32,
        32,
        8,
        14336,
        128_256,
        false,
    ),
    dense(
        "llama-3.1-70b",
        70_553_706_496,
        8192,
        80,
        64,
        8,
        28672,
        128_256,
        false,
    ),
    dense(
        "llama-3.1-405b",
        405_853_388_800,
        16384,
        126,
        128,
        8,
        53248,
        128_256,
        false,
    ),
    dense(
        "llama-3.2-1b",
        1_235_814_400,
        2048,
        16,
        32,
        8,
        8192,
        128_256,
        true,
    ),
    dense(
        "llama-3.2-3b",
        3_212_749_824,
        3072,
        28,
        24,
        8,
        8192,
        128_256,
        true,
    ),
    dense(
        "mistral-7b",
        7_241_732_096,
        4096,
        32,
        32,
        8,
        14336,
        32000,
        false,
    ),
    Entry {
        experts: 8,
        experts_per_token: 2,
        ..dense(
            "mixtral-8x7b",
            46_702_792_704,
            4096,
            32,
            32,
            8,
            14336,
            32000,
            false,
        )
    },
    dense(
        "qwen2.5-0.5b",
        494_032_768,
        896,
        24,
        14,
        2,
        4864,
        151_936,
        true,
    ),
    dense(
        "qwen2.5-1.5b",
        1_543_714_304,
        1536,
        28,
        12,
        2,
        8960,
        151_936,
        true,
    ),
    dense(
        "qwen2.5-3b",
        3_085_938_688,
        2048,
        36,
        16,
        2,
        11008,
        151_936,
        true,
    ),
    dense(
        "qwen2.5-7b",
        7_615_616_512,
        3584,
        28,
        28,
        4,
        18944,
        152_064,
        false,
    ),
    dense(
        "qwen2.5-14b",
        14_770_033_664,
        5120,
        48,
        40,
        8,
        13824,
        152_064,
        false,
    ),
    dense(
        "qwen2.5-32b",
        32_763_876_352,
        5120,
        64,
        40,
        8,
        27648,
        152_064,
        false,
    ),
    dense(
        "qwen2.5-72b",
        72_706_203_648,
        8192,
        80,
        64,
        8,
        29568,
        152_064,
        false,
    ),
    gemma2("gemma-2-2b", 2_614_341_888, 2304, 26, 8, 4, 9216, 256),
    gemma2("gemma-2-9b", 9_241_705_984, 3584, 42, 16, 8, 14336, 256),
    gemma2("gemma-2-27b", 27_227_128_320, 4608, 46, 32, 16, 36864, 128),
    Entry {
        aliases: &["phi-3-mini-4k", "phi-3-mini-128k"],
        ..dense(
            "phi-3-mini",
            3_821_079_552,
            3072,
            32,
            32,
            32,
            8192,
            32064,
            false,
        )
    },
    dense(
        "phi-3-medium",
        13_960_238_080,
        5120,
        40,
        40,
        10,
        17920,
        32064,
        false,
    ),
    // A sequence classifier: no vocabulary projection, so no B·S·V logits.
    Entry {
        aliases: &["bert-large"],
        gated: false,
        lm_head: false,
        ..dense(
            "bert-large-uncased",
            335_141_888,
            1024,
            24,
            16,
            16,
            4096,
            30522,
            true,
        )
    },
];

/// `Llama_3.1-8B` → `llama-3-1-8b`.
fn normalize(name: &str) -> String {
    name.trim()
        .to_ascii_lowercase()
        .replace(['_', '.', ' '], "-")
}

/// Looks up a model by name (case-insensitive; `_` and `.` accepted for `-`, and the dashes
/// themselves optional: `llama3-8b`, `qwen2.5-7b`, `Llama_3.1_70B`).
pub fn lookup(name: &str) -> Option<ModelShape> {
    let key = normalize(name);
    let compact = key.replace('-', "");
    let matches = |candidate: &str| {
        let c = normalize(candidate);
        c == key || c.replace('-', "") == compact
    };
    CATALOG
        .iter()
        .find(|e| matches(e.name) || e.aliases.iter().any(|a| matches(a)))
        .map(|e| ModelShape {
            name: Some(e.name.to_string()),
            params: Some(e.params),
            hidden_size: e.hidden,
            num_layers: e.layers,
            num_heads: e.heads,
            num_kv_heads: e.kv_heads,
            intermediate_size: e.intermediate,
            vocab_size: e.vocab,
            ffn_gated: e.gated,
            num_experts: e.experts,
            experts_per_token: e.experts_per_token,
            tie_embeddings: e.tied,
            lm_head: e.lm_head,
            head_dim: e.head_dim,
        })
}

/// Every catalog name.
pub fn names() -> Vec<&'static str> {
    CATALOG.iter().map(|e| e.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::ParamCounts;

    #[test]
    fn every_entry_has_a_shape_that_derives_its_published_parameter_count() {
        for name in names() {
            let m = lookup(name).expect("listed names resolve");
            let valid = crate::config::TrainingConfig::new(m.clone()).validate();
            assert_eq!(valid, Ok(()), "{name} has an invalid shape");
            let published = m.params.expect("catalog entries carry params") as f64;
            let derived = ParamCounts::of(&m).total as f64;
            let err = (derived - published) / published;
            assert!(
                err.abs() < 0.02,
                "{name}: derived {derived} vs published {published} ({:.2} %)",
                err * 100.0
            );
        }
    }

    #[test]
    fn lookup_normalizes_dots_underscores_case_and_dashes() {
        assert_eq!(
            lookup("Llama_3.1-70B").and_then(|m| m.name),
            Some("llama-3.1-70b".into())
        );
        assert_eq!(
            lookup("qwen2.5-7b").and_then(|m| m.name),
            Some("qwen2.5-7b".into())
        );
        assert_eq!(
            lookup("llama3-8b").and_then(|m| m.name),
            Some("llama-3-8b".into())
        );
        assert_eq!(
            lookup("gpt2-small").and_then(|m| m.name),
            Some("gpt2".into())
        );
        assert!(lookup("llama-9-1t").is_none());
    }

    #[test]
    fn catalog_covers_the_required_families() {
        for name in [
            "gpt2",
            "gpt2-medium",
            "gpt2-large",
            "gpt2-xl",
            "llama-2-7b",
            "llama-2-13b",
            "llama-2-70b",
            "llama-3-8b",
            "llama-3-70b",
            "llama-3.1-8b",
            "llama-3.1-70b",
            "llama-3.1-405b",
            "llama-3.2-1b",
            "llama-3.2-3b",
            "mistral-7b",
            "mixtral-8x7b",
            "qwen2.5-0.5b",
            "qwen2.5-72b",
            "gemma-2-2b",
            "gemma-2-9b",
            "gemma-2-27b",
            "phi-3-mini",
            "phi-3-medium",
            "bert-large-uncased",
        ] {
            assert!(lookup(name).is_some(), "{name} missing");
        }
    }
}
