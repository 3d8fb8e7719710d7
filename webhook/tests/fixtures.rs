//! Golden patches: every pod under `tests/fixtures/pods/` is mutated under
//! `tests/fixtures/policy.yaml`, and the outcome and patch are compared with the YAML snapshot
//! in `tests/snapshots/`. Byte counts that come from the estimator are redacted, so a change in
//! the memory model only shows here when it changes a decision (a step, a knob value).
//! Review changes with `cargo insta review -p memguard-webhook`.

use json_patch::Patch;
use k8s_openapi::api::core::v1::Pod;
use memguard_api::annotations as keys;
use memguard_api::{Policy, env, wellknown};
use memguard_webhook::policy_sources::{Overrides, policy_from_str};
use memguard_webhook::{ClusterView, Outcome, mutate, patch};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn policy() -> Policy {
    let text = std::fs::read_to_string(fixtures().join("policy.yaml")).expect("policy fixture");
    policy_from_str(Some(&text), &Overrides::default()).expect("valid policy fixture")
}

/// Estimator byte counts → `[bytes]`, wherever they appear in the patch.
fn redact(value: &mut Value) {
    const BYTE_VARS: [&str; 2] = [env::ESTIMATE_BYTES, env::BUDGET_BYTES];
    match value {
        Value::Object(map) => {
            if let Some(name) = map.get("name").and_then(Value::as_str)
                && BYTE_VARS.contains(&name)
                && map.contains_key("value")
            {
                map.insert("value".into(), json!("[bytes]"));
            }
            for (key, v) in map.iter_mut() {
                if ["total", "upper", "tensorPeak", "uncalibrated"].contains(&key.as_str())
                    && v.is_number()
                {
                    *v = json!("[bytes]");
                } else {
                    redact(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        _ => {}
    }
}

/// The patch as YAML-friendly JSON, with the estimate annotation shown parsed.
fn readable(patch: &Patch) -> Value {
    let mut v = serde_json::to_value(patch).expect("patch serializes");
    for op in v.as_array_mut().into_iter().flatten() {
        let path = op["path"].as_str().unwrap_or_default().to_string();
        if path.ends_with("memguard.io~1estimate") {
            let parsed: Value =
                serde_json::from_str(op["value"].as_str().expect("string")).expect("JSON");
            op["value"] = parsed;
        } else if path == "/metadata/annotations"
            && let Some(s) = op["value"][keys::ESTIMATE].as_str()
        {
            op["value"][keys::ESTIMATE] = serde_json::from_str(s).expect("JSON");
        }
    }
    redact(&mut v);
    v
}

#[test]
fn fixture_pods_match_their_golden_patches() {
    let policy = policy();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(fixtures().join("pods"))
        .expect("fixtures dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 6, "fixtures missing: {paths:?}");
    for path in paths {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("name")
            .to_string();
        let text = std::fs::read_to_string(&path).expect("fixture");
        let original: Value = serde_saphyr::from_str(&text).expect("fixture YAML");
        let pod: Pod = serde_json::from_value(original.clone()).expect("fixture is a Pod");

        let outcome = mutate(&pod, &policy, &ClusterView::default());
        let patch = patch::build(&pod, &outcome);

        // The result is still a pod, and the sidecar keeps restartPolicy Always.
        let mut applied = original.clone();
        json_patch::patch(&mut applied, &patch).expect("patch applies");
        let mutated: Pod = serde_json::from_value(applied.clone()).expect("still a Pod");
        if let Outcome::Mutated(_) = &outcome {
            let sidecar = mutated
                .spec
                .as_ref()
                .and_then(|s| s.init_containers.as_ref())
                .and_then(|l| l.iter().find(|c| c.name == wellknown::SIDECAR_CONTAINER))
                .expect("native sidecar");
            assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"), "{name}");
        }
        // A second call changes nothing.
        let again = patch::build(
            &mutated,
            &mutate(&mutated, &policy, &ClusterView::default()),
        );
        assert!(again.0.is_empty(), "{name}: second patch {again:?}");

        let summary = match &outcome {
            Outcome::Unchanged => json!({"outcome": "unchanged"}),
            Outcome::Skipped { error, warning } => {
                json!({"outcome": "skipped", "error": error, "warnings": [warning]})
            }
            Outcome::Mutated(m) => json!({
                "outcome": "mutated",
                "trainer": m.trainer,
                "budget": m.budget.as_ref().map(|b| json!({
                    "deviceMemory": b.device_memory.to_string(),
                    "safetyRatio": b.safety_ratio,
                    "source": b.source,
                })),
                "steps": m.plan.steps.iter().map(|s| s.rung.name()).collect::<Vec<_>>(),
                "warningCount": m.warnings.len(),
            }),
            Outcome::Guarded(g) => json!({
                "outcome": "guarded",
                "error": g.reason,
                "warnings": g.warnings,
            }),
            Outcome::Served(s) => json!({
                "outcome": "served",
                "container": s.container,
                "engine": s.engine.name(),
                "error": s.error,
            }),
        };
        let snapshot = json!({"decision": summary, "patch": readable(&patch)});
        insta::assert_yaml_snapshot!(name, snapshot);
    }
}

/// The accelerator fixtures' expectations (`tests/fixtures/accelerators.yaml`), shared with the
/// CLI's test: device, budget source kind, memory of one device, and a warning that must be
/// there.
#[test]
fn accelerator_fixtures_get_their_device_budget_and_source() {
    let policy = policy();
    let text = std::fs::read_to_string(fixtures().join("accelerators.yaml")).expect("table");
    let table: serde_json::Map<String, Value> = serde_saphyr::from_str(&text).expect("YAML");
    assert!(table.len() >= 9, "{table:?}");
    for (file, want) in table {
        let text = std::fs::read_to_string(fixtures().join("pods").join(&file)).expect(&file);
        let pod: Pod = serde_saphyr::from_str(&text).expect("a Pod");
        let Outcome::Mutated(m) = mutate(&pod, &policy, &ClusterView::default()) else {
            panic!("{file}: not mutated");
        };
        let estimate: Value = serde_json::from_str(&m.estimate.to_json()).expect("JSON");
        if want["source"] == "none" {
            assert!(m.budget.is_none(), "{file}: {:?}", m.budget);
            for key in ["budget", "fits", "budgetSource", "gpuMemory"] {
                assert!(estimate[key].is_null(), "{file}: {key} in {estimate}");
            }
            let w = want["warning"].as_str().expect("a warning");
            assert!(
                m.warnings.iter().any(|x| x.contains(w)),
                "{file}: {:?}",
                m.warnings
            );
            continue;
        }
        let b = m.budget.as_ref().expect("a budget");
        assert_eq!(estimate["device"], want["device"], "{file}");
        assert_eq!(estimate["budgetSource"]["kind"], want["source"], "{file}");
        assert_eq!(
            Some(b.device_memory.0),
            want["deviceMemory"].as_u64(),
            "{file}"
        );
        assert_eq!(estimate["budget"].as_u64(), Some(b.bytes.0), "{file}");
        match want["warning"].as_str() {
            Some(w) => assert!(
                m.warnings.iter().any(|x| x.contains(w)),
                "{file}: {:?}",
                m.warnings
            ),
            None => assert!(
                !m.warnings
                    .iter()
                    .any(|x| x.contains("ignored") || x.contains("unknown")),
                "{file}: {:?}",
                m.warnings
            ),
        }
    }
}

/// Placement's merged affinity, in both modes, is a valid pod for the Kubernetes schema
/// (`kubernetes-validate --strict`), keeps the user's terms, and under `required` the budget is
/// the smallest node the affinity allows.
#[test]
fn placement_affinity_is_valid_kubernetes_and_keeps_the_users_terms() {
    let Some(tool) = memguard_e2e::kubernetes_validate() else {
        return;
    };
    let text =
        std::fs::read_to_string(fixtures().join("pods/placement-unpinned.yaml")).expect("fixture");
    let original: Value = serde_saphyr::from_str(&text).expect("YAML");
    let pod: Pod = serde_json::from_value(original.clone()).expect("a Pod");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut files = Vec::new();
    for mode in ["preferred", "required"] {
        let policy = policy_from_str(Some(&format!("placement: {mode}")), &Overrides::default())
            .expect("valid policy");
        let outcome = mutate(&pod, &policy, &ClusterView::default());
        let Outcome::Mutated(m) = &outcome else {
            panic!("{mode}: {outcome:?}");
        };
        let source =
            serde_json::to_value(&m.budget.as_ref().expect("budget").source).expect("JSON");
        let expected_kind = if mode == "required" {
            "placement"
        } else {
            "policy-default"
        };
        assert_eq!(source["kind"], expected_kind, "{mode}");
        let mut applied = original.clone();
        json_patch::patch(&mut applied, &patch::build(&pod, &outcome)).expect("applies");
        let na = &applied["spec"]["affinity"]["nodeAffinity"];
        let user_required = &original["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchExpressions"][0];
        assert_eq!(
            &na["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
                [0],
            user_required,
            "{mode}"
        );
        let user_preferred = &original["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            [0];
        assert_eq!(
            &na["preferredDuringSchedulingIgnoredDuringExecution"][0], user_preferred,
            "{mode}"
        );
        assert!(
            applied.to_string().contains("nvidia.com/gpu.memory"),
            "{mode}: {applied}"
        );
        let file = dir.path().join(format!("{mode}.yaml"));
        std::fs::write(&file, applied.to_string()).expect("write");
        files.push(file);
    }
    if let Err(out) = memguard_e2e::validate_manifests(&tool, &files) {
        panic!("kubernetes-validate rejected the placed pods:\n{out}");
    }
}

/// The DRA fixture pods (`tests/fixtures/dra/`) with `dra/objects.yaml` as the catalog, as
/// the webhook's watch caches would hold it: each gets its device, budget source, memory and
/// warning (`dra.yaml`, shared with the CLI's test), and its decision is a snapshot.
#[test]
fn dra_fixtures_read_their_device_from_the_catalog() {
    use memguard_webhook::dra::StaticCatalog;
    let policy = policy();
    let dir = fixtures().join("dra");
    let objects = std::fs::read_to_string(dir.join("objects.yaml")).expect("objects");
    let catalog = StaticCatalog::from_yaml(&objects).expect("DRA objects");
    let profiles = ClusterView::default().with_dra(std::sync::Arc::new(catalog));
    let text = std::fs::read_to_string(fixtures().join("dra.yaml")).expect("table");
    let table: serde_json::Map<String, Value> = serde_saphyr::from_str(&text).expect("YAML");
    assert_eq!(table.len(), 6, "{table:?}");
    for (file, want) in table {
        let text = std::fs::read_to_string(dir.join(&file)).expect(&file);
        let pod: Pod = serde_saphyr::from_str(&text).expect("a Pod");
        let Outcome::Mutated(m) = mutate(&pod, &policy, &profiles) else {
            panic!("{file}: not mutated");
        };
        let estimate: Value = serde_json::from_str(&m.estimate.to_json()).expect("JSON");
        if want["source"] == "none" {
            assert!(m.budget.is_none(), "{file}: {:?}", m.budget);
            for key in ["budget", "fits", "budgetSource", "gpuMemory"] {
                assert!(estimate[key].is_null(), "{file}: {key} in {estimate}");
            }
            let w = want["warning"].as_str().expect("a warning");
            assert!(
                m.warnings.iter().any(|x| x.contains(w)),
                "{file}: {:?}",
                m.warnings
            );
            continue;
        }
        let b = m.budget.as_ref().expect("a budget");
        assert_eq!(estimate["device"], want["device"], "{file}");
        assert_eq!(estimate["budgetSource"]["kind"], want["source"], "{file}");
        assert_eq!(
            Some(b.device_memory.0),
            want["deviceMemory"].as_u64(),
            "{file}"
        );
        if let Some(d) = want["detail"].as_str() {
            let detail = estimate["budgetSource"]["detail"]
                .as_str()
                .unwrap_or_default();
            assert!(detail.contains(d), "{file}: {detail}");
        }
        match want["warning"].as_str() {
            Some(w) => assert!(
                m.warnings.iter().any(|x| x.contains(w)),
                "{file}: {:?}",
                m.warnings
            ),
            None => assert!(
                !m.warnings
                    .iter()
                    .any(|x| x.contains("DRA") || x.contains("CEL")),
                "{file}: {:?}",
                m.warnings
            ),
        }
        let patch = patch::build(&pod, &Outcome::Mutated(m.clone()));
        let name = format!("dra-{}", file.trim_end_matches(".yaml"));
        let snapshot = json!({
            "budget": {"deviceMemory": b.device_memory.to_string(), "source": b.source},
            "device": estimate["device"],
            "warnings": m.warnings,
            "patch": readable(&patch),
        });
        insta::assert_yaml_snapshot!(name, snapshot);
    }
}
