//! The GPU budget the node may enforce (issue 38, item 5): `NVIDIA_GPU_MEMORY_REQUEST` and
//! `NVIDIA_GPU_MEMORY_LIMIT` on the trainer, from the plan and the pod's share, for nodes whose
//! driver enforces per-container GPU memory through the container toolkit (driver r615 or
//! later, kernel 6.14 or later: the `dmem` cgroup controller). Policy-gated
//! (`enforceGpuMemory`, off by default). Untested on hardware: no such node has been lent yet.
//! Pure.

use k8s_openapi::api::core::v1::Container;
use memguard_api::wellknown::{NVIDIA_GPU_MEMORY_LIMIT_ENV, NVIDIA_GPU_MEMORY_REQUEST_ENV};
use memguard_decide::budget::{Budget, BudgetSource};
use memguard_decide::warnings::truncate;
use memguard_estimator::{Device, DowngradePlan};

/// The two variables for a CUDA trainer whose budget is a GPU's (or a slice's): the request is
/// what the plan needs at its upper bound (never above the share), the limit the pod's share
/// of one device, both in bytes. A variable the trainer already sets is kept as it is, and a
/// warning says so. Nothing when the policy is off, the trainer is not on CUDA, or its budget
/// is its memory limit (a CPU pod).
pub fn env(
    enforce: bool,
    trainer: &Container,
    plan: &DowngradePlan,
    budget: Option<&Budget>,
    warnings: &mut Vec<String>,
) -> Vec<(String, String)> {
    let Some(budget) = budget.filter(|b| b.source != BudgetSource::MemoryLimit) else {
        return Vec::new();
    };
    if !enforce || plan.config.device != Device::Cuda {
        return Vec::new();
    }
    let limit = budget.device_memory.0;
    let request = plan.upper().0.min(limit);
    let mut out = Vec::new();
    for (name, value) in [
        (NVIDIA_GPU_MEMORY_REQUEST_ENV, request),
        (NVIDIA_GPU_MEMORY_LIMIT_ENV, limit),
    ] {
        let own = trainer.env.iter().flatten().find(|e| e.name == name);
        match own {
            Some(e) => warnings.push(truncate(&format!(
                "memguard: {name} in {} kept as the pod sets it ({}); the plan's is {value}",
                trainer.name,
                e.value.as_deref().unwrap_or("valueFrom"),
            ))),
            None => out.push((name.to_string(), value.to_string())),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::mutate::mutate;
    use crate::outcome::{Mutation, Outcome};
    use crate::testutil::{PodBuilder, trainer_pod};
    use crate::watch::ClusterView;
    use memguard_api::wellknown::{NVIDIA_GPU_MEMORY_LIMIT_ENV, NVIDIA_GPU_MEMORY_REQUEST_ENV};
    use memguard_api::{Policy, PolicySpec};

    fn policy(enforce: bool) -> Policy {
        let spec: PolicySpec = serde_json::from_value(serde_json::json!({
            "gpuMemory": {"NVIDIA-A10G": "24Gi"},
            "enforceGpuMemory": enforce,
        }))
        .expect("valid policy");
        spec.resolved().expect("valid values")
    }

    fn mutated(pod: PodBuilder, policy: &Policy) -> Mutation {
        match mutate(&pod.build(), policy, &ClusterView::default()) {
            Outcome::Mutated(m) => *m,
            other => panic!("expected a mutation, got {other:?}"),
        }
    }

    fn env<'a>(m: &'a Mutation, name: &str) -> Option<&'a str> {
        m.trainer_env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn a10g() -> PodBuilder {
        trainer_pod().gpus(1).node_selector("NVIDIA-A10G")
    }

    #[test]
    fn on_a_gpu_the_request_is_the_plans_need_and_the_limit_the_share() {
        let m = mutated(a10g(), &policy(true));
        let budget = m.budget.as_ref().expect("a GPU budget");
        let limit: u64 = env(&m, NVIDIA_GPU_MEMORY_LIMIT_ENV)
            .expect("limit written")
            .parse()
            .expect("bytes");
        let request: u64 = env(&m, NVIDIA_GPU_MEMORY_REQUEST_ENV)
            .expect("request written")
            .parse()
            .expect("bytes");
        assert_eq!(limit, 24 << 30);
        assert_eq!(limit, budget.device_memory.0);
        assert_eq!(request, m.plan.upper().0.min(limit));
        assert!(request > 0 && request <= limit);
    }

    #[test]
    fn off_by_default_and_never_for_a_cpu_pod() {
        let off = mutated(a10g(), &policy(false));
        assert_eq!(env(&off, NVIDIA_GPU_MEMORY_LIMIT_ENV), None);
        let default: PolicySpec =
            serde_json::from_value(serde_json::json!({})).expect("valid policy");
        assert!(!default.resolved().expect("valid").enforce_gpu_memory);
        let cpu = mutated(
            trainer_pod()
                .annotate(memguard_api::annotations::DEVICE, "cpu")
                .memory_limit("64Gi"),
            &policy(true),
        );
        assert_eq!(env(&cpu, NVIDIA_GPU_MEMORY_REQUEST_ENV), None);
        assert_eq!(env(&cpu, NVIDIA_GPU_MEMORY_LIMIT_ENV), None);
    }

    #[test]
    fn a_value_the_pod_sets_is_kept_and_a_warning_says_so() {
        let m = mutated(
            a10g().env(NVIDIA_GPU_MEMORY_LIMIT_ENV, "1000"),
            &policy(true),
        );
        assert_eq!(env(&m, NVIDIA_GPU_MEMORY_LIMIT_ENV), None, "not overridden");
        assert!(env(&m, NVIDIA_GPU_MEMORY_REQUEST_ENV).is_some());
        assert!(
            m.warnings
                .iter()
                .any(|w| w
                    .contains("NVIDIA_GPU_MEMORY_LIMIT in train kept as the pod sets it (1000)")),
            "{:?}",
            m.warnings
        );
    }
}
