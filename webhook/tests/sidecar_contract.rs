//! The contract between the webhook and the sidecar it injects: for every policy fixture, the
//! env the webhook writes into the sidecar container (as the patched pod carries it) goes
//! through the sidecar's own flag and config resolution, which must accept it and read back
//! the policy's settings and the plan's knobs. A name or a spelling that one side changes
//! alone fails here.

use json_patch::Patch;
use k8s_openapi::api::core::v1::{Container, Pod};
use memguard_api::duration::parse_duration;
use memguard_api::pod::parse_quantity;
use memguard_api::{Policy, env, wellknown};
use memguard_sidecar::{Args, Config};
use memguard_webhook::policy_sources::{Overrides, policy_from_str};
use memguard_webhook::{ClusterView, Outcome, mutate, patch};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// `policy.yaml` (the golden fixtures' policy) and every `policies/*.yaml`.
fn policy_fixtures() -> Vec<(String, Policy)> {
    let mut paths = vec![fixtures().join("policy.yaml")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(fixtures().join("policies"))
        .expect("policies dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    more.sort();
    paths.extend(more);
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).expect("policy fixture");
            let policy = policy_from_str(Some(&text), &Overrides::default())
                .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
            (path.display().to_string(), policy)
        })
        .collect()
}

fn pod(name: &str) -> Pod {
    let text = std::fs::read_to_string(fixtures().join("pods").join(name)).expect("pod fixture");
    serde_saphyr::from_str(&text).expect("a Pod")
}

/// The sidecar container of the patched pod (native or classic).
fn injected_sidecar(pod: &Pod, patch: &Patch) -> Container {
    let mut applied = serde_json::to_value(pod).expect("pod serializes");
    json_patch::patch(&mut applied, patch).expect("patch applies");
    let mutated: Pod = serde_json::from_value(applied).expect("still a Pod");
    let spec = mutated.spec.expect("spec");
    spec.init_containers
        .into_iter()
        .flatten()
        .chain(spec.containers)
        .find(|c| c.name == wellknown::SIDECAR_CONTAINER)
        .expect("a sidecar was injected")
}

/// The sidecar's environment as the kubelet would give it: literal values, and the downward
/// API's `limits.memory` of the trainer in bytes.
fn kubelet_env(sidecar: &Container, trainer: &Container) -> BTreeMap<String, String> {
    let limit = trainer
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
        .and_then(|q| parse_quantity(&q.0));
    sidecar
        .env
        .iter()
        .flatten()
        .filter_map(|e| match (&e.value, &e.value_from) {
            (Some(v), _) => Some((e.name.clone(), v.clone())),
            (None, Some(from)) => {
                let field = from.resource_field_ref.as_ref()?;
                assert_eq!(field.resource, "limits.memory", "{}", e.name);
                Some((e.name.clone(), limit?.to_string()))
            }
            (None, None) => None,
        })
        .collect()
}

#[test]
fn the_sidecar_reads_back_what_the_webhook_writes_for_every_policy_fixture() {
    let policies = policy_fixtures();
    assert!(policies.len() >= 3, "policy fixtures missing");
    let pods = [
        "single-gpu-lora.yaml",
        "multi-gpu-fsdp.yaml",
        "cpu-memory-limit.yaml",
    ];
    for (name, policy) in &policies {
        for pod_name in pods {
            let pod = pod(pod_name);
            let what = format!("{name} × {pod_name}");
            let Outcome::Mutated(m) = mutate(&pod, policy, &ClusterView::default()) else {
                panic!("{what}: not mutated");
            };
            let patch = patch::build(&pod, &Outcome::Mutated(m.clone()));
            let sidecar = injected_sidecar(&pod, &patch);
            let trainer = &pod.spec.as_ref().expect("spec").containers[m.trainer_index];
            let vars = kubelet_env(&sidecar, trainer);
            let lookup = |k: &str| vars.get(k).cloned();

            // What the container runs: its command, no arguments, everything through env.
            assert_eq!(sidecar.args, None, "{what}");
            let args = Args::from_env(sidecar.command.clone().expect("command"), &lookup)
                .unwrap_or_else(|e| panic!("{what}: the sidecar refuses its flags: {e}"));
            let c = Config::resolve(args, lookup)
                .unwrap_or_else(|e| panic!("{what}: the sidecar refuses its config: {e}"));

            assert_eq!(c.args.interval, policy.sidecar_interval, "{what}");
            assert_eq!(c.thresholds, policy.thresholds, "{what}");
            assert_eq!(
                c.args.signal_file,
                PathBuf::from(wellknown::SIGNAL_FILE),
                "{what}"
            );
            assert_eq!(
                c.args.listen.to_string(),
                wellknown::SIDECAR_LISTEN,
                "{what}"
            );
            assert_eq!(
                c.args.metrics_listen.to_string(),
                wellknown::SIDECAR_METRICS_LISTEN,
                "{what}"
            );
            let plan = &m.plan.config;
            assert_eq!(
                (c.batch_size, c.grad_accumulation, c.grad_checkpointing),
                (
                    plan.batch_size,
                    plan.grad_accumulation,
                    plan.grad_checkpointing
                ),
                "{what}"
            );
            assert_eq!(c.estimate_bytes, Some(m.plan.total().0), "{what}");
            let limit = vars
                .get(env::TRAINER_MEMORY_LIMIT)
                .map(|v| v.parse().expect("bytes"));
            assert_eq!(c.trainer_memory_limit, limit, "{what}");
            assert!(
                limit.is_some(),
                "{what}: every fixture pod has a memory limit"
            );
        }
    }
    // The fixtures say what they mean, not only that both sides agree.
    let tuned = &policies
        .iter()
        .find(|(n, _)| n.ends_with("tuned.yaml"))
        .expect("tuned.yaml")
        .1;
    assert_eq!(tuned.sidecar_interval, Duration::from_secs(90));
    assert_eq!(
        (tuned.thresholds.warn, tuned.thresholds.psi_some_avg10),
        (0.6, 25.5)
    );
    let defaults = &policies
        .iter()
        .find(|(n, _)| n.ends_with("defaults.yaml"))
        .expect("defaults.yaml")
        .1;
    assert_eq!(Ok(defaults.sidecar_interval), parse_duration("100ms"));
}

/// What the policy writes for its settings is one of the sidecar's own spellings, across the
/// range people use.
#[test]
fn every_interval_the_policy_accepts_the_sidecar_accepts() {
    for text in ["1ms", "100ms", "1.5s", "2s", "1m30s", "1h", "30"] {
        let policy = policy_from_str(
            Some(&format!("sidecar: {{interval: \"{text}\"}}")),
            &Overrides::default(),
        )
        .unwrap_or_else(|e| panic!("{text}: {e:?}"));
        let vars: BTreeMap<String, String> = policy
            .sidecar_env()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let args = Args::from_env(["memguard-sidecar"], &|k: &str| vars.get(k).cloned())
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(args.interval, policy.sidecar_interval, "{text}");
    }
}
