use crate::testutil::{PodBuilder, trainer_pod};
use crate::{ClusterView, Outcome, mutate, patch};
use k8s_openapi::api::core::v1::Pod;
use memguard_api::Policy;
use memguard_api::PolicySpec;
use memguard_api::annotations as keys;
use memguard_api::pod::NVIDIA_GPU_MEMORY_LABEL;
use memguard_decide::budget::BudgetSource;
use memguard_decide::placement::*;
use serde_json::{Value, json};

fn policy(mode: &str) -> Policy {
    let spec: PolicySpec = serde_json::from_value(json!({"placement": mode})).expect("valid");
    spec.resolved().expect("valid")
}

fn mutated(pod: &PodBuilder, policy: &Policy) -> crate::Mutation {
    match mutate(&pod.clone().build(), policy, &ClusterView::default()) {
        Outcome::Mutated(m) => *m,
        other => panic!("expected a mutation, got {other:?}"),
    }
}

/// LoRA on an 8B model at 2 × 4096 tokens: about 90 GiB undowngraded, so an H200 is the
/// smallest GPU of the table that fits it as it is.
fn big() -> PodBuilder {
    trainer_pod()
        .annotate(keys::BATCH_SIZE, "2")
        .annotate(keys::SEQ_LENGTH, "4096")
        .gpus(1)
}

fn bound(a: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut walk = |term: &Value| {
        for e in term["matchExpressions"].as_array().into_iter().flatten() {
            if e["key"] == NVIDIA_GPU_MEMORY_LABEL {
                out.push(format!(
                    "{} {}",
                    e["operator"].as_str().unwrap_or(""),
                    e["values"][0].as_str().unwrap_or("")
                ));
            }
        }
    };
    let na = &a["nodeAffinity"];
    for t in na["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        .as_array()
        .into_iter()
        .flatten()
    {
        walk(t);
    }
    for t in na["preferredDuringSchedulingIgnoredDuringExecution"]
        .as_array()
        .into_iter()
        .flatten()
    {
        walk(&t["preference"]);
    }
    out
}

#[test]
fn classes_are_the_whole_nvidia_gpus_of_the_table() {
    let c = classes(&Policy::default());
    assert_eq!(c.first(), Some(&15109), "a T4 is the smallest");
    assert_eq!(c.last(), Some(&182525), "a B200 the largest");
    assert!(!c.contains(&9728), "no MIG slices");
    assert!(!c.contains(&196288), "no AMD GPUs");
    assert!(c.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn required_picks_the_smallest_class_that_fits_undowngraded_and_plans_for_it() {
    let p = policy("required");
    let m = mutated(&big(), &p);
    let b = m.budget.clone().expect("budget");
    let a = json!(m.affinity.clone().expect("placement added affinity"));
    let [expr] = bound(&a).try_into().expect("one bound");
    let n: u64 = expr.trim_start_matches("Gt ").parse().expect("MiB");
    let chosen = n + 1;
    assert!(classes(&p).contains(&chosen), "{chosen}");
    assert_eq!(chosen, 143071, "an H200");
    assert_eq!(b.device_memory, usable(chosen));
    assert_eq!(
        b.source,
        BudgetSource::Placement(format!("nvidia.com/gpu.memory>{n}"))
    );
    assert!(m.plan.steps.is_empty() && m.plan.fits, "{:?}", m.plan.steps);
    // The next smaller class would have needed a downgrade: the choice is the smallest.
    let smaller = classes(&p)
        .into_iter()
        .filter(|c| *c < chosen)
        .max()
        .expect("a smaller class");
    let there = mutated(
        &big().annotate(keys::GPU_MEMORY, &format!("{}B", usable(smaller).0)),
        &p,
    );
    assert!(!there.plan.steps.is_empty(), "{smaller} MiB would fit too");
}

#[test]
fn preferred_steers_without_narrowing_and_plans_as_before() {
    let off = mutated(&big(), &policy("off"));
    assert!(off.affinity.is_none());
    assert_eq!(
        off.budget.as_ref().expect("budget").source,
        BudgetSource::PolicyDefault
    );
    let m = mutated(&big(), &policy("preferred"));
    let a = json!(m.affinity.clone().expect("affinity"));
    assert!(
        a["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"].is_null(),
        "preferred requires nothing: {a}"
    );
    assert_eq!(
        a["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"],
        PREFERRED_WEIGHT
    );
    assert_eq!(
        m.budget, off.budget,
        "the pod may land anywhere: planned as with off"
    );
    assert_eq!(m.plan.config, off.plan.config);
}

#[test]
fn a_config_every_gpu_fits_gets_no_affinity() {
    let small = trainer_pod()
        .annotate(keys::MODEL, "gpt2")
        .annotate(keys::BATCH_SIZE, "1")
        .gpus(1);
    assert!(mutated(&small, &policy("required")).affinity.is_none());
}

#[test]
fn pinned_annotated_shared_or_user_placed_pods_are_left_alone() {
    let p = policy("required");
    let user_bound = big().spec(
        "affinity",
        json!({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 5, "preference": {"matchExpressions": [
                {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["40000"]}]}}]}}),
    );
    for (name, pod) in [
        ("pinned", big().node_selector("NVIDIA-A10G")),
        ("annotated", big().annotate(keys::GPU_MEMORY, "40Gi")),
        (
            "time-sliced",
            big().select("nvidia.com/gpu.sharing-strategy", "time-slicing"),
        ),
        ("user's own bound", user_bound),
        (
            "MIG",
            trainer_pod()
                .annotate(keys::METHOD, "full")
                .limit("nvidia.com/mig-3g.40gb", "1"),
        ),
    ] {
        assert!(mutated(&pod, &p).affinity.is_none(), "{name}");
    }
}

