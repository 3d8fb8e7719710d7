//! The generated CRDs: fresh in `crds/` and in the chart, shaped as people depend on, and valid
//! Kubernetes 1.33 objects.

use memguard_api::crd::{self, CustomResourceExt, MemguardPolicy, MemoryProfile};
use memguard_api::wellknown;
use memguard_e2e::{
    kubernetes_validate, python_with_jsonschema, validate_against_crd, validate_manifests,
    workspace_root,
};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

const REGENERATE: &str =
    "run `cargo run -p memguard -- crdgen --out crds && cp crds/*.yaml charts/memguard/crds/`";

fn yaml_files(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}; {REGENERATE}", dir.display()))
        .map(|e| {
            e.expect("readable entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".yaml"))
        .collect()
}

#[test]
fn checked_in_crds_match_the_rust_types_byte_for_byte() {
    let rendered = crd::render().expect("CRDs render");
    let expected: BTreeSet<String> = rendered.iter().map(|(n, _)| n.clone()).collect();
    for dir in ["crds", "charts/memguard/crds"] {
        let dir = workspace_root().join(dir);
        assert_eq!(
            yaml_files(&dir),
            expected,
            "{} holds other files than the generated CRDs; {REGENERATE}",
            dir.display()
        );
        for (name, text) in &rendered {
            let path = dir.join(name);
            let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                on_disk == *text,
                "{} is stale (differs from the Rust types); {REGENERATE}",
                path.display()
            );
        }
    }
}

#[test]
fn rendering_is_deterministic_and_starts_with_the_header() {
    let a = crd::render().expect("renders");
    let b = crd::render().expect("renders");
    assert_eq!(a, b);
    for (name, text) in &a {
        assert!(text.starts_with(crd::GENERATED_HEADER), "{name}");
        assert_eq!(
            text.matches("\n---").count(),
            0,
            "{name}: one document per file"
        );
    }
}

/// The CRDs as JSON, by kind.
fn crds_by_kind() -> std::collections::BTreeMap<String, Value> {
    crd::crds()
        .iter()
        .map(|c| {
            let v = serde_json::to_value(c).expect("a CRD serializes");
            (
                v["spec"]["names"]["kind"]
                    .as_str()
                    .expect("kind")
                    .to_string(),
                v,
            )
        })
        .collect()
}

fn printer_columns(version: &Value) -> Vec<(String, String, String)> {
    version["additionalPrinterColumns"]
        .as_array()
        .expect("printer columns")
        .iter()
        .map(|c| {
            let s = |k: &str| c[k].as_str().expect("string field").to_string();
            (s("name"), s("type"), s("jsonPath"))
        })
        .collect()
}

fn col(name: &str, ty: &str, path: &str) -> (String, String, String) {
    (name.into(), ty.into(), path.into())
}

#[test]
fn memguard_policy_is_cluster_scoped_with_the_policy_document_as_spec() {
    let crds = crds_by_kind();
    let p = &crds["MemguardPolicy"];
    assert_eq!(
        p["metadata"]["name"],
        "memguardpolicies.training.memguard.io"
    );
    assert_eq!(p["spec"]["group"], wellknown::GROUP);
    assert_eq!(p["spec"]["scope"], "Cluster");
    assert_eq!(
        p["spec"]["names"]["shortNames"],
        serde_json::json!(["mgpol"])
    );
    let versions = p["spec"]["versions"].as_array().expect("versions");
    assert_eq!(versions.len(), 1);
    let v = &versions[0];
    assert_eq!(v["name"], crd::VERSION);
    assert_eq!(
        (v["served"].as_bool(), v["storage"].as_bool()),
        (Some(true), Some(true))
    );
    assert!(v.get("subresources").is_none(), "a policy has no status");
    let spec = &v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    for field in [
        "safetyRatio",
        "defaultGpuMemory",
        "gpuMemory",
        "sidecar",
        "thresholds",
        "envNames",
        "floors",
        "placement",
    ] {
        assert!(
            spec.get(field).is_some(),
            "spec.{field} missing from the schema"
        );
    }
    assert_eq!(
        spec["sidecar"]["properties"]["mode"]["enum"],
        serde_json::json!(["native", "classic"])
    );
    assert_eq!(
        spec["placement"]["enum"],
        serde_json::json!(["off", "preferred", "required"])
    );
    assert_eq!(
        printer_columns(v),
        vec![
            col("Safety", "number", ".spec.safetyRatio"),
            col("Default GPU", "string", ".spec.defaultGpuMemory"),
            col("Sidecar", "string", ".spec.sidecar.mode"),
            col("Age", "date", ".metadata.creationTimestamp"),
        ]
    );
    assert_eq!(
        MemguardPolicy::crd_name(),
        "memguardpolicies.training.memguard.io"
    );
}

/// The schema refuses a sidecar setting of the wrong kind before the webhook ever sees it (the
/// webhook checks again at load: `api::policy`).
#[test]
fn the_policy_schema_refuses_sidecar_settings_that_are_not_what_they_say() {
    let Some(python) = python_with_jsonschema() else {
        return;
    };
    let schema =
        crds_by_kind()["MemguardPolicy"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            .clone();
    let policy = |spec: Value| {
        serde_json::json!({
            "apiVersion": "training.memguard.io/v1alpha1",
            "kind": "MemguardPolicy",
            "metadata": {"name": "default"},
            "spec": spec,
        })
    };
    for good in [
        serde_json::json!({"sidecar": {"interval": "100ms"}}),
        serde_json::json!({"sidecar": {"interval": "1m30s"}, "thresholds": {"warn": 0.5}}),
        serde_json::json!({"thresholds": {"psiSomeAvg10": 100}}),
    ] {
        validate_against_crd(&python, &schema, &policy(good.clone()))
            .unwrap_or_else(|e| panic!("{good} refused: {e}"));
    }
    for bad in [
        serde_json::json!({"sidecar": {"interval": "10 parsecs"}}),
        serde_json::json!({"sidecar": {"interval": "fast"}}),
        serde_json::json!({"thresholds": {"warn": 70}}),
        serde_json::json!({"thresholds": {"critical": 1.5}}),
        serde_json::json!({"thresholds": {"psiSomeAvg10": -1}}),
        serde_json::json!({"safetyRatio": 1.5}),
    ] {
        assert!(
            validate_against_crd(&python, &schema, &policy(bad.clone())).is_err(),
            "{bad} accepted by the CRD schema"
        );
    }
}

/// Issue 38: the API server refuses a size without a unit (`kubectl apply` of
/// `defaultGpuMemory: "24"`) by the parser's own pattern, before the webhook sees it.
#[test]
fn the_policy_schema_refuses_sizes_without_a_unit() {
    let Some(python) = python_with_jsonschema() else {
        return;
    };
    let schema =
        crds_by_kind()["MemguardPolicy"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            .clone();
    let spec = &schema["properties"]["spec"]["properties"];
    assert_eq!(
        spec["defaultGpuMemory"]["pattern"],
        memguard_api::quantity::SIZE_PATTERN
    );
    let policy = |spec: Value| {
        serde_json::json!({"apiVersion": "training.memguard.io/v1alpha1", "kind": "MemguardPolicy",
            "metadata": {"name": "default"}, "spec": spec})
    };
    for (spec, valid) in [
        (serde_json::json!({"defaultGpuMemory": "24Gi"}), true),
        (serde_json::json!({"defaultGpuMemory": "24GiB"}), true),
        (
            serde_json::json!({"gpuMemory": {"NVIDIA-A10G": "22Gi"}}),
            true,
        ),
        (serde_json::json!({"defaultGpuMemory": "24"}), false),
        (serde_json::json!({"defaultGpuMemory": "0Gi"}), false),
        (
            serde_json::json!({"gpuMemory": {"NVIDIA-A10G": "22"}}),
            false,
        ),
    ] {
        let schema_says = validate_against_crd(&python, &schema, &policy(spec.clone())).is_ok();
        let webhook_says = serde_json::from_value::<memguard_api::PolicySpec>(spec.clone())
            .expect("shape")
            .resolved()
            .is_ok();
        assert_eq!((schema_says, webhook_says), (valid, valid), "{spec}");
    }
}

/// Issue 38: memory-guard v0.6.0 ships `memguardpolicies.memguard.io`; ours live in a group
/// nothing else uses, so one cluster holds both. The annotation prefix stays `memguard.io/`.
#[test]
fn the_crds_live_in_a_group_of_their_own() {
    assert_eq!(wellknown::GROUP, "training.memguard.io");
    for (name, text) in crd::render().expect("renders") {
        assert!(name.ends_with(".training.memguard.io.yaml"), "{name}");
        assert!(text.contains("group: training.memguard.io\n"), "{name}");
    }
    assert_ne!(MemguardPolicy::crd_name(), "memguardpolicies.memguard.io");
    assert_eq!(memguard_api::annotations::PREFIX, "memguard.io/");
}

#[test]
fn memory_profile_is_namespaced_with_status_subresource_and_useful_columns() {
    let crds = crds_by_kind();
    let p = &crds["MemoryProfile"];
    assert_eq!(p["metadata"]["name"], "memoryprofiles.training.memguard.io");
    assert_eq!(p["spec"]["group"], wellknown::GROUP);
    assert_eq!(p["spec"]["scope"], "Namespaced");
    assert_eq!(
        p["spec"]["names"]["shortNames"],
        serde_json::json!(["mgprof"])
    );
    let v = &p["spec"]["versions"][0];
    assert_eq!(v["name"], crd::VERSION);
    assert_eq!(v["subresources"]["status"], serde_json::json!({}));
    assert_eq!(
        printer_columns(v),
        vec![
            col("Model", "string", ".spec.model"),
            col("Method", "string", ".spec.method"),
            col("Device", "string", ".spec.device"),
            col("Runs", "integer", ".status.runCount"),
            col("Factor", "number", ".status.medianCorrectionFactor"),
            col("Last OOM", "date", ".status.lastOomAt"),
            col("Age", "date", ".metadata.creationTimestamp"),
        ]
    );
    let root = &v["schema"]["openAPIV3Schema"]["properties"];
    // Every printer column points at a field of the schema.
    for (name, _, path) in printer_columns(v) {
        if path.starts_with(".metadata") {
            continue;
        }
        let mut node = root;
        for seg in path.trim_start_matches('.').split('.') {
            node = &node[seg];
            assert!(
                !node.is_null(),
                "column {name}: {path} is not in the schema"
            );
            if node.get("properties").is_some() {
                node = &node["properties"];
            }
        }
    }
    let status = &root["status"]["properties"];
    assert_eq!(status["runs"]["maxItems"], crd::MAX_RUNS);
    assert_eq!(status["oomEvents"]["maxItems"], crd::MAX_OOM_EVENTS);
    // What a trainer reports is bounded whatever its client sends (issue 37).
    let report = &status["trainerReport"]["properties"];
    assert_eq!(report["config"]["maxProperties"], crd::MAX_REPORTED_KNOBS);
    assert_eq!(report["mismatch"]["maxItems"], crd::MAX_REPORTED_KNOBS);
    assert_eq!(
        report["mismatch"]["items"]["maxLength"],
        crd::MAX_KNOB_NAME_LEN
    );
    assert_eq!(
        status["oomKillPhases"]["properties"]
            .as_object()
            .map(|p| p.keys().cloned().collect::<Vec<_>>()),
        Some(vec!["load".into(), "save".into(), "step".into()])
    );
    assert!(
        root["spec"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("which model")),
        "doc comments become descriptions"
    );
    assert_eq!(
        MemoryProfile::crd_name(),
        "memoryprofiles.training.memguard.io"
    );
}

#[test]
fn crds_are_valid_kubernetes_1_33_objects() {
    let Some(tool) = kubernetes_validate() else {
        return;
    };
    let files: Vec<_> = crd::render()
        .expect("renders")
        .into_iter()
        .map(|(name, _)| workspace_root().join("crds").join(name))
        .collect();
    if let Err(out) = validate_manifests(&tool, &files) {
        panic!("kubernetes-validate rejected the CRDs:\n{out}");
    }
}

/// The schema accepts each placement mode and rejects a misspelt mode or field name, as the API
/// server does (strict field validation closes every object).
#[test]
fn the_policy_schema_rejects_placement_typos() {
    let Some(python) = memguard_e2e::python_with_jsonschema() else {
        return;
    };
    let crds = crds_by_kind();
    let schema = &crds["MemguardPolicy"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let doc = |spec: Value| {
        serde_json::json!({"apiVersion": "training.memguard.io/v1alpha1", "kind": "MemguardPolicy",
            "metadata": {"name": "default"}, "spec": spec})
    };
    for mode in ["off", "preferred", "required"] {
        let ok = memguard_e2e::validate_against_crd(
            &python,
            schema,
            &doc(serde_json::json!({"placement": mode})),
        );
        assert!(ok.is_ok(), "{mode}: {ok:?}");
    }
    for (bad, why) in [
        (serde_json::json!({"placement": "requried"}), "placement"),
        (serde_json::json!({"placment": "required"}), "placment"),
    ] {
        let err = memguard_e2e::validate_against_crd(&python, schema, &doc(bad.clone()))
            .expect_err(&format!("{bad} must be rejected"));
        assert!(err.contains(why), "{bad}: {err}");
    }
}

/// `spec.models`: an entry with a whole `config.json` (every field kept) is accepted; a misspelt
/// or missing field, a blank name and a `config` that is not an object are rejected, as the API
/// server rejects them (the webhook checks the rest at load: `api::models`).
#[test]
fn the_policy_schema_takes_models_with_a_whole_config_and_rejects_typos() {
    let Some(python) = python_with_jsonschema() else {
        return;
    };
    let crds = crds_by_kind();
    let version = &crds["MemguardPolicy"]["spec"]["versions"][0];
    let schema = &version["schema"]["openAPIV3Schema"];
    let models = &schema["properties"]["spec"]["properties"]["models"];
    assert_eq!(models["x-kubernetes-list-type"], "map", "names unique");
    assert_eq!(
        models["x-kubernetes-list-map-keys"],
        serde_json::json!(["name"])
    );
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(
            workspace_root().join("api/fixtures/hf-config/qwen2.5-coder-7b-instruct.json"),
        )
        .expect("fixture"),
    )
    .expect("JSON");
    let doc = |entry: Value| {
        serde_json::json!({"apiVersion": "training.memguard.io/v1alpha1", "kind": "MemguardPolicy",
            "metadata": {"name": "default"}, "spec": {"models": [entry]}})
    };
    let entry = serde_json::json!({"name": "acme-coder-7b", "aliases": ["Qwen/Qwen2.5-Coder-7B-Instruct"],
        "config": config, "params": 7_615_616_512u64});
    let mut as_text = entry.clone();
    as_text["params"] = serde_json::json!("7.6B");
    for good in [entry.clone(), as_text] {
        validate_against_crd(&python, schema, &doc(good.clone()))
            .unwrap_or_else(|e| panic!("{good} refused: {e}"));
    }
    let with = |field: &str, value: Value| {
        let mut e = entry.clone();
        e[field] = value;
        e
    };
    let without = |field: &str| {
        let mut e = entry.clone();
        e.as_object_mut().expect("object").remove(field);
        e
    };
    for (bad, why) in [
        (with("confg", serde_json::json!({})), "confg"),
        (with("alias", serde_json::json!(["x"])), "alias"),
        (without("config"), "config"),
        (without("name"), "name"),
        (with("name", serde_json::json!("")), "name"),
        (with("config", serde_json::json!("config.json")), "config"),
    ] {
        let err = validate_against_crd(&python, schema, &doc(bad.clone()))
            .expect_err(&format!("{bad} must be rejected"));
        assert!(err.contains(why), "{bad}: {err}");
    }
}
