use super::*;
use crate::PolicySpec;
use serde_json::json;

/// Qwen2.5-Coder-7B-Instruct's published `config.json` (not a built-in model).
fn coder_config() -> Value {
    let path = format!(
        "{}/fixtures/hf-config/qwen2.5-coder-7b-instruct.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("JSON")
}

/// Qwen2.5-Coder-7B's published parameter count (its model card: 7.61B).
const CODER_PARAMS: u64 = 7_615_616_512;

fn coder(name: &str) -> Value {
    json!({
        "name": name,
        "config": coder_config(),
        "params": CODER_PARAMS,
    })
}

/// [`coder`] with its Hugging Face id as an alias.
fn coder_with_alias(name: &str) -> Value {
    let mut entry = coder(name);
    entry["aliases"] = json!(["Qwen/Qwen2.5-Coder-7B-Instruct"]);
    entry
}

/// `spec.models` as a policy document carries it, resolved.
fn resolve(models: Value) -> Result<ModelCatalog, Vec<String>> {
    let spec: PolicySpec =
        serde_json::from_value(json!({ "models": models })).map_err(|e| vec![e.to_string()])?;
    spec.resolved().map(|p| p.models)
}

#[test]
fn a_policy_model_resolves_by_name_and_alias_in_any_case_before_the_built_in_catalog() {
    let models = resolve(json!([coder_with_alias("qwen2.5-coder-7b")])).expect("valid");
    assert!(models.notes().is_empty(), "{:?}", models.notes());
    for spelling in [
        "qwen2.5-coder-7b",
        "Qwen2.5-Coder-7B",
        "qwen2_5-coder-7b",
        "Qwen/Qwen2.5-Coder-7B-Instruct",
        "qwen/qwen2.5-coder-7b-instruct",
    ] {
        let found = models.lookup(spelling).expect(spelling);
        assert_eq!(found.source, Source::Policy, "{spelling}");
        assert_eq!(found.shape.name.as_deref(), Some("qwen2.5-coder-7b"));
        assert_eq!(found.shape.params, Some(CODER_PARAMS));
        assert_eq!(
            (found.shape.hidden_size, found.shape.num_kv_heads),
            (3584, 4)
        );
        assert_eq!(found.model_bits, None);
    }
    // The built-in catalog is still there behind it, and not for the built-in catalog alone.
    let builtin = models.lookup("meta-llama/Llama-3.1-8B").expect("built in");
    assert_eq!(builtin.source, Source::BuiltIn);
    assert!(ModelCatalog::default().lookup("qwen2.5-coder-7b").is_none());
}

#[test]
fn params_may_be_left_out_or_written_as_a_count() {
    let mut entry = coder("coder");
    entry.as_object_mut().expect("object").remove("params");
    let models = resolve(json!([entry])).expect("valid");
    assert_eq!(models.lookup("coder").expect("found").shape.params, None);
    entry["params"] = json!("7.6B");
    let models = resolve(json!([entry])).expect("valid");
    assert_eq!(
        models.lookup("coder").expect("found").shape.params,
        Some(7_600_000_000)
    );
}

#[test]
fn a_wrong_parameter_count_names_the_entry_and_both_figures() {
    let mut entry = coder("coder");
    // Llama-3-8B's count, as if the wrong model card had been read.
    entry["params"] = json!(8_030_261_248u64);
    let errors = resolve(json!([entry])).expect_err("5 % off");
    assert_eq!(errors.len(), 1, "{errors:?}");
    let e = &errors[0];
    assert!(
        e.starts_with("models[coder].params: published 8030261248"),
        "{e}"
    );
    let derived = memguard_estimator::params::ParamCounts::of(
        &hf_config::parse_object(coder_config().as_object().expect("object"))
            .expect("valid")
            .shape,
    )
    .total;
    assert!(e.contains(&format!("derives {derived}")), "{e}");
    assert!(e.contains("-5.2 %"), "{e}");
    for bad in [json!(0), json!(-7), json!("lots"), json!(7.5), json!([1])] {
        entry["params"] = bad.clone();
        let errors = resolve(json!([entry])).expect_err("not a count");
        assert!(
            errors[0].starts_with("models[coder].params: "),
            "{bad}: {errors:?}"
        );
    }
}

#[test]
fn a_misspelt_field_is_refused() {
    let mut entry = coder("coder");
    let config = entry["config"].take();
    entry["confg"] = config;
    let e = resolve(json!([entry])).expect_err("typo").join("; ");
    assert!(e.contains("unknown field `confg`"), "{e}");
    let mut entry = coder("coder");
    entry["alias"] = json!(["c"]);
    let e = resolve(json!([entry])).expect_err("typo").join("; ");
    assert!(e.contains("unknown field `alias`"), "{e}");
}

#[test]
fn a_bad_config_names_the_entry_and_the_config_field() {
    let mut entry = coder("coder");
    entry["config"]["hidden_size"] = json!("3584");
    entry["config"]
        .as_object_mut()
        .expect("object")
        .remove("vocab_size");
    let errors = resolve(json!([entry])).expect_err("bad config");
    assert!(
        errors.contains(
            &"models[coder].config.hidden_size: `\"3584\"` is not a non-negative integer"
                .to_string()
        ),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("models[coder].config.vocab_size: missing")),
        "{errors:?}"
    );
    let mut entry = coder("coder");
    entry["config"]["num_attention_heads"] = json!(27);
    let errors = resolve(json!([entry])).expect_err("heads do not divide the width");
    assert!(
        errors[0].starts_with("models[coder].config: num-heads"),
        "{errors:?}"
    );
    let mut entry = coder("coder");
    entry["config"] = json!("config.json");
    assert_eq!(
        resolve(json!([entry])),
        Err(vec![
            "models[coder].config: not an object (a Hugging Face config.json)".to_string()
        ])
    );
}

