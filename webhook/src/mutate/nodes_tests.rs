//! Issue 38, item 4: the nodes a pod can use. An unpinned GPU pod is budgeted from the nodes its
//! `nodeSelector`, required node affinity and tolerations allow, and placement chooses among
//! them; cloud labels and instance types on Nodes name their GPU.
use super::*;
use crate::testutil::{PodBuilder, trainer_pod};
use memguard_api::PolicySpec;
use memguard_api::annotations as keys;
use memguard_api::cluster::{NodeInfo, NodeList};
use serde_json::{Value, json};
use std::sync::Arc;

/// A mixed fleet: an L4 tainted for inference, an A100 40 GB that only GKE's label names, an
/// A100 80 GB with GPU Feature Discovery's labels, an H200 that only its AWS instance type
/// names.
fn fleet() -> ClusterView {
    let node = |v: Value| NodeInfo::of(&serde_json::from_value(v).expect("a Node"));
    let nodes = NodeList(vec![
        node(json!({"metadata": {"name": "l4", "labels": {
            "nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.memory": "23034",
            "pool": "inference"}},
            "spec": {"taints": [
                {"key": "dedicated", "value": "inference", "effect": "NoSchedule"},
                // Only steers: never excludes.
                {"key": "spot", "effect": "PreferNoSchedule"}]}})),
        node(json!({"metadata": {"name": "a100-40", "labels": {
            "cloud.google.com/gke-accelerator": "nvidia-tesla-a100", "pool": "train"}}})),
        node(json!({"metadata": {"name": "a100-80", "labels": {
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920",
            "pool": "train"}}})),
        node(json!({"metadata": {"name": "h200", "labels": {
            "node.kubernetes.io/instance-type": "p5e.48xlarge", "pool": "train",
            "zone": "b"}}})),
        // No GPU label: no candidate.
        node(json!({"metadata": {"name": "cpu", "labels": {"pool": "train"}}})),
    ]);
    ClusterView::default().with_nodes(Arc::new(nodes))
}

fn policy(placement: &str) -> Policy {
    let spec: PolicySpec = serde_json::from_value(json!({"placement": placement})).expect("valid");
    spec.resolved().expect("valid")
}

fn admit(pod: PodBuilder, policy: &Policy, view: &ClusterView) -> Mutation {
    match mutate(&pod.build(), policy, view) {
        Outcome::Mutated(m) => *m,
        other => panic!("not mutated: {other:?}"),
    }
}

fn source(m: &Mutation) -> (String, String) {
    let a: Value = serde_json::from_str(&m.estimate.to_json()).expect("JSON");
    let s = &a["budgetSource"];
    (
        s["kind"].as_str().unwrap_or_default().to_string(),
        s["detail"].as_str().unwrap_or_default().to_string(),
    )
}

fn required(terms: Value) -> Value {
    json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
        {"nodeSelectorTerms": terms}}})
}

fn tolerate_inference() -> Value {
    json!([{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}])
}

