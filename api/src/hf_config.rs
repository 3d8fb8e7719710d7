//! A Hugging Face `config.json` read into a model shape: what `memguard estimate
//! --model-config` uses, so a model the catalog does not know is described by the very file its
//! trainer loads.
//!
//! Only the fields that decide memory are read; every other field is ignored (a config carries
//! dozens). A field that is read but has the wrong type, a required field that is missing, or a
//! `quantization_config` whose method is unknown is an error naming the field: nothing falls
//! back silently to a default.

use memguard_estimator::{Mla, ModelShape, Norms};
use serde_json::{Map, Value};

/// What a `config.json` says about memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HfModel {
    /// The language model's shape (plus a vision tower's parameters, when the config has one).
    pub shape: ModelShape,
    /// Storage bits of the weights from `quantization_config` (`None`: not quantized).
    pub model_bits: Option<u32>,
    /// bitsandbytes 4-bit double quantization (`bnb_4bit_use_double_quant`).
    pub double_quant: bool,
    /// The attention-probability dropout the model trains with (`attention_dropout`,
    /// `attn_pdrop`), when the config states it.
    pub attention_dropout: Option<f64>,
}

/// Model types whose MLP is a plain two-matrix one (`fc1 → act → fc2`), not gated.
const PLAIN_MLP: &[&str] = &[
    "gpt2",
    "gpt_neox",
    "gptj",
    "gpt_bigcode",
    "bert",
    "roberta",
    "phi",
    "falcon",
    "opt",
    "bloom",
    "starcoder2",
    "mpt",
];

/// Model types whose config class defaults `tie_word_embeddings` to false (transformers'
/// `PretrainedConfig` default is true).
const UNTIED_BY_DEFAULT: &[&str] = &[
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "olmo2",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
];

/// Fields some published configs leave to their config class's defaults (transformers'
/// `Gemma3TextConfig`: the Gemma 3 4B/12B/27B checkpoints omit heads, KV heads, head_dim and
/// the vocabulary from `text_config`).
const CLASS_DEFAULTS: &[(&str, &[(&str, u64)])] = &[(
    "gemma3_text",
    &[
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("head_dim", 256),
        ("vocab_size", 262_208),
    ],
)];

/// Reads a `config.json` text. Returns every problem found, each naming its field.
pub fn parse(text: &str) -> Result<HfModel, Vec<String>> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| vec![format!("config.json: not JSON: {e}")])?;
    let Some(root) = root.as_object() else {
        return Err(vec!["config.json: not a JSON object".into()]);
    };
    parse_object(root)
}

/// Reads a `config.json` already parsed into a JSON object (a policy's `spec.models[].config`).
/// Returns every problem found, each naming its field.
pub fn parse_object(root: &Map<String, Value>) -> Result<HfModel, Vec<String>> {
    let mut r = Reader::default();
    // Multimodal configs (Gemma 3, LLaVA, Mistral 3) nest the language model.
    let text_cfg = match root.get("text_config") {
        Some(Value::Object(t)) => t,
        Some(_) => return Err(vec!["text_config: not an object".into()]),
        None => root,
    };
    let model_type = r
        .string(text_cfg, &["model_type"])
        .or_else(|| r.string(root, &["model_type"]))
        .unwrap_or_default();
    let mut text_cfg = text_cfg.clone();
    if let Some((_, defaults)) = CLASS_DEFAULTS.iter().find(|(t, _)| *t == model_type) {
        for (field, value) in *defaults {
            text_cfg
                .entry(field.to_string())
                .or_insert(Value::from(*value));
        }
    }
    let attention_dropout = r.fraction(
        &text_cfg,
        &[
            "attention_dropout",
            "attn_pdrop",
            "attention_probs_dropout_prob",
        ],
    );
    let mut shape = r.shape(&text_cfg, &model_type);
    shape.attention_dropout = attention_dropout.is_some_and(|p| p > 0.0);
    if let Some(vision) = root.get("vision_config") {
        match vision.as_object() {
            Some(v) => shape.extra_params = r.vision_params(v, shape.hidden_size),
            None => r.errors.push("vision_config: not an object".into()),
        }
    }
    if let Some(archs) = root.get("architectures").and_then(Value::as_array) {
        let classifier = archs.iter().filter_map(Value::as_str).any(|a| {
            a.ends_with("ForSequenceClassification") || a.ends_with("ForTokenClassification")
        });
        if classifier {
            shape.lm_head = false;
        }
    }
    let (model_bits, double_quant) = match root.get("quantization_config") {
        None | Some(Value::Null) => (None, false),
        Some(Value::Object(q)) => r.quantization(q),
        Some(_) => {
            r.errors.push("quantization_config: not an object".into());
            (None, false)
        }
    };
    if r.errors.is_empty() {
        Ok(HfModel {
            shape,
            model_bits,
            double_quant,
            attention_dropout,
        })
    } else {
        Err(r.errors)
    }
}