#[test]
fn quantization_comes_from_the_config() {
    let mut entry = coder("qwen2.5-coder-7b-gptq-int4");
    entry["config"]["quantization_config"] =
        json!({"quant_method": "gptq", "bits": 4, "group_size": 128});
    let models = resolve(json!([entry])).expect("valid");
    let found = models.lookup("qwen2.5-coder-7b-gptq-int4").expect("found");
    assert_eq!(found.model_bits, Some(4));
    entry["config"]["quantization_config"] = json!({"quant_method": "magic"});
    let errors = resolve(json!([entry])).expect_err("unknown method");
    assert!(
        errors[0].starts_with("models[qwen2.5-coder-7b-gptq-int4].config.quantization_config.quant_method: unknown `magic`"),
        "{errors:?}"
    );
}

#[test]
fn names_must_be_unique_whatever_their_case_or_separators() {
    let errors = resolve(json!([coder("coder"), coder("CODER")])).expect_err("duplicate");
    assert!(
        errors.iter().any(|e| e
            .starts_with("models[CODER].name: `CODER` is already a name of models[coder].name")),
        "{errors:?}"
    );
    // An alias that is another entry's name (here also both entries' identical alias).
    let mut other = coder("coder-2");
    other["aliases"] = json!(["Coder"]);
    let errors = resolve(json!([coder("coder"), other])).expect_err("alias collides");
    assert_eq!(
        errors,
        vec![
            "models[coder-2].aliases[0]: `Coder` is already a name of models[coder].name (names \
             compare case-insensitively, `_` and `.` as `-`)"
                .to_string()
        ]
    );
    let mut same_alias = coder("coder-2");
    same_alias["aliases"] = json!(["qwen/qwen2_5-coder-7b-instruct"]);
    let errors =
        resolve(json!([coder_with_alias("coder"), same_alias])).expect_err("alias collides");
    assert!(
        errors[0].contains("is already a name of models[coder].aliases[0]"),
        "{errors:?}"
    );
}

