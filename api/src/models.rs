//! The models a pod may name in `memguard.io/model`: the policy's own (`spec.models`), then the
//! built-in catalog. [`ModelCatalog::lookup`] is the one lookup every part of memguard uses (the
//! webhook's decision, the profile key, the CLI), so a platform team adds a model to the policy
//! and every part knows it, without a release.
//!
//! A policy model is its Hugging Face `config.json`, read by [`crate::hf_config`] (one parser for
//! `--model-config` and the policy alike), with an optional published parameter count that the
//! shape must derive within [`PARAMS_TOLERANCE`]: a config pasted from the wrong model is caught
//! when the policy loads, not when a pod is planned with it.
//!
//! Names compare as the built-in catalog's do: case-insensitively, with `_`, `.` and spaces the
//! same as `-` ([`catalog::normalize`]). A policy name or alias that names a built-in model
//! *shadows* it: the policy's entry wins for every spelling of that built-in model, and the
//! policy carries a note saying so ([`ModelCatalog::notes`]). Rejecting such entries instead
//! would turn a policy invalid the day a release adds the same model to the catalog.

use crate::hf_config::{self, HfModel};
use memguard_estimator::params::ParamCounts;
use memguard_estimator::{ModelShape, TrainingConfig, catalog, parse_count};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// Largest relative difference between a policy model's published `params` and the count its
/// `config` derives (the built-in catalog's entries are held to the same 2 %).
pub const PARAMS_TOLERANCE: f64 = 0.02;
/// Longest model name or alias (a Kubernetes annotation value may be longer, but no model name is).
pub const MAX_NAME_LEN: usize = 253;
/// Prefix of the profile keys of models given by their shape (`shape-7e9-32x4096`); a policy
/// model named like one would share their profiles.
pub const RESERVED_PREFIX: &str = "shape-";

/// One model the policy adds (`spec.models[]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSpec {
    /// What pods write in `memguard.io/model`, e.g. `acme-coder-7b`. Compared case-insensitively,
    /// with `_` and `.` the same as `-`; unique among the policy's models.
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 253)))]
    pub name: String,
    /// Other names for the same model, e.g. its Hugging Face id `acme/Coder-7B-Instruct`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The model's Hugging Face `config.json`, as an object: the fields that decide memory are
    /// read (`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
    /// `intermediate_size`, `vocab_size`, experts, `head_dim`, `tie_word_embeddings`,
    /// `quantization_config`, `attention_dropout`, …) and every other field is ignored.
    #[cfg_attr(feature = "crd", schemars(schema_with = "config_schema"))]
    pub config: Value,
    /// The published parameter count (`7615616512`, or `"7.6B"`). When given, the count the
    /// config derives must be within 2 % of it, and the estimate uses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(schema_with = "params_schema"))]
    pub params: Option<Value>,
}

/// Any JSON object, kept whole by the API server (a `config.json` has dozens of fields).
#[cfg(feature = "crd")]
fn config_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    // The field's doc comment becomes the description.
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// An integer, or a string such as `7.6B`.
#[cfg(feature = "crd")]
fn params_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "x-kubernetes-int-or-string": true,
    })
}

/// Where a model name was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The policy's `spec.models`.
    Policy,
    /// memguard's built-in catalog.
    BuiltIn,
}

/// A model found by name: its shape, and the storage its `config.json` states.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// The shape; `name` is the entry's name (the profile key), `params` its published count.
    pub shape: ModelShape,
    /// Storage bits from `quantization_config` (`None`: not quantized, or a built-in model).
    pub model_bits: Option<u32>,
    /// bitsandbytes double quantization from `quantization_config`.
    pub double_quant: bool,
    /// Where it was found.
    pub source: Source,
}

/// One policy model, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyModel {
    /// Its name, as the policy spells it.
    pub name: String,
    /// Its aliases, as the policy spells them.
    pub aliases: Vec<String>,
    /// Its config, read; `shape.name` is [`Self::name`].
    pub model: HfModel,
    /// The built-in model it shadows, if any (canonical catalog name).
    pub shadows: Option<String>,
}

/// The built-in catalog with a policy's models in front of it. [`Default`]: built-in only.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelCatalog {
    models: Vec<PolicyModel>,
    /// Normalized policy name or alias → index into `models`.
    by_name: BTreeMap<String, usize>,
    /// Canonical built-in name → index of the policy model that shadows it.
    shadowed: BTreeMap<String, usize>,
}

