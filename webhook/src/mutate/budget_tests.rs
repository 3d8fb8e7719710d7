use super::*;
use crate::testutil::{PodBuilder, trainer_pod};
use crate::{ClusterView, Outcome, mutate};
use memguard_api::Policy;
use memguard_api::annotations as keys;
use memguard_api::wellknown::NVIDIA_GPU_PRODUCT_LABEL;
use memguard_estimator::Bytes;

/// The budget, the device and the warnings memguard gives `pod` under the built-in table.
fn decide(pod: PodBuilder) -> (Budget, String, Vec<String>) {
    match mutate(&pod.build(), &Policy::default(), &ClusterView::default()) {
        Outcome::Mutated(m) => {
            let annotation: serde_json::Value =
                serde_json::from_str(&m.estimate.to_json()).expect("JSON");
            assert_eq!(
                annotation["budgetSource"],
                serde_json::to_value(&m.budget.as_ref().expect("budget").source).expect("JSON"),
                "the annotation names the source"
            );
            let device = annotation["device"].as_str().expect("device").to_string();
            (m.budget.expect("budget"), device, m.warnings)
        }
        other => panic!("expected a mutation, got {other:?}"),
    }
}

fn mig(source: &str) -> BudgetSource {
    BudgetSource::Mig(source.into())
}

/// One row per way a pod states the memory it has: (what, pod, device memory, source, device).
#[test]
fn each_accelerator_and_sharing_system_gives_its_own_budget_and_source() {
    let rows: Vec<(&str, PodBuilder, Bytes, BudgetSource, &str)> = vec![
        (
            // The pod: before, a CPU job against its 32 GiB limit.
            "MIG mixed, no product: the smallest 1g.10gb slice in the table, on cuda",
            trainer_pod()
                .limit("nvidia.com/mig-1g.10gb", "1")
                .memory_limit("32Gi"),
            Bytes::mib(9728),
            mig("1g.10gb: smallest in table"),
            "cuda",
        ),
        (
            "MIG mixed on a pinned H100: its own slice size",
            trainer_pod()
                .limit("nvidia.com/mig-1g.10gb", "1")
                .node_selector("NVIDIA-H100-80GB-HBM3"),
            Bytes::mib(9984),
            mig("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"),
            "cuda",
        ),
        (
            "MIG single strategy: the product label names the slice",
            trainer_pod()
                .gpus(1)
                .node_selector("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
            Bytes::mib(4864),
            mig("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
            "cuda",
        ),
        (
            "MIG single strategy, product not in the table: the profile's smallest size",
            trainer_pod()
                .gpus(1)
                .node_selector("NVIDIA-A100-PCIE-80GB-MIG-3g.40gb"),
            Bytes::mib(40192),
            mig("3g.40gb: smallest in table"),
            "cuda",
        ),
        (
            "HAMi gpumem in MiB",
            trainer_pod().gpus(1).limit("nvidia.com/gpumem", "8000"),
            Bytes::mib(8000),
            BudgetSource::Hami("nvidia.com/gpumem=8000".into()),
            "cuda",
        ),
        (
            "HAMi gpumem-percentage of the pinned product",
            trainer_pod()
                .gpus(1)
                .limit("nvidia.com/gpumem-percentage", "50")
                .node_selector("NVIDIA-A10G"),
            Bytes::mib(22194 / 2),
            BudgetSource::Hami("nvidia.com/gpumem-percentage=50".into()),
            "cuda",
        ),
        (
            "KAI gpu-memory annotation in MiB",
            trainer_pod().annotate("gpu-memory", "2000"),
            Bytes::mib(2000),
            BudgetSource::Kai("gpu-memory=2000".into()),
            "cuda",
        ),
        (
            "KAI gpu-fraction of the policy default (80 GiB)",
            trainer_pod().gpus(1).annotate("gpu-fraction", "0.25"),
            Bytes::gib(20),
            BudgetSource::Kai("gpu-fraction=0.25".into()),
            "cuda",
        ),
        (
            "MPS pinned limit, the smallest device's",
            trainer_pod()
                .gpus(2)
                .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=6G,1=4096M"),
            Bytes::gib(4),
            BudgetSource::Mps("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=4294967296".into()),
            "cuda",
        ),
        (
            "the smallest of several caps applies",
            trainer_pod()
                .gpus(1)
                .limit("nvidia.com/gpumem", "8000")
                .annotate("gpu-memory", "3000"),
            Bytes::mib(3000),
            BudgetSource::Kai("gpu-memory=3000".into()),
            "cuda",
        ),
        (
            "the annotation still beats every cap",
            trainer_pod()
                .gpus(1)
                .limit("nvidia.com/gpumem", "8000")
                .annotate(keys::GPU_MEMORY, "5Gi"),
            Bytes::gib(5),
            BudgetSource::Annotation,
            "cuda",
        ),
        (
            "AMD GPU with its product label: rocm",
            trainer_pod()
                .limit("amd.com/gpu", "1")
                .select("amd.com/gpu.product-name", "AMD_Instinct_MI300X_OAM"),
            Bytes(205_822_885_888),
            BudgetSource::GpuProduct("AMD_Instinct_MI300X_OAM".into()),
            "rocm",
        ),
        (
            "a new product from the table: B200",
            trainer_pod().gpus(1).node_selector("NVIDIA-B200"),
            Bytes::mib(182525),
            BudgetSource::GpuProduct("NVIDIA-B200".into()),
            "cuda",
        ),
    ];
    for (name, pod, memory, source, device) in rows {
        let (b, d, warnings) = decide(pod);
        assert_eq!(b.device_memory, memory, "{name}");
        assert_eq!(b.source, source, "{name}");
        assert_eq!(d, device, "{name}");
        assert_eq!(b.bytes, Bytes::from_f64(memory.as_f64() * 0.9), "{name}");
        assert!(
            !warnings
                .iter()
                .any(|w| w.contains("ignored") || w.contains("unknown")),
            "{name}: {warnings:?}"
        );
    }
}

#[test]
fn a_mig_profile_nobody_published_takes_its_nominal_size_with_a_warning() {
    let (b, device, warnings) = decide(trainer_pod().limit("nvidia.com/mig-1g.12gb", "1"));
    assert_eq!(device, "cuda");
    assert_eq!(b.device_memory, Bytes(12_000_000_000));
    assert_eq!(b.source, mig("1g.12gb: nominal"));
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("1g.12gb") && w.contains("nominal")),
        "{warnings:?}"
    );
}

