//! Launches memguard was not written against (issue 36): every entry of
//! `tests/corpus/launch2/*.yaml` is a public launch from a repository the first corpus does not
//! use, with a truth table read from the script's own source (its parser, its defaults, its
//! config files). Each is graded, and the test fails on any silently wrong one:
//!
//! - **planned**: memguard claims a verdict (`fits` is a bool), and every value it planned on
//!   that the truth table knows is the value the job really runs at (model, method, batch,
//!   sequence, sharding and, when sharded, world size; accumulation and checkpointing where it
//!   says it read them). Two stand-ins are the larger figure and count as right: an unknown
//!   checkpointing planned off, and a LoRA variant memguard does not model (adapters beside
//!   trained embeddings) planned as full fine-tuning;
//! - **left**: the pod is skipped, or memguard claims no verdict (`fits` null): its `command`,
//!   `args` and config stay as they are, and a warning or the error names what was seen and
//!   what was not read (never the bare "no training annotations");
//! - **wrong**: anything else, including a rewrite that changes the effective batch.
//!
//! The table of grades is printed (`cargo test --test corpus_unseen -- --nocapture`).

use k8s_openapi::api::core::v1::Pod;
use memguard_api::cluster::ConfigMapList;
use memguard_api::{Policy, TrainingPod};
use memguard_estimator::{Method, Parallelism};
use memguard_webhook::{ClusterView, Outcome, mutate};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// One truth value: what the job runs at, and where the source says so.
fn truth<'a>(entry: &'a Value, knob: &str) -> Option<&'a str> {
    entry["truth"][knob]["value"]
        .as_str()
        .filter(|v| *v != "unknown")
}

/// The pod a workload creates: a Pod as it is; a Job's, a PyTorchJob's master (else first
/// replica) template, in the workload's namespace.
fn pod_of(workload: &Value) -> Result<Value, String> {
    let template = match workload["kind"].as_str() {
        Some("Pod") => return Ok(workload.clone()),
        Some("Job") => workload["spec"]["template"].clone(),
        Some("PyTorchJob") => {
            let specs = &workload["spec"]["pytorchReplicaSpecs"];
            let first = specs
                .as_object()
                .and_then(|o| o.get("Master").or_else(|| o.values().next()))
                .ok_or("a PyTorchJob without replicas")?;
            first["template"].clone()
        }
        other => return Err(format!("kind {other:?}")),
    };
    let mut pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod"});
    pod["metadata"] = template["metadata"].clone();
    pod["metadata"]["namespace"] = workload["metadata"]["namespace"].clone();
    pod["metadata"]["name"] = workload["metadata"]["name"].clone();
    pod["spec"] = template["spec"].clone();
    Ok(pod)
}

fn config_maps(entry: &Value, namespace: &str) -> Result<ConfigMapList, String> {
    let mut maps = BTreeMap::new();
    for cm in entry["configMaps"].as_array().into_iter().flatten() {
        let name = cm["metadata"]["name"]
            .as_str()
            .ok_or("a ConfigMap without a name")?;
        let ns = cm["metadata"]["namespace"].as_str().unwrap_or(namespace);
        let data: BTreeMap<String, String> = serde_json::from_value(cm["data"].clone())
            .map_err(|e| format!("ConfigMap {name}: {e}"))?;
        maps.insert((ns.to_string(), name.to_string()), data);
    }
    Ok(ConfigMapList(maps))
}

/// The truth's method in memguard's terms: `None` for a method memguard does not model
/// (p-tuning, LoRA with trained embeddings), which no plan may claim.
fn method_of(value: &str) -> Option<(Method, u32)> {
    match value {
        "full" => Some((Method::Full, 16)),
        "lora" => Some((Method::Lora, 16)),
        "lora-int8" => Some((Method::Lora, 8)),
        "qlora" => Some((Method::Qlora, 4)),
        _ => None,
    }
}

/// The truth's sharding in memguard's terms (offload is not modelled: planned without it, the
/// estimate is the larger figure).
fn parallelism_of(value: &str) -> Option<Parallelism> {
    let base = value.split("-offload").next().unwrap_or(value);
    match base {
        "none" | "ddp" => Some(Parallelism::None),
        "zero1" => Some(Parallelism::Zero1),
        "zero2" => Some(Parallelism::Zero2),
        "zero3" => Some(Parallelism::Zero3),
        "fsdp-full-shard" | "fsdp" => Some(Parallelism::Fsdp),
        _ => None,
    }
}

enum Grade {
    Planned,
    Left(String),
}