impl ModelCatalog {
    /// Checks `specs` (the policy's `spec.models`) and puts them in front of the built-in
    /// catalog. Returns every problem, each naming the entry (`models[<name>]`) and the field.
    pub fn from_specs(specs: &[ModelSpec]) -> Result<Self, Vec<String>> {
        let mut errors = Vec::new();
        let mut catalog = ModelCatalog::default();
        // Normalized name → the label of the entry (and field) that claimed it first.
        let mut claimed: BTreeMap<String, String> = BTreeMap::new();
        let mut shadow_claims: BTreeMap<String, String> = BTreeMap::new();
        for (i, spec) in specs.iter().enumerate() {
            let label = entry_label(i, &spec.name);
            let before = errors.len();
            let mut names = vec![(format!("{label}.name"), spec.name.as_str())];
            names.extend(
                spec.aliases
                    .iter()
                    .enumerate()
                    .map(|(j, a)| (format!("{label}.aliases[{j}]"), a.as_str())),
            );
            let mut shadows: Option<String> = None;
            for (field, name) in &names {
                if let Err(why) = check_name(name) {
                    errors.push(format!("{field}: {why}"));
                    continue;
                }
                let key = catalog::normalize(name);
                if let Some(first) = claimed.get(&key) {
                    errors.push(format!(
                        "{field}: `{name}` is already a name of {first} (names compare \
                         case-insensitively, `_` and `.` as `-`)"
                    ));
                    continue;
                }
                claimed.insert(key, field.clone());
                if let Some(builtin) = catalog::lookup(name).and_then(|m| m.name) {
                    match (&shadows, shadow_claims.get(&builtin)) {
                        (_, Some(other)) => errors.push(format!(
                            "{field}: `{name}` is the built-in model `{builtin}`, which {other} \
                             already shadows"
                        )),
                        (Some(mine), None) if *mine != builtin => errors.push(format!(
                            "{field}: `{name}` is the built-in model `{builtin}`, but this entry \
                             already shadows `{mine}`: one entry shadows one built-in model"
                        )),
                        _ => shadows = Some(builtin),
                    }
                }
            }
            if let Some(builtin) = &shadows {
                shadow_claims.insert(builtin.clone(), label.clone());
            }
            let model = match read_config(&label, spec) {
                Ok(model) => model,
                Err(problems) => {
                    errors.extend(problems);
                    continue;
                }
            };
            if errors.len() > before {
                continue;
            }
            let index = catalog.models.len();
            for (_, name) in &names {
                catalog.by_name.insert(catalog::normalize(name), index);
            }
            if let Some(builtin) = &shadows {
                catalog.shadowed.insert(builtin.clone(), index);
            }
            catalog.models.push(PolicyModel {
                name: spec.name.clone(),
                aliases: spec.aliases.clone(),
                model,
                shadows,
            });
        }
        if errors.is_empty() {
            Ok(catalog)
        } else {
            Err(errors)
        }
    }

    /// The model `name` names: a policy model by name or alias, else a built-in model (by every
    /// spelling [`catalog::lookup`] accepts), unless a policy model shadows it.
    pub fn lookup(&self, name: &str) -> Option<Resolved> {
        if let Some(&i) = self.by_name.get(&catalog::normalize(name)) {
            return Some(self.resolved(i));
        }
        let (builtin, model_bits) = match catalog::lookup(name) {
            Some(shape) => (shape, None),
            None => {
                let (base, bits) = quantized_base(name)?;
                (catalog::lookup(&base)?, Some(bits))
            }
        };
        if let Some(&i) = builtin.name.as_ref().and_then(|n| self.shadowed.get(n)) {
            return Some(self.resolved(i));
        }
        Some(Resolved {
            shape: builtin,
            model_bits,
            double_quant: false,
            source: Source::BuiltIn,
        })
    }

    fn resolved(&self, i: usize) -> Resolved {
        let m = &self.models[i];
        Resolved {
            shape: m.model.shape.clone(),
            model_bits: m.model.model_bits,
            double_quant: m.model.double_quant,
            source: Source::Policy,
        }
    }

    /// The policy's models, in the policy's order.
    pub fn policy_models(&self) -> &[PolicyModel] {
        &self.models
    }

    /// What a person should know about this catalog: each built-in model a policy model
    /// shadows.
    pub fn notes(&self) -> Vec<String> {
        self.models
            .iter()
            .filter_map(|m| {
                m.shadows.as_ref().map(|b| {
                    format!(
                        "models[{}] shadows the built-in model `{b}`: pods naming `{b}` are \
                         planned with the policy's config",
                        m.name
                    )
                })
            })
            .collect()
    }