#[derive(Default)]
struct Reader {
    errors: Vec<String>,
}

impl Reader {
    /// The first of `names` present and not null, as a positive integer.
    fn count(&mut self, obj: &Map<String, Value>, names: &[&str]) -> Option<u64> {
        let (name, value) = names
            .iter()
            .find_map(|n| obj.get(*n).filter(|v| !v.is_null()).map(|v| (*n, v)))?;
        match value.as_u64() {
            Some(v) => Some(v),
            None => {
                self.errors
                    .push(format!("{name}: `{value}` is not a non-negative integer"));
                None
            }
        }
    }

    fn required(&mut self, obj: &Map<String, Value>, names: &[&str]) -> u64 {
        match self.count(obj, names) {
            Some(v) => v,
            None => {
                if !names
                    .iter()
                    .any(|n| obj.get(*n).is_some_and(|v| !v.is_null()))
                {
                    self.errors
                        .push(format!("{}: missing (required)", names.join(" or ")));
                }
                0
            }
        }
    }

    /// The first of `names` present and not null, as a number in [0, 1].
    fn fraction(&mut self, obj: &Map<String, Value>, names: &[&str]) -> Option<f64> {
        let (name, value) = names
            .iter()
            .find_map(|n| obj.get(*n).filter(|v| !v.is_null()).map(|v| (*n, v)))?;
        match value.as_f64() {
            Some(f) if (0.0..=1.0).contains(&f) => Some(f),
            _ => {
                self.errors
                    .push(format!("{name}: `{value}` is not a number in [0, 1]"));
                None
            }
        }
    }

    fn boolean(&mut self, obj: &Map<String, Value>, name: &str) -> Option<bool> {
        let value = obj.get(name).filter(|v| !v.is_null())?;
        match value.as_bool() {
            Some(b) => Some(b),
            None => {
                self.errors
                    .push(format!("{name}: `{value}` is not true or false"));
                None
            }
        }
    }

