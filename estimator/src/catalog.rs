//! Built-in catalog of common architectures, with their real config numbers (from each model's
//! published `config.json`) and published parameter counts.

use crate::config::{Mla, ModelShape, Norms};

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
    attention_dropout: bool,
    attention_softcapping: bool,
    moe_intermediate: Option<u64>,
    shared_experts: u64,
    dense_layers: u64,
    mla: Option<Mla>,
    extra_params: u64,
    norms: Norms,
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
        attention_dropout: false,
        attention_softcapping: false,
        moe_intermediate: None,
        shared_experts: 0,
        dense_layers: 0,
        mla: None,
        extra_params: 0,
        norms: Norms::RmsNorm,
    }
}

/// GPT-2: plain GELU MLP (4h), multi-head attention, tied embeddings, `attn_pdrop` 0.1.
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
        attention_dropout: true,
        norms: Norms::LayerNorm,
        ..dense(name, params, h, l, a, a, 4 * h, 50257, true)
    }
}

/// Gemma 2: explicit head_dim, tied embeddings, 256k vocabulary, soft-capped attention
/// scores (`attn_logit_softcapping` 50).
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
        attention_softcapping: true,
        ..dense(name, params, h, l, a, kv, i, 256_000, true)
    }
}

/// Qwen3 dense: head_dim 128 (q/k norms not counted), 151 936 vocabulary. Published counts
/// are the model cards' (0.6B … 32.8B).
#[allow(clippy::too_many_arguments)]
const fn qwen3(
    name: &'static str,
    params: u64,
    h: u64,
    l: u64,
    a: u64,
    i: u64,
    tied: bool,
) -> Entry {
    Entry {
        head_dim: Some(128),
        ..dense(name, params, h, l, a, 8, i, 151_936, tied)
    }
}

/// Qwen3-MoE: 128 experts of `moe_intermediate_size`, 8 per token, 4 KV heads of 128
/// (`intermediate_size` is in the config but no layer is dense).
#[allow(clippy::too_many_arguments)]
const fn qwen3_moe(
    name: &'static str,
    params: u64,
    h: u64,
    l: u64,
    a: u64,
    i: u64,
    moe_i: u64,
) -> Entry {
    Entry {
        head_dim: Some(128),
        experts: 128,
        experts_per_token: 8,
        moe_intermediate: Some(moe_i),
        ..dense(name, params, h, l, a, 4, i, 151_936, false)
    }
}

/// The SigLIP-So400m vision tower of Gemma 3 at 896 px: 27 layers of width 1152 (attention
/// `4·(1152² + 1152)`, MLP `2·1152·4304 + 4304 + 1152`, two LayerNorms `4·1152`), the
/// 14×14 patch embedding `3·14·14·1152 + 1152`, 4096 position embeddings and a final norm.
const SIGLIP_SO400M_896: u64 = 27
    * (4 * (1152 * 1152 + 1152) + 2 * 1152 * 4304 + 4304 + 1152 + 4 * 1152)
    + (3 * 14 * 14 * 1152 + 1152)
    + 4096 * 1152
    + 2 * 1152;

/// Gemma 3: explicit head_dim, one KV head group, tied embeddings; from 4B up the checkpoint
/// carries the vision tower and its projector (`1152·h + 1152`) into width `h`.
#[allow(clippy::too_many_arguments)]
const fn gemma3(
    name: &'static str,
    params: u64,
    h: u64,
    l: u64,
    a: u64,
    kv: u64,
    i: u64,
    head_dim: u64,
    vocab: u64,
    vision: bool,
) -> Entry {
    Entry {
        head_dim: Some(head_dim),
        extra_params: if vision {
            SIGLIP_SO400M_896 + 1152 * h + 1152
        } else {
            0
        },
        ..dense(name, params, h, l, a, kv, i, vocab, true)
    }
}

/// Mistral NeMo-style (Nemo 12B, Small 24B): head_dim 128, 131 072 (Tekken) vocabulary.
const fn mistral_tekken(
    name: &'static str,
    aliases: &'static [&'static str],
    params: u64,
    i: u64,
) -> Entry {
    Entry {
        aliases,
        head_dim: Some(128),
        ..dense(name, params, 5120, 40, 32, 8, i, 131_072, false)
    }
}