    /// How the "unknown model" error says where it looked.
    pub fn searched(&self) -> String {
        match self.models.len() {
            0 => "not in the built-in catalog, and the policy adds no models".to_string(),
            1 => "neither the policy's model nor in the built-in catalog".to_string(),
            n => format!("neither among the policy's {n} models nor in the built-in catalog"),
        }
    }
}

/// `models[<name>]`, or `models[<index>]` for an entry without a usable name.
fn entry_label(index: usize, name: &str) -> String {
    if check_name(name).is_ok() {
        format!("models[{name}]")
    } else {
        format!("models[{index}]")
    }
}

/// A name pods can write: not blank, no whitespace or control characters, not too long, not a
/// shape key.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("`{name}` contains whitespace"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!("longer than {MAX_NAME_LEN} characters"));
    }
    if catalog::normalize(name).starts_with(RESERVED_PREFIX) {
        return Err(format!(
            "`{name}`: names starting `{RESERVED_PREFIX}` are the profile keys of models given by \
             their shape"
        ));
    }
    Ok(())
}

/// The entry's `config` read by [`hf_config`], checked as a model, and its `params` against the
/// count the shape derives.
fn read_config(label: &str, spec: &ModelSpec) -> Result<HfModel, Vec<String>> {
    let Some(object) = spec.config.as_object() else {
        return Err(vec![format!(
            "{label}.config: not an object (a Hugging Face config.json)"
        )]);
    };
    let mut model = hf_config::parse_object(object).map_err(|problems| {
        problems
            .into_iter()
            .map(|p| format!("{label}.config.{p}"))
            .collect::<Vec<_>>()
    })?;
    if let Err(problems) = TrainingConfig::new(model.shape.clone()).validate() {
        return Err(problems
            .into_iter()
            .map(|e| format!("{label}.config: {e}"))
            .collect());
    }
    let published = match &spec.params {
        None => None,
        Some(v) => Some(params_value(v).map_err(|why| vec![format!("{label}.params: {why}")])?),
    };
    if let Some(published) = published {
        let derived = ParamCounts::of(&model.shape).total;
        let off = (derived as f64 - published as f64) / published as f64;
        if off.abs() > PARAMS_TOLERANCE {
            return Err(vec![format!(
                "{label}.params: published {published}, but the config derives {derived} \
                 ({:+.1} %, more than {} %): is `config` this model's config.json?",
                off * 100.0,
                PARAMS_TOLERANCE * 100.0
            )]);
        }
        model.shape.params = Some(published);
    }
    model.shape.name = Some(spec.name.clone());
    Ok(model)
}

/// `7615616512`, `7.6e9` or `"7.6B"`: a positive count.
fn params_value(v: &Value) -> Result<u64, String> {
    let n = match v {
        Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(n), _) => n,
            (None, Some(f)) if f >= 1.0 && f.fract() == 0.0 && f < u64::MAX as f64 => f as u64,
            _ => return Err(format!("`{n}` is not a whole positive count")),
        },
        Value::String(s) => parse_count(s).map_err(|e| e.to_string())?,
        other => {
            return Err(format!(
                "`{other}` is not a count (`7615616512` or `\"7.6B\"`)"
            ));
        }
    };
    if n == 0 {
        return Err("must be more than 0".into());
    }
    Ok(n)
}

/// The quantized releases' suffixes and the storage bits they mean: AWQ and GPTQ checkpoints
/// published beside a base (`Qwen/Qwen2.5-7B-Instruct-AWQ`, `Qwen/Qwen-7B-Chat-Int4`,
/// `…-GPTQ-Int8`), whose shape is the base's.
const QUANTIZED_SUFFIXES: &[(&str, u32)] = &[
    ("-gptq-int4", 4),
    ("-gptq-int8", 8),
    ("-awq", 4),
    ("-gptq", 4),
    ("-int4", 4),
    ("-int8", 8),
    ("-bnb-4bit", 4),
];

/// A quantized release's base name and storage bits ([`QUANTIZED_SUFFIXES`]).
fn quantized_base(name: &str) -> Option<(String, u32)> {
    let key = catalog::normalize(name);
    QUANTIZED_SUFFIXES
        .iter()
        .find_map(|(suffix, bits)| key.strip_suffix(suffix).map(|b| (b.to_string(), *bits)))
}

#[cfg(test)]
mod tests;