#[test]
fn time_slicing_without_a_cap_warns_that_the_memory_is_shared() {
    let shared = |w: &Vec<String>| w.iter().any(|w| w.contains("time-sliced"));
    let (b, _, warnings) = decide(trainer_pod().gpus(1).node_selector("Tesla-T4-SHARED"));
    assert_eq!(b.source, BudgetSource::GpuProduct("Tesla-T4".into()));
    assert!(shared(&warnings), "{warnings:?}");
    let (_, _, warnings) = decide(trainer_pod().limit("nvidia.com/gpu.shared", "1"));
    assert!(shared(&warnings), "{warnings:?}");
    let (_, _, warnings) = decide(
        trainer_pod()
            .gpus(1)
            .select("nvidia.com/gpu.sharing-strategy", "time-slicing"),
    );
    assert!(shared(&warnings), "{warnings:?}");
    // A cap is what the pod has: no warning.
    let (b, _, warnings) = decide(
        trainer_pod()
            .limit("nvidia.com/gpu.shared", "1")
            .annotate("gpu-memory", "4000"),
    );
    assert_eq!(b.device_memory, Bytes::mib(4000));
    assert!(!shared(&warnings), "{warnings:?}");
}

#[test]
fn an_unknown_accelerator_is_a_warning_never_a_guess() {
    let pod = trainer_pod()
        .limit("example.com/npu", "1")
        .memory_limit("16Gi");
    let Outcome::Mutated(m) = mutate(
        &pod.clone().build(),
        &Policy::default(),
        &ClusterView::default(),
    ) else {
        panic!("expected a mutation");
    };
    // No plan against the host's memory, no `fits`: a warning saying how to state the memory.
    assert!(m.budget.is_none(), "{:?}", m.budget);
    let annotation: serde_json::Value = serde_json::from_str(&m.estimate.to_json()).expect("JSON");
    assert!(annotation["fits"].is_null(), "{annotation}");
    assert!(annotation["budget"].is_null(), "{annotation}");
    assert!(
        m.warnings
            .iter()
            .any(|w| w.contains("unknown accelerator example.com/npu")
                && w.contains("no plan")
                && w.contains(keys::GPU_MEMORY)),
        "{:?}",
        m.warnings
    );
    // Stated: planned against it.
    let (b, _, _) = decide(pod.annotate(keys::GPU_MEMORY, "32Gi"));
    assert_eq!(b.source, BudgetSource::Annotation);
    assert_eq!(b.device_memory, Bytes::gib(32));
}

