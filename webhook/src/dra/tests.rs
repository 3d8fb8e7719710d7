use super::*;
use crate::testutil::trainer_pod;
use memguard_api::Policy;
use memguard_estimator::{Bytes, Device};
use serde_json::json;

const OBJECTS: &str = include_str!("../../tests/fixtures/dra/objects.yaml");

fn catalog() -> StaticCatalog {
    StaticCatalog::from_yaml(OBJECTS).expect("fixture objects")
}

/// A pod in `ml` whose trainer uses one claim `gpu` from `source` (`resourceClaimTemplateName`
/// or `resourceClaimName`).
fn reading(source: &str, name: &str, catalog: Option<&dyn DraCatalog>) -> DraReading {
    let pod = trainer_pod()
        .spec("resourceClaims", json!([{"name": "gpu", source: name}]))
        .build();
    let trainer = &pod.spec.as_ref().expect("spec").containers[0];
    read(&pod, trainer, catalog, &Policy::default())
}

#[test]
fn a_template_on_a_typed_class_takes_the_smallest_matching_gpu_capped_by_the_table() {
    let c = catalog();
    let r = reading("resourceClaimTemplateName", "single-h100", Some(&c));
    let m = r.memory.expect("sized");
    // 81559Mi published; the table's NVML-usable figure for the H100 is smaller and wins.
    assert_eq!(m.bytes, Bytes::mib(81008));
    assert_eq!(m.device, Device::Cuda);
    assert!(
        m.detail.contains("table NVIDIA-H100-80GB-HBM3"),
        "{}",
        m.detail
    );
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
}

#[test]
fn first_available_takes_the_smallest_alternative() {
    let c = catalog();
    let m = reading("resourceClaimTemplateName", "mig-or-gpu", Some(&c))
        .memory
        .expect("sized");
    assert_eq!(
        m.bytes,
        Bytes::mib(9984),
        "the MIG slice, not the whole GPU"
    );
}

#[test]
fn an_unevaluated_selector_is_a_warning_and_the_smallest_candidate() {
    let c = catalog();
    let r = reading("resourceClaimTemplateName", "gpu-40gi-plus", Some(&c));
    assert_eq!(r.memory.expect("sized").bytes, Bytes::mib(81008));
    assert!(
        r.warnings[0].contains("1 CEL selector(s) not evaluated"),
        "{:?}",
        r.warnings
    );
}

#[test]
fn an_allocated_claim_reads_its_device() {
    let c = catalog();
    let m = reading("resourceClaimName", "shared-h200", Some(&c))
        .memory
        .expect("sized");
    assert_eq!(
        m.bytes,
        Bytes::mib(143071),
        "the table's H200, below 143771Mi"
    );
    assert!(
        m.detail.starts_with("allocated node-b/gpu-0"),
        "{}",
        m.detail
    );
}

#[test]
fn each_missing_object_is_named() {
    let c = catalog();
    let empty = StaticCatalog::default();
    let cases: Vec<(&str, &str, &dyn DraCatalog, &str)> = vec![
        (
            "resourceClaimTemplateName",
            "absent",
            &c,
            "ResourceClaimTemplate ml/absent not found",
        ),
        (
            "resourceClaimName",
            "absent",
            &c,
            "ResourceClaim ml/absent not found",
        ),
        (
            "resourceClaimTemplateName",
            "one-mi300x",
            &c,
            "no ResourceSlice of driver gpu.amd.com",
        ),
        (
            "resourceClaimTemplateName",
            "single-h100",
            &empty,
            "not found",
        ),
    ];
    for (source, name, catalog, want) in cases {
        let r = reading(source, name, Some(catalog));
        assert_eq!(r.memory, None, "{name}");
        assert!(
            r.warnings.iter().any(|w| w.contains(want)),
            "{name}: {:?}",
            r.warnings
        );
        assert!(
            r.warnings[0].starts_with("DRA claim gpu ("),
            "{:?}",
            r.warnings
        );
    }
    let mut no_class = catalog();
    no_class.classes.clear();
    let r = reading("resourceClaimTemplateName", "single-h100", Some(&no_class));
    assert!(
        r.warnings[0].contains("DeviceClass gpu.nvidia.com not found"),
        "{:?}",
        r.warnings
    );
}

/// A catalog that cannot answer (no RBAC, not synced, API not served) says why.
struct Unavailable;
impl DraCatalog for Unavailable {
    fn unavailable(&self) -> Option<String> {
        Some("resource.k8s.io/v1 not served by this cluster".into())
    }
    fn claim(&self, _: &str, _: &str) -> Option<ResourceClaim> {
        panic!("not asked when unavailable")
    }
    fn claim_template(&self, _: &str, _: &str) -> Option<ResourceClaimTemplate> {
        panic!("not asked when unavailable")
    }
    fn device_class(&self, _: &str) -> Option<DeviceClass> {
        panic!("not asked when unavailable")
    }
    fn slices(&self, _: &str) -> Vec<ResourceSlice> {
        panic!("not asked when unavailable")
    }
}

#[test]
fn an_unavailable_or_absent_catalog_is_one_warning_naming_why() {
    let r = reading(
        "resourceClaimTemplateName",
        "single-h100",
        Some(&Unavailable),
    );
    assert_eq!(r.memory, None);
    assert_eq!(
        r.warnings,
        vec![
            "DRA claim gpu (template single-h100): device memory unknown \
             (resource.k8s.io/v1 not served by this cluster)"
                .to_string()
        ]
    );
    let r = reading("resourceClaimTemplateName", "single-h100", None);
    assert!(r.warnings[0].contains("no DRA catalog"), "{:?}", r.warnings);
}