/// Each row: the pod's scheduling constraints and the budget's detail. On the old code every
/// row read "smallest of 2 GPU nodes: NVIDIA-L4" (GKE's label and the instance type unread,
/// affinity and taints ignored).
#[test]
fn the_budget_comes_from_the_nodes_the_pods_affinity_and_tolerations_allow() {
    let view = fleet();
    let off = policy("off");
    let cases: Vec<(&str, PodBuilder, &str)> = vec![
        (
            "the tainted L4 is not for a pod that does not tolerate it",
            trainer_pod().gpus(1),
            "smallest of 3 GPU nodes: NVIDIA-A100-SXM4-40GB",
        ),
        (
            "tolerated by key, value and effect",
            trainer_pod()
                .gpus(1)
                .spec("tolerations", tolerate_inference()),
            "smallest of 4 GPU nodes: NVIDIA-L4",
        ),
        (
            "an empty key with Exists tolerates every taint",
            trainer_pod()
                .gpus(1)
                .spec("tolerations", json!([{"operator": "Exists"}])),
            "smallest of 4 GPU nodes: NVIDIA-L4",
        ),
        (
            "another value, or another effect, tolerates nothing",
            trainer_pod().gpus(1).spec(
                "tolerations",
                json!([{"key": "dedicated", "value": "batch", "effect": "NoSchedule"},
                       {"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}]),
            ),
            "smallest of 3 GPU nodes: NVIDIA-A100-SXM4-40GB",
        ),
        (
            "In and DoesNotExist, ANDed in one term",
            trainer_pod().gpus(1).spec(
                "affinity",
                required(json!([{"matchExpressions": [
                    {"key": "pool", "operator": "In", "values": ["train"]},
                    {"key": "cloud.google.com/gke-accelerator", "operator": "DoesNotExist"}]}])),
            ),
            "smallest of 2 GPU nodes: NVIDIA-A100-SXM4-80GB",
        ),
        (
            "terms ORed: Exists in one, NotIn in the other",
            trainer_pod().gpus(1).spec(
                "affinity",
                required(json!([
                    {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
                    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "NotIn",
                        "values": ["NVIDIA-L4"]}, {"key": "pool", "operator": "In",
                        "values": ["train"]}, {"key": "nvidia.com/gpu.memory",
                        "operator": "Exists"}]}])),
            ),
            "smallest of 2 GPU nodes: NVIDIA-A100-SXM4-80GB",
        ),
        (
            "Gt and Lt on a label's number",
            trainer_pod()
                .gpus(1)
                .spec("tolerations", tolerate_inference())
                .spec(
                    "affinity",
                    required(json!([{"matchExpressions": [
                        {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["20000"]},
                        {"key": "nvidia.com/gpu.memory", "operator": "Lt", "values": ["50000"]}]}])),
                ),
            "smallest of 1 GPU node: NVIDIA-L4",
        ),
        (
            "the node selector still narrows",
            trainer_pod().gpus(1).node_label("zone", "b"),
            "smallest of 1 GPU node: NVIDIA-H200",
        ),
        (
            "matchFields on the node's name",
            trainer_pod().gpus(1).spec(
                "affinity",
                required(json!([{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": ["a100-80"]}]}])),
            ),
            "smallest of 1 GPU node: NVIDIA-A100-SXM4-80GB",
        ),
    ];
    for (name, pod, detail) in cases {
        let m = admit(pod, &off, &view);
        assert_eq!(
            source(&m),
            ("nodes".to_string(), detail.to_string()),
            "{name}"
        );
    }
}

/// A config that fits a 40 GB A100 only after checkpointing and a smaller micro-batch (compute
/// and free knobs), and no L4 at all: full fine-tuning of Llama 3.2 1B, batch 4 × 2048.
fn needs_a_bigger_gpu() -> PodBuilder {
    trainer_pod()
        .annotate(keys::MODEL, "llama-3.2-1b")
        .annotate(keys::METHOD, "full")
        .annotate(keys::BATCH_SIZE, "4")
        .annotate(keys::SEQ_LENGTH, "2048")
        .gpus(1)
        .spec("tolerations", json!([{"operator": "Exists"}]))
}

/// On the old code placement never applied once nodes carried labels: the pod was planned for
/// the L4, cut to its floor and marked cannot fit, with no affinity.
#[test]
fn placement_chooses_among_the_nodes_the_pod_may_use() {
    let view = fleet();
    let p = policy("required");
    let m = admit(needs_a_bigger_gpu(), &p, &view);
    // The smallest class where it fits with free or compute knobs: the 40 GB A100 (it needs
    // checkpointing there), not the 80 GB one where it would fit as written.
    assert_eq!(
        source(&m),
        (
            "nodes".to_string(),
            "smallest of 3 GPU nodes: NVIDIA-A100-SXM4-40GB".to_string()
        )
    );
    assert!(m.plan.fits, "{:?}", m.plan);
    assert!(m.error.is_none(), "{:?}", m.error);
    let affinity = json!(m.affinity.clone().expect("placement added affinity"));
    let terms = &affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
    // Each class's nodes by the label that sizes them: the memory label where there is one,
    // else the label that names the GPU.
    assert_eq!(
        terms,
        &json!([
            {"matchExpressions": [{"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["81919"]}]},
            {"matchExpressions": [{"key": "cloud.google.com/gke-accelerator", "operator": "In", "values": ["nvidia-tesla-a100"]}]},
            {"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5e.48xlarge"]}]}
        ]),
        "{affinity}"
    );
    assert!(
        m.warnings.iter().any(|w| w.contains("placement required")),
        "{:?}",
        m.warnings
    );

    // Reinvoked on the placed pod: the affinity reads back as the same nodes, the same budget,
    // nothing more to patch.
    let pod = needs_a_bigger_gpu().build();
    let outcome = Outcome::Mutated(Box::new(m.clone()));
    let mut doc = serde_json::to_value(&pod).expect("pod");
    json_patch::patch(&mut doc, &crate::patch::build(&pod, &outcome)).expect("applies");
    let again_pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(doc).expect("pod");
    let again = mutate(&again_pod, &p, &view);
    let Outcome::Mutated(m2) = &again else {
        panic!("{again:?}")
    };
    assert_eq!(m2.budget, m.budget);
    assert!(crate::patch::build(&again_pod, &again).0.is_empty());

    // Preferred: the same nodes preferred, the pod planned for the smallest it may land on.
    let m = admit(needs_a_bigger_gpu(), &policy("preferred"), &view);
    assert_eq!(
        source(&m).1,
        "smallest of 4 GPU nodes: NVIDIA-L4",
        "the pod may still land on the L4"
    );
    let affinity = json!(m.affinity.clone().expect("placement added affinity"));
    let na = &affinity["nodeAffinity"];
    assert!(na["requiredDuringSchedulingIgnoredDuringExecution"].is_null());
    assert_eq!(
        na["preferredDuringSchedulingIgnoredDuringExecution"]
            .as_array()
            .map(Vec::len),
        Some(3),
        "{affinity}"
    );
    // Off: nothing added.
    assert!(
        admit(needs_a_bigger_gpu(), &policy("off"), &view)
            .affinity
            .is_none()
    );
}

/// AWS instance types pin their GPU as AKS VM sizes do; on the old code they fell back to the
/// policy default.
#[test]
fn aws_instance_types_pin_their_gpu() {
    let label = "node.kubernetes.io/instance-type";
    for (instance, product) in [
        ("g5.xlarge", "NVIDIA-A10G"),
        ("g6.48xlarge", "NVIDIA-L4"),
        ("g6e.12xlarge", "NVIDIA-L40S"),
        ("p4d.24xlarge", "NVIDIA-A100-SXM4-40GB"),
        ("p4de.24xlarge", "NVIDIA-A100-SXM4-80GB"),
        ("p5.48xlarge", "NVIDIA-H100-80GB-HBM3"),
        ("p5e.48xlarge", "NVIDIA-H200"),
        ("p5en.48xlarge", "NVIDIA-H200"),
    ] {
        let m = admit(
            trainer_pod().gpus(1).node_label(label, instance),
            &Policy::default(),
            &ClusterView::default(),
        );
        assert_eq!(
            source(&m),
            ("gpu-product".to_string(), product.to_string()),
            "{instance}"
        );
    }
    // Graviton's g5g is another family; a CPU type pins nothing.
    for other in ["g5g.xlarge", "m5.large"] {
        let m = admit(
            trainer_pod().gpus(1).node_label(label, other),
            &Policy::default(),
            &ClusterView::default(),
        );
        assert_eq!(source(&m).0, "policy-default", "{other}");
    }
}

/// EFA and other network devices are no accelerator: on the old code the pod was told
/// "unknown accelerator vpc.amazonaws.com/efa".
#[test]
fn an_efa_device_is_not_an_unknown_accelerator() {
    let m = admit(
        trainer_pod()
            .gpus(1)
            .limit("vpc.amazonaws.com/efa", "4")
            .limit("rdma/hca_shared_devices_a", "1"),
        &Policy::default(),
        &ClusterView::default(),
    );
    assert!(
        !m.warnings.iter().any(|w| w.contains("unknown accelerator")),
        "{:?}",
        m.warnings
    );
    // A device memguard cannot size is still named.
    let m = admit(
        trainer_pod().gpus(1).limit("example.com/npu", "1"),
        &Policy::default(),
        &ClusterView::default(),
    );
    assert!(
        m.warnings
            .iter()
            .any(|w| w.contains("unknown accelerator example.com/npu")),
        "{:?}",
        m.warnings
    );
}

/// Issue 38, item 6: a pod that cannot fit the smallest node it may use is told which larger
/// GPU among its nodes would fit it (placement off: nothing steers it there).
#[test]
fn a_larger_gpu_among_the_pods_nodes_is_suggested() {
    let m = admit(needs_a_bigger_gpu(), &policy("off"), &fleet());
    let error = m.error.clone().expect("cannot fit on the L4");
    assert!(
        error.contains(
            "would fit: a larger GPU among the nodes the pod may use: NVIDIA-A100-SXM4-40GB, "
        ) && error.contains(" (upper bound "),
        "{error}"
    );
}