    fn string(&mut self, obj: &Map<String, Value>, names: &[&str]) -> Option<String> {
        let (name, value) = names
            .iter()
            .find_map(|n| obj.get(*n).filter(|v| !v.is_null()).map(|v| (*n, v)))?;
        match value.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                self.errors
                    .push(format!("{name}: `{value}` is not a string"));
                None
            }
        }
    }

    fn shape(&mut self, c: &Map<String, Value>, model_type: &str) -> ModelShape {
        let hidden = self.required(c, &["hidden_size", "n_embd", "d_model"]);
        let layers = self.required(c, &["num_hidden_layers", "n_layer", "num_layers"]);
        let heads = self.required(c, &["num_attention_heads", "n_head"]);
        let vocab = self.required(c, &["vocab_size"]);
        let multi_query = self.boolean(c, "multi_query") == Some(true);
        let kv_heads = self
            .count(c, &["num_key_value_heads", "num_kv_heads", "n_head_kv"])
            .unwrap_or(if multi_query { 1 } else { heads });
        let gated = !PLAIN_MLP.contains(&model_type);
        let intermediate = self
            .count(
                c,
                &[
                    "intermediate_size",
                    "n_inner",
                    "ffn_dim",
                    "d_ff",
                    "ffn_hidden_size",
                ],
            )
            .unwrap_or_else(|| hidden.saturating_mul(4));
        let experts = self
            .count(c, &["num_local_experts", "num_experts", "n_routed_experts"])
            .filter(|&e| e > 0)
            .unwrap_or(1);
        let per_token = if experts > 1 {
            self.required(
                c,
                &[
                    "num_experts_per_tok",
                    "num_experts_per_token",
                    "experts_per_token",
                ],
            )
        } else {
            1
        };
        let moe_intermediate = self.count(c, &["moe_intermediate_size"]);
        let mut shared = self.count(c, &["n_shared_experts"]).unwrap_or(0);
        if let Some(width) = self.count(c, &["shared_expert_intermediate_size"])
            && width > 0
        {
            // Qwen2-MoE: one shared expert of its own width, counted in expert widths.
            let expert = moe_intermediate.unwrap_or(intermediate).max(1);
            shared = width.div_ceil(expert);
        }
        let dense_layers = match c.get("mlp_only_layers").and_then(Value::as_array) {
            Some(list) => list.len() as u64,
            None => self.count(c, &["first_k_dense_replace"]).unwrap_or(0),
        };
        let mla = self.count(c, &["kv_lora_rank"]).map(|kv_lora_rank| Mla {
            q_lora_rank: self.count(c, &["q_lora_rank"]),
            kv_lora_rank,
            qk_nope_head_dim: self.required(c, &["qk_nope_head_dim"]),
            qk_rope_head_dim: self.required(c, &["qk_rope_head_dim"]),
            v_head_dim: self.required(c, &["v_head_dim"]),
        });
        let tied = self
            .boolean(c, "tie_word_embeddings")
            .unwrap_or(!UNTIED_BY_DEFAULT.contains(&model_type));
        ModelShape {
            name: None,
            params: None,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            intermediate_size: intermediate,
            vocab_size: vocab,
            ffn_gated: gated,
            num_experts: experts,
            experts_per_token: per_token,
            tie_embeddings: tied,
            lm_head: true,
            head_dim: self.count(c, &["head_dim"]),
            moe_intermediate_size: moe_intermediate,
            shared_experts: shared,
            dense_layers,
            mla,
            extra_params: 0,
            attention_dropout: false,
            // Gemma 2's `attn_logit_softcapping` (null when off, as in Gemma 3).
            attention_softcapping: c
                .get("attn_logit_softcapping")
                .is_some_and(|v| v.as_f64().is_some_and(|cap| cap > 0.0)),
            norms: self.norms(c, model_type),
        }
    }

    /// The block's norms, from its modelling file: LayerNorm families in sequence, or
    /// parallel attention and MLP behind one shared norm or two norms of the same input;
    /// every other model type an RMSNorm decoder.
    fn norms(&mut self, c: &Map<String, Value>, model_type: &str) -> Norms {
        match model_type {
            // `PhiDecoderLayer.input_layernorm`, GPT-J's and CodeGen's `ln_1`: one norm.
            "phi" | "gptj" | "codegen" => Norms::SharedLayerNorm,
            // `GPTNeoXLayer`: `input_layernorm` and `post_attention_layernorm` both of `x`
            // under `use_parallel_residual` (its default).
            "gpt_neox" if self.boolean(c, "use_parallel_residual").unwrap_or(true) => {
                Norms::ParallelLayerNorm
            }
            // `StableLmDecoderLayer`: no `post_attention_layernorm` under
            // `use_parallel_residual` (default false).
            "stablelm" if self.boolean(c, "use_parallel_residual").unwrap_or(false) => {
                Norms::SharedLayerNorm
            }
            // Falcon 40B/180B's `new_decoder_architecture`: `ln_attn` and `ln_mlp` of `x`;
            // Falcon 7B's `parallel_attn` (default true): one `input_layernorm`.
            "falcon" if self.boolean(c, "new_decoder_architecture").unwrap_or(false) => {
                Norms::ParallelLayerNorm
            }
            "falcon" if self.boolean(c, "parallel_attn").unwrap_or(true) => Norms::SharedLayerNorm,
            "gpt2" | "gpt_bigcode" | "gpt_neox" | "stablelm" | "falcon" | "bloom" | "opt"
            | "bert" | "roberta" | "starcoder2" => Norms::LayerNorm,
            _ => Norms::RmsNorm,
        }
    }

    /// A ViT-style vision tower (SigLIP, CLIP): per layer attention `4·(d² + d)`, MLP
    /// `2·d·I + I + d`, two LayerNorms `4·d`; the patch embedding `c·p²·d + d`, one position
    /// per patch `(image/p)²·d`, a final norm `2·d`; and a projector `d·h` into the language
    /// model's width.
    fn vision_params(&mut self, v: &Map<String, Value>, text_hidden: u64) -> u64 {
        let d = self.required(v, &["hidden_size"]);
        let i = self.required(v, &["intermediate_size"]);
        let layers = self.required(v, &["num_hidden_layers"]);
        let patch = self.required(v, &["patch_size"]);
        let image = self.required(v, &["image_size"]);
        let channels = self.count(v, &["num_channels"]).unwrap_or(3);
        // Saturating throughout: the sizes are whatever the file says, checked only later.
        let sum = |terms: &[u64]| terms.iter().fold(0u64, |a, &t| a.saturating_add(t));
        let mul = |factors: &[u64]| factors.iter().fold(1u64, |a, &f| a.saturating_mul(f));
        let per_layer = sum(&[
            mul(&[4, sum(&[mul(&[d, d]), d])]),
            mul(&[2, d, i]),
            i,
            d,
            mul(&[4, d]),
        ]);
        let side = image.checked_div(patch).unwrap_or(0);
        let total = sum(&[
            mul(&[layers, per_layer]),
            mul(&[channels, patch, patch, d]),
            d,
            mul(&[side, side, d]),
            mul(&[2, d]),
            mul(&[d, text_hidden]),
        ]);
        // Vision towers are well under 2^40 parameters; anything beyond is a broken config.
        total.min(1 << 40)
    }

    /// bitsandbytes: `load_in_4bit` (NF4/FP4, with `bnb_4bit_use_double_quant`) or
    /// `load_in_8bit` (LLM.int8).
    fn bitsandbytes(&mut self, q: &Map<String, Value>) -> (Option<u32>, bool) {
        let four = self.boolean(q, "load_in_4bit") == Some(true);
        let eight = self.boolean(q, "load_in_8bit") == Some(true);
        let double = self.boolean(q, "bnb_4bit_use_double_quant") == Some(true);
        match (four, eight) {
            (true, false) => (Some(4), double),
            (false, true) => (Some(8), false),
            (true, true) => {
                self.errors.push(
                    "quantization_config: load_in_4bit and load_in_8bit are both true".into(),
                );
                (None, false)
            }
            (false, false) => {
                self.errors.push(
                    "quantization_config: bitsandbytes without load_in_4bit or load_in_8bit".into(),
                );
                (None, false)
            }
        }
    }

    /// `(model_bits, double_quant)` from `quantization_config`.
    fn quantization(&mut self, q: &Map<String, Value>) -> (Option<u32>, bool) {
        let method = self.string(q, &["quant_method"]);
        let bnb_keys = q.contains_key("load_in_4bit") || q.contains_key("load_in_8bit");
        match method.as_deref() {
            Some("bitsandbytes") => self.bitsandbytes(q),
            None if bnb_keys => self.bitsandbytes(q),
            Some("gptq" | "awq" | "compressed-tensors" | "hqq" | "quanto") => {
                match self.count(q, &["bits", "weight_bits", "nbits"]) {
                    Some(b @ (4 | 8)) => (Some(b as u32), false),
                    Some(b) => {
                        self.errors.push(format!(
                            "quantization_config.bits: {b} is not 4 or 8 (the estimator models 4, 8, 16, 32)"
                        ));
                        (None, false)
                    }
                    None => {
                        self.errors.push("quantization_config.bits: missing".into());
                        (None, false)
                    }
                }
            }
            Some("fp8" | "fbgemm_fp8") => (Some(8), false),
            // gpt-oss ships its experts in MXFP4 (4-bit values, one shared exponent per 32).
            Some("mxfp4") => (Some(4), false),
            Some(other) => {
                self.errors.push(format!(
                    "quantization_config.quant_method: unknown `{other}` (known: bitsandbytes, gptq, awq, compressed-tensors, hqq, quanto, fp8, fbgemm_fp8, mxfp4)"
                ));
                (None, false)
            }
            None => {
                self.errors
                    .push("quantization_config.quant_method: missing".into());
                (None, false)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memguard_estimator::{catalog, params::ParamCounts};

    fn fixture(name: &str) -> HfModel {
        let path = format!(
            "{}/fixtures/hf-config/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).expect("fixture exists");
        parse(&text).unwrap_or_else(|e| panic!("{name}: {e:?}"))
    }

    /// Each real config derives the parameter count of its catalog entry within 2 %.
    #[test]
    fn real_configs_derive_their_published_parameter_counts() {
        for (file, entry) in [
            ("llama-3.1-8b", "llama-3.1-8b"),
            ("llama-3-8b-bnb-4bit", "llama-3-8b"),
            ("qwen3-30b-a3b", "qwen3-30b-a3b"),
            ("deepseek-v2-lite", "deepseek-v2-lite"),
            ("gemma-3-4b-it", "gemma-3-4b"),
            ("gpt2", "gpt2"),
        ] {
            let m = fixture(file);
            let published = catalog::lookup(entry)
                .and_then(|c| c.params)
                .expect("catalog entry") as f64;
            let derived = ParamCounts::of(&m.shape).total as f64;
            let err = (derived - published) / published;
            assert!(err.abs() < 0.02, "{file}: {derived} vs {published}");
        }
    }

    /// Found by the suite's mutation smoke run on a policy's `spec.models[].config`: a huge
    /// `hidden_size` overflowed `4·h` (computed even when `intermediate_size` was given) and the
    /// vision tower's products (a panic with overflow checks, a wrapped count in release). The
    /// sizes now saturate, and the estimator's sanity limits refuse such a shape.
    #[test]
    fn huge_sizes_saturate_instead_of_overflowing() {
        let huge = u64::MAX / 2;
        let m = parse(&format!(
            r#"{{"model_type": "llama", "hidden_size": {huge}, "num_hidden_layers": 2,
                "num_attention_heads": 2, "vocab_size": 10}}"#
        ))
        .expect("a shape, refused later by the estimator's limits");
        assert_eq!(m.shape.hidden_size, huge);
        assert_eq!(m.shape.intermediate_size, u64::MAX);
        let m = parse(&format!(
            r#"{{"model_type": "llava", "text_config": {{"model_type": "llama",
                "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                "vocab_size": 10}},
              "vision_config": {{"hidden_size": {huge}, "intermediate_size": {huge},
                "num_hidden_layers": 3, "patch_size": 14, "image_size": 4294967296}}}}"#
        ))
        .expect("parses");
        assert_eq!(m.shape.extra_params, 1 << 40, "capped, not wrapped");
    }

    #[test]
    fn shapes_quantization_and_dropout_come_from_the_config() {
        let q = fixture("qwen3-30b-a3b");
        assert_eq!((q.shape.num_experts, q.shape.experts_per_token), (128, 8));
        assert_eq!(q.shape.moe_intermediate_size, Some(768));
        assert_eq!(q.model_bits, None);
        assert_eq!(q.attention_dropout, Some(0.0));
        let ds = fixture("deepseek-v2-lite");
        assert_eq!(ds.shape.shared_experts, 2);
        assert_eq!(ds.shape.dense_layers, 1);
        assert_eq!(ds.shape.mla.and_then(|m| m.q_lora_rank), None);
        let bnb = fixture("llama-3-8b-bnb-4bit");
        assert_eq!((bnb.model_bits, bnb.double_quant), (Some(4), true));
        let g = fixture("gemma-3-4b-it");
        assert_eq!(g.shape.head_dim, Some(256));
        assert!(g.shape.tie_embeddings);
        let gpt2 = fixture("gpt2");
        assert!(!gpt2.shape.ffn_gated);
        assert_eq!(gpt2.shape.intermediate_size, 4 * 768);
        assert_eq!(gpt2.attention_dropout, Some(0.1));
        assert!(gpt2.shape.attention_dropout);
        assert!(!q.shape.attention_dropout);
        assert_eq!(gpt2.shape.norms, Norms::LayerNorm);
        assert_eq!(q.shape.norms, Norms::RmsNorm);
    }

    #[test]
    fn the_block_norms_follow_the_model_type_and_its_parallel_residual() {
        let norms = |extra: &str| {
            let text = format!(
                r#"{{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 256, "vocab_size": 100, {extra}}}"#
            );
            parse(&text).expect("valid config").shape.norms
        };
        assert_eq!(norms(r#""model_type": "phi""#), Norms::SharedLayerNorm);
        assert_eq!(
            norms(r#""model_type": "gpt_neox""#),
            Norms::ParallelLayerNorm
        );
        assert_eq!(
            norms(r#""model_type": "gpt_neox", "use_parallel_residual": false"#),
            Norms::LayerNorm
        );
        assert_eq!(norms(r#""model_type": "stablelm""#), Norms::LayerNorm);
        assert_eq!(
            norms(r#""model_type": "falcon", "new_decoder_architecture": true"#),
            Norms::ParallelLayerNorm
        );
        assert_eq!(norms(r#""model_type": "falcon""#), Norms::SharedLayerNorm);
        assert_eq!(norms(r#""model_type": "mistral""#), Norms::RmsNorm);
    }

    #[test]
    fn bad_configs_are_errors_naming_the_field() {
        let errors = |text: &str| parse(text).expect_err("must fail").join("; ");
        assert!(errors("[1, 2]").contains("not a JSON object"));
        assert!(errors("{").contains("not JSON"));
        let e = errors(r#"{"hidden_size": "4096", "num_hidden_layers": 2, "vocab_size": 10}"#);
        assert!(
            e.contains("hidden_size: `\"4096\"` is not a non-negative integer"),
            "{e}"
        );
        assert!(e.contains("num_attention_heads or n_head: missing"), "{e}");
        let base = r#""hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10"#;
        let e = errors(&format!(
            r#"{{{base}, "quantization_config": {{"quant_method": "magic"}}}}"#
        ));
        assert!(e.contains("quant_method: unknown `magic`"), "{e}");
        let e = errors(&format!(
            r#"{{{base}, "quantization_config": {{"quant_method": "gptq", "bits": 3}}}}"#
        ));
        assert!(e.contains("bits: 3 is not 4 or 8"), "{e}");
        let e = errors(&format!(r#"{{{base}, "attention_dropout": 2}}"#));
        assert!(e.contains("attention_dropout"), "{e}");
        let e = errors(&format!(r#"{{{base}, "num_local_experts": 8}}"#));
        assert!(e.contains("num_experts_per_tok"), "{e}");
    }
}