#[test]
fn objects_of_other_kinds_or_versions_are_refused_by_name() {
    let e = StaticCatalog::from_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
        .expect_err("a pod");
    assert!(e.contains("Pod p: apiVersion `v1`"), "{e}");
    let e = StaticCatalog::from_yaml(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimz\nmetadata: {name: x}\n",
    )
    .expect_err("a typo");
    assert!(e.contains("`ResourceClaimz` x is no DRA object"), "{e}");
}

#[test]
fn the_claims_driver_names_the_device_only_when_nothing_else_does() {
    let c = catalog();
    let r = reading("resourceClaimTemplateName", "single-h100", Some(&c));
    let m = r.memory.clone().expect("sized");
    assert_eq!(
        r.on(Device::Cpu, false),
        (Device::Cuda, Some(&m)),
        "a GPU pod now"
    );
    assert_eq!(
        r.on(Device::Cpu, true),
        (Device::Cpu, None),
        "cpu by annotation stays"
    );
    assert_eq!(
        r.on(Device::Rocm, true),
        (Device::Rocm, None),
        "another device: not counted"
    );
    assert_eq!(r.on(Device::Cuda, true), (Device::Cuda, Some(&m)));
    let none = DraReading::default();
    assert_eq!(none.on(Device::Cpu, false), (Device::Cpu, None));
}

#[test]
fn the_gpu_memory_annotation_silences_dra_warnings_and_wins() {
    use crate::{ClusterView, Outcome, mutate};
    let pod = trainer_pod()
        .annotate(memguard_api::annotations::GPU_MEMORY, "40Gi")
        .annotate(memguard_api::annotations::DEVICE, "cuda")
        .spec(
            "resourceClaims",
            json!([{"name": "gpu", "resourceClaimTemplateName": "absent"}]),
        )
        .build();
    let profiles = ClusterView::default().with_dra(std::sync::Arc::new(catalog()));
    let Outcome::Mutated(m) = mutate(&pod, &Policy::default(), &profiles) else {
        panic!("not mutated");
    };
    assert_eq!(m.budget.expect("budget").device_memory, Bytes::gib(40));
    assert!(
        !m.warnings.iter().any(|w| w.contains("DRA")),
        "{:?}",
        m.warnings
    );
}

/// A pod known as a GPU pod only through its DRA claim: the profile controller keys its run as
/// admission keyed it, so what the run taught (here the recovery after an OOM kill) reaches the
/// next admission. (Before the learn key read DRA, the run was recorded under the `cpu` key and
/// admission, reading the `gpu` one, never saw it.)
#[test]
fn a_dra_only_gpu_pods_run_is_learned_under_the_key_its_next_admission_reads() {
    use crate::{ClusterView, Outcome, mutate};
    use memguard_api::crd::{DeviceClass as KeyDeviceClass, MemoryProfile};
    let catalog = std::sync::Arc::new(catalog());
    let policy = Policy::default();
    let pod = trainer_pod()
        .annotate(memguard_api::annotations::BATCH_SIZE, "8")
        .spec(
            "resourceClaims",
            json!([{"name": "gpu", "resourceClaimTemplateName": "single-h100"}]),
        )
        .build();
    let admit = |profiles: &ClusterView| match mutate(&pod, &policy, profiles) {
        Outcome::Mutated(m) => m,
        other => panic!("not mutated: {other:?}"),
    };
    let first = admit(&ClusterView::default().with_dra(catalog.clone()));
    assert_eq!(first.estimate.device, "cuda");
    assert_eq!(first.estimate.recovery, None);

    // The pod as admitted, then OOM-killed.
    let patch = crate::patch::build(&pod, &Outcome::Mutated(first.clone()));
    let mut ran = serde_json::to_value(&pod).expect("json");
    json_patch::patch(&mut ran, &patch).expect("the patch applies");
    ran["metadata"]["uid"] = json!("u-1");
    ran["status"] = json!({"phase": "Failed", "containerStatuses": [{
        "name": "train", "image": "trainer:1", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                 "finishedAt": "2026-01-01T00:00:00Z"}}}]});
    let ran: k8s_openapi::api::core::v1::Pod = serde_json::from_value(ran).expect("a pod");
    let obs = memguard_learn::try_observe(
        &ran,
        &policy,
        memguard_api::Cluster::with_dra(Some(
            catalog.as_ref() as &dyn memguard_api::dra::DraCatalog
        )),
    )
    .expect("observed");
    assert_eq!(obs.oom.as_deref(), Some("OOMKilled"));
    assert_eq!(obs.key.spec.device_class, KeyDeviceClass::Gpu);
    let admission_key = memguard_decide::pod_key(
        &pod,
        &policy,
        memguard_api::Cluster::with_dra(Some(
            catalog.as_ref() as &dyn memguard_api::dra::DraCatalog
        )),
    )
    .expect("a key");
    assert_eq!(obs.key, admission_key);

    let mut profile = MemoryProfile::new(&obs.key.name, obs.key.spec.clone());
    profile.status = Some(memguard_learn::apply(&Default::default(), &obs));
    let mut profiles = ClusterView::default().with_dra(catalog.clone());
    profiles.insert(profile);
    let next = admit(&profiles);
    assert!(next.estimate.recovery.is_some(), "{:?}", next.estimate);
    // The learnt profile makes the next pod start smaller (whichever step saves most).
    assert!(
        next.plan.estimate.total < first.plan.estimate.total,
        "a step down: {:?} after {:?}",
        next.plan.steps,
        first.plan.steps
    );
}