/// OLMo 2: multi-head (or GQA for 32B) attention with q/k norms, 100 352 vocabulary, untied.
#[allow(clippy::too_many_arguments)]
const fn olmo2(
    name: &'static str,
    aliases: &'static [&'static str],
    params: u64,
    h: u64,
    l: u64,
    a: u64,
    kv: u64,
    i: u64,
) -> Entry {
    Entry {
        aliases,
        ..dense(name, params, h, l, a, kv, i, 100_352, false)
    }
}

/// gpt-oss: 64 heads of 64, 8 KV heads, experts as wide as the model (2880), 4 per token,
/// o200k vocabulary (201 088). Biases and attention sinks are not counted (< 0.1 %).
const fn gpt_oss(name: &'static str, params: u64, l: u64, experts: u64) -> Entry {
    Entry {
        head_dim: Some(64),
        experts,
        experts_per_token: 4,
        ..dense(name, params, 2880, l, 64, 8, 2880, 201_088, false)
    }
}

const CATALOG: &[Entry] = &[
    gpt2("gpt2", &["gpt2-small"], 124_439_808, 768, 12, 12),
    // BLOOM 560M (bigscience/bloom-560m config.json): plain GELU MLP (4h), ALiBi, tied 250k
    // vocabulary.
    Entry {
        gated: false,
        norms: Norms::LayerNorm,
        ..dense(
            "bloom-560m",
            559_214_592,
            1024,
            24,
            16,
            16,
            4096,
            250_880,
            true,
        )
    },
    // OPT 6.7B (facebook/opt-6.7b): plain ReLU MLP (4h), tied, learned positions (2050 × h).
    Entry {
        gated: false,
        extra_params: 2050 * 4096,
        norms: Norms::LayerNorm,
        ..dense(
            "opt-6.7b",
            6_658_473_984,
            4096,
            32,
            32,
            32,
            16384,
            50272,
            true,
        )
    },
    // Falcon 7B (tiiuae/falcon-7b): multi-query attention (one KV head), plain GELU MLP (4h),
    // tied 65k vocabulary.
    Entry {
        gated: false,
        // `parallel_attn` with one `input_layernorm` (not `new_decoder_architecture`).
        norms: Norms::SharedLayerNorm,
        ..dense(
            "falcon-7b",
            6_921_720_704,
            4544,
            32,
            71,
            1,
            18176,
            65024,
            true,
        )
    },
    // ChatGLM-6B (THUDM/chatglm-6b): GLM blocks, plain GELU MLP (4h), tied 130k vocabulary.
    Entry {
        gated: false,
        aliases: &["chatglm-6b-int4", "chatglm-6b-int8"],
        norms: Norms::LayerNorm,
        ..dense(
            "chatglm-6b",
            6_173_286_400,
            4096,
            28,
            32,
            32,
            16384,
            130_528,
            true,
        )
    },
    // Qwen (1) 7B (Qwen/Qwen-7B config.json): SwiGLU of 11008 (`intermediate_size` 22016 is
    // both halves), untied 152k vocabulary.
    dense(
        "qwen-7b",
        7_721_324_544,
        4096,
        32,
        32,
        32,
        11008,
        151_936,
        false,
    ),
    // Gemma 1 7B (google/gemma-7b): 16 heads of 256, GeGLU, tied 256k vocabulary.
    Entry {
        head_dim: Some(256),
        ..dense(
            "gemma-7b",
            8_537_680_896,
            3072,
            28,
            16,
            16,
            24576,
            256_000,
            true,
        )
    },
    gpt2("gpt2-medium", &[], 354_823_168, 1024, 24, 16),
    gpt2("gpt2-large", &[], 774_030_080, 1280, 36, 20),
    gpt2("gpt2-xl", &[], 1_557_611_200, 1600, 48, 25),
    // LLaMA 1 7B and Vicuna 7B have this shape too (same config.json numbers).
    Entry {
        aliases: &["llama-7b", "vicuna-7b", "vicuna-7b-v1.3", "vicuna-7b-v1.5"],
        ..dense(
            "llama-2-7b",
            6_738_415_616,
            4096,
            32,
            32,
            32,
            11008,
            32000,
            false,
        )
    },
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
    Entry {
        aliases: &["mistral-7b-v0.1", "mistral-7b-v0.2"],
        ..dense(
            "mistral-7b",
            7_241_732_096,
            4096,
            32,
            32,
            8,
            14336,
            32000,
            false,
        )
    },
    Entry {
        aliases: &["mixtral-8x7b-v0.1"],
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
    // Qwen2-0.5B (TRL's example model): its config.json has the same shapes as Qwen2.5-0.5B's
    // (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151 936,
    // tied embeddings); only the context length (131 072) differs.
    dense(
        "qwen2-0.5b",
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
    // Gemma 1 2B (GKE's fine-tuning sample): one KV head of 256, GeGLU, tied 256k vocabulary,
    // no soft-capping (google/gemma-2b config.json).
    Entry {
        head_dim: Some(256),
        ..dense(
            "gemma-2b",
            2_506_172_416,
            2048,
            18,
            8,
            1,
            16384,
            256_000,
            true,
        )
    },
    gemma2("gemma-2-2b", 2_614_341_888, 2304, 26, 8, 4, 9216, 256),
    gemma2("gemma-2-9b", 9_241_705_984, 3584, 42, 16, 8, 14336, 256),
    gemma2("gemma-2-27b", 27_227_128_320, 4608, 46, 32, 16, 36864, 128),
    Entry {
        // Phi-3.5-mini has Phi-3-mini's config.json numbers.
        aliases: &["phi-3-mini-4k", "phi-3-mini-128k", "phi-3.5-mini"],
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
    // Llama 3.3 70B: the Llama 3.1 70B architecture.
    dense(
        "llama-3.3-70b",
        70_553_706_496,
        8192,
        80,
        64,
        8,
        28672,
        128_256,
        false,
    ),
    // Mistral 7B v0.3: the v0.1 shape with a 32 768 vocabulary.
    dense(
        "mistral-7b-v0.3",
        7_248_023_552,
        4096,
        32,
        32,
        8,
        14336,
        32768,
        false,
    ),
    mistral_tekken(
        "mistral-nemo-12b",
        &[
            "mistral-nemo",
            "mistral-nemo-base-2407",
            "mistral-nemo-instruct-2407",
        ],
        12_247_782_400,
        14336,
    ),
    mistral_tekken(
        "mistral-small-24b",
        &[
            "mistral-small-24b-base-2501",
            "mistral-small-24b-instruct-2501",
            "mistral-small-3.1-24b-base-2503",
            "mistral-small-3.1-24b-instruct-2503",
        ],
        23_572_403_200,
        32768,
    ),
    qwen3("qwen3-0.6b", 600_000_000, 1024, 28, 16, 3072, true),
    qwen3("qwen3-1.7b", 1_700_000_000, 2048, 28, 16, 6144, true),
    qwen3("qwen3-4b", 4_000_000_000, 2560, 36, 32, 9728, true),
    qwen3("qwen3-8b", 8_200_000_000, 4096, 36, 32, 12288, false),
    qwen3("qwen3-14b", 14_800_000_000, 5120, 40, 40, 17408, false),
    qwen3("qwen3-32b", 32_800_000_000, 5120, 64, 64, 25600, false),
    qwen3_moe("qwen3-30b-a3b", 30_500_000_000, 2048, 48, 32, 6144, 768),
    qwen3_moe(
        "qwen3-235b-a22b",
        235_000_000_000,
        4096,
        94,
        64,
        12288,
        1536,
    ),
    gemma3(
        "gemma-3-270m",
        268_098_176,
        640,
        18,
        4,
        1,
        2048,
        256,
        262_144,
        false,
    ),
    gemma3(
        "gemma-3-1b",
        999_885_952,
        1152,
        26,
        4,
        1,
        6912,
        256,
        262_144,
        false,
    ),
    gemma3(
        "gemma-3-4b",
        4_300_079_472,
        2560,
        34,
        8,
        4,
        10240,
        256,
        262_208,
        true,
    ),
    gemma3(
        "gemma-3-12b",
        12_187_325_040,
        3840,
        48,
        16,
        8,
        15360,
        256,
        262_208,
        true,
    ),
    gemma3(
        "gemma-3-27b",
        27_432_406_640,
        5376,
        62,
        32,
        16,
        21504,
        128,
        262_208,
        true,
    ),
    dense(
        "phi-4",
        14_659_507_200,
        5120,
        40,
        40,
        10,
        17920,
        100_352,
        false,
    ),
    dense(
        "phi-4-mini",
        3_836_021_760,
        3072,
        32,
        24,
        8,
        8192,
        200_064,
        true,
    ),
    // DeepSeek-V2-Lite: MLA without query compression, 64 routed experts (6 per token) and
    // 2 shared of width 1408, the first layer dense (10 944).
    Entry {
        experts: 64,
        experts_per_token: 6,
        moe_intermediate: Some(1408),
        shared_experts: 2,
        dense_layers: 1,
        mla: Some(Mla {
            q_lora_rank: None,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        }),
        ..dense(
            "deepseek-v2-lite",
            15_706_484_224,
            2048,
            27,
            16,
            16,
            10944,
            102_400,
            false,
        )
    },
    // DeepSeek-V3 (and R1, same architecture): MLA with query rank 1536, 256 routed experts
    // (8 per token) and 1 shared of width 2048, the first 3 layers dense (18 432). 671B
    // without the multi-token-prediction module (685B on the hub with it).
    Entry {
        aliases: &["deepseek-r1", "deepseek-v3-0324", "deepseek-r1-0528"],
        experts: 256,
        experts_per_token: 8,
        moe_intermediate: Some(2048),
        shared_experts: 1,
        dense_layers: 3,
        mla: Some(Mla {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        }),
        ..dense(
            "deepseek-v3",
            671_000_000_000,
            7168,
            61,
            128,
            128,
            18432,
            129_280,
            false,
        )
    },
    olmo2(
        "olmo-2-1b",
        &["olmo-2-0425-1b"],
        1_484_916_736,
        2048,
        16,
        16,
        16,
        8192,
    ),
    olmo2(
        "olmo-2-7b",
        &["olmo-2-1124-7b"],
        7_298_617_344,
        4096,
        32,
        32,
        32,
        11008,
    ),
    olmo2(
        "olmo-2-13b",
        &["olmo-2-1124-13b"],
        13_716_198_400,
        5120,
        40,
        40,
        40,
        13824,
    ),
    olmo2(
        "olmo-2-32b",
        &["olmo-2-0325-32b"],
        32_234_279_936,
        5120,
        64,
        40,
        8,
        27648,
    ),
    dense(
        "smollm2-135m",
        134_515_008,
        576,
        30,
        9,
        3,
        1536,
        49152,
        true,
    ),
    dense(
        "smollm2-360m",
        361_821_120,
        960,
        32,
        15,
        5,
        2560,
        49152,
        true,
    ),
    dense(
        "smollm2-1.7b",
        1_711_376_384,
        2048,
        24,
        32,
        32,
        8192,
        49152,
        true,
    ),
    gpt_oss("gpt-oss-20b", 20_914_757_184, 24, 32),
    gpt_oss("gpt-oss-120b", 116_829_156_672, 36, 128),
    // A sequence classifier: no vocabulary projection, so no B·S·V logits.
    // `attention_probs_dropout_prob` 0.1.
    Entry {
        // `bert-large-uncased-whole-word-masking` (transformers' run_glue example) differs in
        // its pre-training only: the same config.json.
        aliases: &["bert-large", "bert-large-uncased-whole-word-masking"],
        gated: false,
        attention_dropout: true,
        lm_head: false,
        norms: Norms::LayerNorm,
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

/// `Llama_3.1-8B` → `llama-3-1-8b`: how names are compared (case, and `_`, `.` and spaces as
/// `-`). Public so the models a policy adds compare the same way.
pub fn normalize(name: &str) -> String {
    name.trim()
        .to_ascii_lowercase()
        .replace(['_', '.', ' '], "-")
}

/// What Hugging Face repository names add around the architecture's name: the variant
/// words (`-Instruct`, `-it`, `-chat`, `-hf`, `-Base`, `-pt`, wherever they stand) and Meta's
/// `Meta-` prefix.
/// The weights of every such variant have the same shape.
const HF_SUFFIXES: &[&str] = &["-instruct", "-it", "-chat", "-hf", "-base", "-pt"];

/// The catalog entry whose name or alias is `key` (normalized; dashes optional).
fn find(key: &str) -> Option<&'static Entry> {
    let compact = key.replace('-', "");
    let matches = |candidate: &str| {
        let c = normalize(candidate);
        c == key || c.replace('-', "") == compact
    };
    CATALOG
        .iter()
        .find(|e| matches(e.name) || e.aliases.iter().any(|a| matches(a)))
}

/// A Hugging Face repository id without its organisation, variant suffixes and `Meta-`
/// prefix: `meta-llama/Meta-Llama-3.1-8B-Instruct` → `llama-3-1-8b`.
fn architecture_name(key: &str) -> String {
    let name = key.rsplit('/').next().unwrap_or(key);
    // The variant words anywhere, one rule for every base: `Mistral-7B-Instruct-v0.2` is
    // `mistral-7b-v0-2`, `Mixtral-8x7B-Instruct-v0.1` is `mixtral-8x7b-v0-1`.
    let kept: Vec<&str> = name
        .split('-')
        .filter(|token| !HF_SUFFIXES.iter().any(|s| &s[1..] == *token))
        .collect();
    let name = kept.join("-");
    name.strip_prefix("meta-")
        .map(str::to_string)
        .unwrap_or(name)
}

/// Looks up a model by name, case-insensitively: a catalog name or alias (`_` and `.`
/// accepted for `-`, and the dashes themselves optional: `llama3-8b`, `qwen2.5-7b`,
/// `Llama_3.1_70B`), or a Hugging Face repository id (`meta-llama/Llama-3.1-8B`,
/// `Qwen/Qwen2.5-7B-Instruct`, `google/gemma-3-4b-it`): the organisation is dropped, then
/// the variant suffixes `-Instruct`, `-it`, `-chat`, `-hf`, `-Base`, `-pt` and a `Meta-`
/// prefix. Anything else (a quantized or merged derivative such as `…-GPTQ-Int4`) is not
/// guessed: give its shape or its `config.json`.
pub fn lookup(name: &str) -> Option<ModelShape> {
    let key = normalize(name);
    let repo = key.rsplit('/').next().unwrap_or(&key);
    find(&key)
        .or_else(|| find(repo))
        .or_else(|| find(&architecture_name(&key)))
        .map(shape)
}

fn shape(e: &Entry) -> ModelShape {
    ModelShape {
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
        moe_intermediate_size: e.moe_intermediate,
        shared_experts: e.shared_experts,
        dense_layers: e.dense_layers,
        mla: e.mla,
        extra_params: e.extra_params,
        attention_dropout: e.attention_dropout,
        attention_softcapping: e.attention_softcapping,
        norms: e.norms,
    }
}

/// The `n` catalog names closest to `name` (edit distance between architecture names, the
/// organisation and variant words dropped): what an "unknown model" message suggests.
pub fn nearest(name: &str, n: usize) -> Vec<&'static str> {
    let want = architecture_name(&normalize(name));
    let mut scored: Vec<(usize, &'static str)> = CATALOG
        .iter()
        .map(|e| (edit_distance(&want, &normalize(e.name)), e.name))
        .collect();
    scored.sort();
    scored.into_iter().take(n).map(|(_, name)| name).collect()
}

/// Levenshtein distance over bytes (names are ASCII after [`normalize`]).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
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
    fn nearest_names_the_closest_architectures() {
        assert_eq!(nearest("acme/Llama-3.1-8B-Finetuned", 1), ["llama-3.1-8b"]);
        assert!(nearest("Qwen/Qwen2.5-7B-Math", 3).contains(&"qwen2.5-7b"));
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
    fn lookup_accepts_hugging_face_ids_case_insensitively() {
        let cases = [
            ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
            ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
            ("META-LLAMA/LLAMA-3.3-70B-INSTRUCT", "llama-3.3-70b"),
            ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
            ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
            ("qwen/qwen3-30b-a3b", "qwen3-30b-a3b"),
            ("Qwen/Qwen3-8B-Base", "qwen3-8b"),
            ("google/gemma-3-4b-it", "gemma-3-4b"),
            ("google/gemma-2b", "gemma-2b"),
            ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b"),
            ("mistralai/Mistral-7B-Instruct-v0.2", "mistral-7b"),
            ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b-v0.3"),
            ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
            ("microsoft/Phi-3.5-mini-instruct", "phi-3-mini"),
            ("google/gemma-7b", "gemma-7b"),
            ("google/gemma-7b-it", "gemma-7b"),
            ("tiiuae/falcon-7b", "falcon-7b"),
            ("tiiuae/falcon-7b-instruct", "falcon-7b"),
            ("bigscience/bloom-560m", "bloom-560m"),
            ("huggyllama/llama-7b", "llama-2-7b"),
            ("lmsys/vicuna-7b-v1.5", "llama-2-7b"),
            ("Qwen/Qwen-7B-Chat", "qwen-7b"),
            ("THUDM/chatglm-6b", "chatglm-6b"),
            ("facebook/opt-6.7b", "opt-6.7b"),
            ("Qwen/Qwen2-0.5B", "qwen2-0.5b"),
            ("Qwen/Qwen2-0.5B-Instruct", "qwen2-0.5b"),
            ("Qwen/Qwen2.5-0.5B", "qwen2.5-0.5b"),
            ("gpt2", "gpt2"),
            (
                "bert-large-uncased-whole-word-masking",
                "bert-large-uncased",
            ),
            ("google/gemma-2b-it", "gemma-2b"),
            ("google/gemma-2-2b", "gemma-2-2b"),
            ("google/gemma-3-1b-pt", "gemma-3-1b"),
            ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
            ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-12b"),
            (
                "mistralai/Mistral-Small-24B-Instruct-2501",
                "mistral-small-24b",
            ),
            ("microsoft/phi-4", "phi-4"),
            ("microsoft/Phi-3-mini-4k-instruct", "phi-3-mini"),
            ("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-v2-lite"),
            ("deepseek-ai/DeepSeek-R1", "deepseek-v3"),
            ("allenai/OLMo-2-1124-7B-Instruct", "olmo-2-7b"),
            ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "smollm2-1.7b"),
            ("openai/gpt-oss-20b", "gpt-oss-20b"),
        ];
        for (id, name) in cases {
            assert_eq!(
                lookup(id).and_then(|m| m.name).as_deref(),
                Some(name),
                "{id}"
            );
        }
        // Derivatives with another shape or storage are not guessed.
        assert!(lookup("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4").is_none());
        assert!(lookup("meta-llama/Llama-3.1-8B-Vision").is_none());
    }

    #[test]
    fn mla_moe_and_vision_shapes_count_what_their_configs_say() {
        // DeepSeek-V2-Lite: the published 15 706 484 224 comes out exactly (no biases).
        let ds = lookup("deepseek-v2-lite").expect("catalog");
        assert_eq!(ParamCounts::of(&ds).total, 15_706_484_224);
        // Without its two shared experts it would be about 3 % short.
        let mut plain = ds.clone();
        plain.shared_experts = 0;
        assert!(ParamCounts::of(&plain).total < 15_706_484_224 * 98 / 100);
        // Gemma 3 4B: the vision tower is 0.42B of the published 4.3B.
        let g = lookup("gemma-3-4b").expect("catalog");
        assert!((419_000_000..421_000_000).contains(&g.extra_params));
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
            "llama-3.3-70b",
            "qwen3-0.6b",
            "qwen3-32b",
            "qwen3-30b-a3b",
            "qwen3-235b-a22b",
            "gemma-3-1b",
            "gemma-3-27b",
            "mistral-nemo-12b",
            "mistral-small-24b",
            "phi-4",
            "deepseek-v2-lite",
            "deepseek-v3",
            "olmo-2-7b",
            "smollm2-135m",
            "gpt-oss-20b",
            "gpt-oss-120b",
        ] {
            assert!(lookup(name).is_some(), "{name} missing");
        }
    }
}