#[test]
fn names_are_plain_and_not_shape_keys() {
    for (name, why) in [
        ("", "models[0].name: must not be empty"),
        ("my model", "models[0].name: `my model` contains whitespace"),
        (
            "shape-7e9-32x4096",
            "models[0].name: `shape-7e9-32x4096`: names starting",
        ),
    ] {
        let errors = resolve(json!([coder(name)])).expect_err(name);
        assert!(errors[0].starts_with(why), "{name}: {errors:?}");
    }
}

/// A policy entry named like a built-in model wins over it, for every spelling of the built-in
/// model, and the policy says so; two entries cannot both shadow one built-in model.
#[test]
fn a_policy_model_named_like_a_built_in_one_shadows_it_with_a_note() {
    let entry = coder("llama-3-8b");
    let models = resolve(json!([entry.clone()])).expect("valid");
    for spelling in [
        "llama-3-8b",
        "llama3-8b",
        "meta-llama/Meta-Llama-3-8B-Instruct",
    ] {
        let found = models.lookup(spelling).expect(spelling);
        assert_eq!(found.source, Source::Policy, "{spelling}");
        assert_eq!(found.shape.hidden_size, 3584, "{spelling}");
    }
    assert_eq!(
        models.notes(),
        vec![
            "models[llama-3-8b] shadows the built-in model `llama-3-8b`: pods naming \
             `llama-3-8b` are planned with the policy's config"
                .to_string()
        ]
    );
    assert_eq!(
        models.lookup("llama-3.1-8b").map(|m| m.source),
        Some(Source::BuiltIn)
    );
    let mut second = coder("my-llama");
    second["aliases"] = json!(["meta-llama/Meta-Llama-3-8B"]);
    let errors = resolve(json!([entry, second])).expect_err("both shadow llama-3-8b");
    assert_eq!(
        errors,
        vec![
            "models[my-llama].aliases[0]: `meta-llama/Meta-Llama-3-8B` is the built-in model \
             `llama-3-8b`, which models[llama-3-8b] already shadows"
                .to_string()
        ]
    );
}

#[test]
fn every_problem_of_every_entry_is_reported_with_the_rest_of_the_policy() {
    let mut bad_params = coder("a");
    bad_params["params"] = json!(1_000);
    let spec: PolicySpec = serde_json::from_value(json!({
        "safetyRatio": 2,
        "models": [bad_params, coder("A"), coder("b")],
    }))
    .expect("shape");
    let errors = spec.resolved().expect_err("invalid");
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors[0].starts_with("safetyRatio"), "{errors:?}");
    assert!(errors[1].starts_with("models[a].params"), "{errors:?}");
    assert!(errors[2].starts_with("models[A].name"), "{errors:?}");
}

#[test]
fn the_unknown_model_message_says_where_it_looked() {
    assert!(
        ModelCatalog::default()
            .searched()
            .contains("adds no models")
    );
    let two = resolve(json!([coder("a"), {
        "name": "b", "config": coder_config()
    }]))
    .expect("valid");
    assert_eq!(
        two.searched(),
        "neither among the policy's 2 models nor in the built-in catalog"
    );
}

/// Issue 36: a quantized release beside a known base (AWQ, GPTQ `-Int4`/`-Int8`) resolves to
/// the base's shape at the release's storage bits; the chat and instruct variants of every base
/// resolve by one rule.
#[test]
fn quantized_releases_and_variants_resolve_to_their_base() {
    let catalog = ModelCatalog::default();
    let cases = [
        ("Qwen/Qwen2.5-7B-Instruct-AWQ", "qwen2.5-7b", Some(4)),
        ("Qwen/Qwen-7B-Chat-Int4", "qwen-7b", Some(4)),
        ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "qwen2.5-7b", Some(8)),
        ("mistralai/Mistral-7B-Instruct-v0.2", "mistral-7b", None),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b", None),
    ];
    for (id, name, bits) in cases {
        let r = catalog
            .lookup(id)
            .unwrap_or_else(|| panic!("{id} resolves"));
        assert_eq!(r.shape.name.as_deref(), Some(name), "{id}");
        assert_eq!(r.model_bits, bits, "{id}");
    }
    assert!(catalog.lookup("acme/Unknown-7B-AWQ").is_none());
}