fn grade(entry: &Value, policy: &Policy) -> Result<Grade, String> {
    let pod_json = pod_of(&entry["pod"])?;
    let namespace = pod_json["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default");
    let view = ClusterView::default().with_config_maps(Arc::new(config_maps(entry, namespace)?));
    let pod: Pod = serde_json::from_value(pod_json.clone()).map_err(|e| format!("pod: {e}"))?;
    let outcome = match mutate(&pod, policy, &view) {
        // Guarded at run time, its command line as it was: left, with the reason.
        Outcome::Guarded(g) => Outcome::Skipped {
            error: g.reason.clone(),
            warning: "guarded".into(),
        },
        outcome => outcome,
    };
    let m = match &outcome {
        Outcome::Skipped { error, warning } => {
            // The reason names what was seen and what was not read, never the bare generic.
            let telling = [
                "memguard recognised",
                "not a launch",
                "unknown model",
                "could not be read",
                "not read",
                "no command",
            ];
            if !telling.iter().any(|t| error.contains(t)) {
                return Err(format!("skipped without saying what was not read: {error}"));
            }
            let how = if warning == "guarded" {
                "guarded"
            } else {
                "skipped"
            };
            return Ok(Grade::Left(format!("{how}: {error}")));
        }
        Outcome::Mutated(m) => m,
        other => return Err(format!("unexpected outcome {other:?}")),
    };
    let unchanged = m.command_line.is_none();
    if m.estimate.fits.is_none() {
        if !unchanged || !m.changed.is_empty() {
            return Err(format!("no verdict, yet rewritten: {:?}", m.changed));
        }
        let named = m.warnings.first().cloned().unwrap_or_default();
        if !named.contains("not read") {
            return Err(format!(
                "no verdict, and no warning says why: {:?}",
                m.warnings
            ));
        }
        return Ok(Grade::Left(named));
    }
    // A verdict: every value it rests on must be the truth.
    let t = TrainingPod::resolve(&pod, policy, view.cluster()).map_err(|e| e.to_string())?;
    let cfg = &t.config;
    let mut wrong = Vec::new();
    match truth(entry, "model") {
        None => wrong.push("a model the source does not name".to_string()),
        Some(id) => {
            let want = policy.models.lookup(id).and_then(|m| m.shape.name);
            if want.is_none() || want != cfg.model.name {
                wrong.push(format!("model {:?}, truth {id}", cfg.model.name));
            }
        }
    }
    match truth(entry, "method").map(|v| (v, method_of(v))) {
        // A LoRA variant memguard does not model (trained embeddings beside the adapters)
        // may be planned as full fine-tuning, the larger figure; anything else is wrong.
        Some((v, None)) if v.starts_with("lora") && cfg.method == Method::Full => {}
        Some((v, None)) => wrong.push(format!("method {v} is not one memguard models")),
        Some((v, Some((method, bits)))) => {
            let base_bits = match cfg.method {
                Method::Qlora => 4,
                _ => cfg.model_bits.unwrap_or(16).min(16),
            };
            if cfg.method != method || (method == Method::Lora && base_bits != bits) {
                wrong.push(format!(
                    "method {:?} on {base_bits}-bit, truth {v}",
                    cfg.method
                ));
            }
        }
        None => wrong.push("an unknown method".into()),
    }
    let knob = |name: &str, planned: String| match truth(entry, name) {
        Some(v) if v != planned => Some(format!("{name} {planned}, truth {v}")),
        None => Some(format!("{name} {planned}, truth unknown")),
        _ => None,
    };
    wrong.extend(knob("batch-size", cfg.batch_size.to_string()));
    wrong.extend(knob("seq-length", cfg.seq_length.to_string()));
    // Read values must be right; unknown ones are not claimed (an unknown checkpointing is
    // planned off, the larger figure).
    for (name, value) in [
        ("grad-accumulation", cfg.grad_accumulation.to_string()),
        ("grad-checkpointing", cfg.grad_checkpointing.to_string()),
    ] {
        if m.estimate.sources.get(name).is_some_and(|s| s != "unknown") {
            wrong.extend(knob(name, value));
        }
    }
    match truth(entry, "parallelism").and_then(parallelism_of) {
        Some(p) if p != cfg.parallelism => {
            wrong.push(format!("parallelism {:?}, truth {p:?}", cfg.parallelism))
        }
        None => wrong.push("a sharding memguard does not model".into()),
        Some(Parallelism::None) => {}
        Some(_) => wrong.extend(knob("world-size", cfg.world_size.to_string())),
    }
    // No rewrite changes the effective batch the job really runs at.
    if !unchanged
        && let (Some(b), Some(a)) = (
            truth(entry, "batch-size"),
            truth(entry, "grad-accumulation"),
        )
    {
        let (b, a): (u64, u64) = (b.parse().unwrap_or(0), a.parse().unwrap_or(0));
        let planned = m.plan.config.batch_size * m.plan.config.grad_accumulation;
        if planned != b * a {
            wrong.push(format!("effective batch {b} × {a} rewritten to {planned}"));
        }
    }
    if wrong.is_empty() {
        Ok(Grade::Planned)
    } else {
        Err(format!("planned on wrong values: {}", wrong.join("; ")))
    }
}

#[test]
fn every_unseen_launch_is_planned_on_the_truth_or_left_with_the_reason() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/corpus/launch2");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("the corpus")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 20, "at least 20 entries: {}", paths.len());
    let policy = Policy::default();
    let (mut planned, mut left, mut failures) = (0, 0, Vec::new());
    for path in &paths {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("?");
        let text = std::fs::read_to_string(path).expect("readable");
        let entry: Value = serde_saphyr::from_str(&text).expect("YAML");
        match grade(&entry, &policy) {
            Ok(Grade::Planned) => {
                planned += 1;
                println!("planned  {name}");
            }
            Ok(Grade::Left(why)) => {
                left += 1;
                println!("left     {name}: {why}");
            }
            Err(why) => {
                println!("WRONG    {name}: {why}");
                failures.push(format!("{name}: {why}"));
            }
        }
    }
    println!(
        "{} entries: {planned} planned on the truth, {left} left with the reason, {} wrong",
        paths.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