#[test]
fn merges_with_the_users_affinity_without_clobbering_it_and_is_idempotent() {
    let users = json!({
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]},
                {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}
            ]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 7, "preference": {"matchExpressions": [{"key": "spot", "operator": "DoesNotExist"}]}}
            ]
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
             "labelSelector": {"matchLabels": {"app": "x"}}}}]}
    });
    for mode in ["required", "preferred"] {
        let p = policy(mode);
        let pod = big().spec("affinity", users.clone());
        let m = mutated(&pod, &p);
        let merged = json!(m.affinity.clone().expect("affinity"));
        // Everything the user wrote is still there, in place.
        assert_eq!(
            merged["podAntiAffinity"], users["podAntiAffinity"],
            "{mode}"
        );
        let terms = &merged["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
        assert_eq!(terms.as_array().map(Vec::len), Some(2), "{mode}");
        for (i, term) in terms.as_array().into_iter().flatten().enumerate() {
            let user_expr = &users["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"][i]["matchExpressions"][0];
            assert_eq!(&term["matchExpressions"][0], user_expr, "{mode}: term {i}");
            let ours = term["matchExpressions"].as_array().map(Vec::len);
            assert_eq!(
                ours,
                Some(if mode == "required" { 2 } else { 1 }),
                "{mode}: term {i}"
            );
        }
        let preferred = merged["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            .as_array()
            .expect("list");
        assert_eq!(
            preferred[0],
            users["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        );
        assert_eq!(
            preferred.len(),
            if mode == "preferred" { 2 } else { 1 },
            "{mode}"
        );

        // Applied, and mutated again: nothing more to do, the same budget.
        let pod = pod.build();
        let mut doc = serde_json::to_value(&pod).expect("pod");
        let first = patch::build(&pod, &Outcome::Mutated(Box::new(m.clone())));
        json_patch::patch(&mut doc, &first).expect("applies");
        let again_pod: Pod = serde_json::from_value(doc).expect("pod");
        let again = mutate(&again_pod, &p, &ClusterView::default());
        let Outcome::Mutated(m2) = &again else {
            panic!("{again:?}")
        };
        assert_eq!(m2.budget, m.budget, "{mode}");
        assert!(
            patch::build(&again_pod, &again).0.is_empty(),
            "{mode}: second patch not empty"
        );
    }
}