#[test]
fn a_cloud_accelerator_label_pins_the_product() {
    let product = |p: &str| BudgetSource::GpuProduct(p.into());
    for (label, value, source) in [
        (
            "cloud.google.com/gke-accelerator",
            "nvidia-tesla-a100",
            product("NVIDIA-A100-SXM4-40GB"),
        ),
        (
            "cloud.google.com/gke-accelerator",
            "nvidia-l4",
            product("NVIDIA-L4"),
        ),
        (
            "k8s.amazonaws.com/accelerator",
            "nvidia-a10g",
            product("NVIDIA-A10G"),
        ),
        (
            "karpenter.k8s.aws/instance-gpu-name",
            "a100",
            product("NVIDIA-A100-SXM4-40GB"),
        ),
        (
            "eks.amazonaws.com/instance-gpu-name",
            "h100",
            product("NVIDIA-H100-80GB-HBM3"),
        ),
        // AKS: no product label, the VM size names the GPU.
        (
            "node.kubernetes.io/instance-type",
            "Standard_NC24ads_A100_v4",
            product("NVIDIA-A100-80GB-PCIe"),
        ),
        (
            "node.kubernetes.io/instance-type",
            "standard_nc4as_t4_v3",
            product("Tesla-T4"),
        ),
    ] {
        let (b, _, warnings) = decide(trainer_pod().gpus(1).node_label(label, value));
        assert_eq!(b.source, source, "{label}={value}");
        assert!(
            !warnings.iter().any(|w| w.contains("assum")),
            "{label}={value}: {warnings:?}"
        );
    }
    // A CPU size (or a GPU type not in the tables) pins nothing; AWS's GPU types do (issue 38:
    // `p4d.24xlarge` used to pin nothing here).
    let (b, _, _) = decide(
        trainer_pod()
            .gpus(1)
            .node_label("node.kubernetes.io/instance-type", "m5.24xlarge"),
    );
    assert_eq!(b.source, BudgetSource::PolicyDefault);
    // An unknown value is named, not taken for a product.
    let (b, _, warnings) = decide(
        trainer_pod()
            .gpus(1)
            .node_label("cloud.google.com/gke-accelerator", "nvidia-future-9000"),
    );
    assert_eq!(b.source, BudgetSource::PolicyDefault);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("cloud.google.com/gke-accelerator=nvidia-future-9000")),
        "{warnings:?}"
    );
}

#[test]
fn an_unpinned_gpu_pod_is_told_the_default_was_assumed() {
    let (b, _, warnings) = decide(trainer_pod().gpus(1));
    assert_eq!(b.source, BudgetSource::PolicyDefault);
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with(memguard_decide::budget::ASSUMED_DEFAULT)
                && w.contains(keys::GPU_MEMORY)),
        "{warnings:?}"
    );
    // Issue 38: the size is said back as the policy wrote it (`80Gi`), not as `80.00 GiB`.
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("memguard: assumed defaultGpuMemory 80Gi (")),
        "{warnings:?}"
    );
}

#[test]
fn unreadable_sharing_values_are_ignored_with_a_warning_naming_the_key() {
    let (b, _, warnings) = decide(
        trainer_pod()
            .gpus(1)
            .annotate("gpu-fraction", "half")
            .limit("nvidia.com/gpumem-percentage", "150")
            .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=lots"),
    );
    assert_eq!(b.source, BudgetSource::PolicyDefault);
    for key in [
        "gpu-fraction",
        "nvidia.com/gpumem-percentage",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    ] {
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("ignored") && w.contains(key)),
            "{key}: {warnings:?}"
        );
    }
}

#[test]
fn a_dra_claim_is_admitted_with_a_warning_naming_the_claim() {
    let pod = trainer_pod().gpus(1).spec(
        "resourceClaims",
        serde_json::json!([{"name": "gpu", "resourceClaimTemplateName": "one-h100"}]),
    );
    let (b, _, warnings) = decide(pod);
    assert_eq!(b.source, BudgetSource::PolicyDefault);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("DRA claim gpu (template one-h100)")),
        "{warnings:?}"
    );
}

#[test]
fn mps_limits_parse_with_their_units_and_refuse_nonsense() {
    use memguard_api::pod::parse_mps_limit;
    assert_eq!(parse_mps_limit("0=2G"), Ok(2 << 30));
    assert_eq!(parse_mps_limit("0=1024M,1=512M"), Ok(512 << 20));
    assert_eq!(parse_mps_limit("0=1073741824"), Ok(1 << 30));
    for bad in ["", "2G", "0=", "0=2X", "=2G", "0=-1G", "0=99999999999T"] {
        assert!(parse_mps_limit(bad).is_err(), "{bad}");
    }
}

#[test]
fn the_product_label_constant_is_the_one_gfd_writes() {
    // The MIG single strategy rests on this label; a rename would silently lose every slice.
    assert_eq!(NVIDIA_GPU_PRODUCT_LABEL, "nvidia.com/gpu.product");
}
