//! Pod builders for tests: `PodBuilder::trainer().annotate("model", "llama-3-8b").gpus(1)`.

use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus,
    EnvVar, Pod, PodSpec, PodStatus, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use memguard_api::estimate::{BudgetSource, ESTIMATE_VERSION, EstimateAnnotation};
use memguard_api::{Summary, annotations, wellknown};
use memguard_estimator::Bytes;
use std::collections::BTreeMap;

/// `seconds` after the epoch.
pub fn at(seconds: i64) -> Time {
    Time(k8s_openapi::jiff::Timestamp::from_second(seconds).expect("in range"))
}

/// A pod under construction: one container `trainer`, opted in, in namespace `ml`.
#[derive(Debug, Clone)]
pub struct PodBuilder {
    pod: Pod,
}

impl PodBuilder {
    /// `trainer-0` (UID `uid-0`) in `ml`, labelled for memguard, one container `trainer`.
    pub fn trainer() -> Self {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some("trainer-0".into()),
                namespace: Some("ml".into()),
                uid: Some("uid-0".into()),
                labels: Some(BTreeMap::from([(
                    wellknown::ENABLED_LABEL.to_string(),
                    wellknown::ENABLED_VALUE.to_string(),
                )])),
                annotations: Some(BTreeMap::new()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "trainer".into(),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            status: Some(PodStatus::default()),
        };
        PodBuilder { pod }
    }

    fn meta(&mut self) -> &mut ObjectMeta {
        &mut self.pod.metadata
    }

    fn spec(&mut self) -> &mut PodSpec {
        self.pod.spec.get_or_insert_with(PodSpec::default)
    }

    fn status(&mut self) -> &mut PodStatus {
        self.pod.status.get_or_insert_with(PodStatus::default)
    }

    /// Sets `memguard.io/<key>` (or `key` itself when it already has a prefix).
    pub fn annotate(mut self, key: &str, value: &str) -> Self {
        let key = if key.contains('/') {
            key.to_string()
        } else {
            format!("memguard.io/{key}")
        };
        self.meta()
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(key, value.to_string());
        self
    }

    /// `memguard.io/estimate` as the webhook writes it: `uncalibrated` bytes (no calibration,
    /// so also the total) and, for a GPU pod, the memory of one GPU.
    pub fn estimated(self, uncalibrated: u64, gpu_memory: Option<u64>) -> Self {
        let annotation = EstimateAnnotation {
            v: ESTIMATE_VERSION,
            total: Bytes(uncalibrated),
            upper: None,
            upper_level: None,
            tensor_peak: Bytes(uncalibrated / 2),
            budget: gpu_memory.map(|g| Bytes(g / 10 * 9)),
            fits: gpu_memory.map(|g| uncalibrated <= g / 10 * 9),
            steps: Vec::new(),
            device: if gpu_memory.is_some() { "cuda" } else { "cpu" }.into(),
            gpu_memory: gpu_memory.map(Bytes),
            budget_source: gpu_memory.map(|_| BudgetSource::Annotation),
            config: BTreeMap::new(),
            uncalibrated: Bytes(uncalibrated),
            calibration: None,
            recovery: None,
            sources: BTreeMap::new(),
            unknown: BTreeMap::new(),
            read: BTreeMap::new(),
            changed: Vec::new(),
            args: None,
            host: None,
        };
        self.annotate(annotations::ESTIMATE, &annotation.to_json())
    }

    /// Removes the annotation `key` (with its prefix).
    pub fn without_annotation(mut self, key: &str) -> Self {
        if let Some(a) = self.meta().annotations.as_mut() {
            a.remove(key);
        }
        self
    }

    /// Name and UID.
    pub fn named(mut self, name: &str, uid: &str) -> Self {
        self.meta().name = Some(name.into());
        self.meta().uid = Some(uid.into());
        self
    }

    /// `nvidia.com/gpu` limit of the trainer.
    pub fn gpus(mut self, n: u64) -> Self {
        self.spec().containers[0]
            .resources
            .get_or_insert_with(ResourceRequirements::default)
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert(
                wellknown::NVIDIA_GPU_RESOURCE.into(),
                Quantity(n.to_string()),
            );
        self
    }

    /// `limits.memory` of the trainer.
    pub fn memory_limit(mut self, quantity: &str) -> Self {
        self.spec().containers[0]
            .resources
            .get_or_insert_with(ResourceRequirements::default)
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert("memory".into(), Quantity(quantity.into()));
        self
    }

    /// A node selector entry.
    pub fn node_selector(mut self, key: &str, value: &str) -> Self {
        self.spec()
            .node_selector
            .get_or_insert_with(BTreeMap::new)
            .insert(key.into(), value.into());
        self
    }

    /// A literal env variable of the trainer.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.spec().containers[0]
            .env
            .get_or_insert_with(Vec::new)
            .push(EnvVar {
                name: name.into(),
                value: Some(value.into()),
                value_from: None,
            });
        self
    }

    /// The trainer's current state: terminated with `reason` and `exit_code` at `finished`.
    pub fn trainer_terminated(mut self, reason: &str, exit_code: i32, finished: i64) -> Self {
        let status = container_status("trainer", terminated(reason, exit_code, finished, None));
        self.status()
            .container_statuses
            .get_or_insert_with(Vec::new)
            .push(status);
        self
    }

    /// The trainer's current state: `Error` with `exit_code` and a termination `message`.
    pub fn trainer_failed_with(mut self, exit_code: i32, message: &str, finished: i64) -> Self {
        let state = terminated("Error", exit_code, finished, Some(message.into()));
        let status = container_status("trainer", state);
        self.status()
            .container_statuses
            .get_or_insert_with(Vec::new)
            .push(status);
        self
    }

    /// The trainer running again after it terminated (restarted in place).
    pub fn trainer_restarted(mut self, reason: &str, exit_code: i32, finished: i64) -> Self {
        let mut status = container_status(
            "trainer",
            ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..ContainerState::default()
            },
        );
        status.last_state = Some(terminated(reason, exit_code, finished, None));
        status.restart_count = 1;
        self.status()
            .container_statuses
            .get_or_insert_with(Vec::new)
            .push(status);
        self
    }

    /// The trainer still running.
    pub fn trainer_running(mut self) -> Self {
        let status = container_status(
            "trainer",
            ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..ContainerState::default()
            },
        );
        self.status()
            .container_statuses
            .get_or_insert_with(Vec::new)
            .push(status);
        self
    }

    /// The native sidecar (in `initContainerStatuses`) terminated with `summary` as message.
    pub fn native_sidecar_done(mut self, summary: &Summary) -> Self {
        let message = serde_json::to_string(summary).expect("a summary serializes");
        let status = container_status(
            wellknown::SIDECAR_CONTAINER,
            terminated("Completed", 0, 0, Some(message)),
        );
        self.status()
            .init_container_statuses
            .get_or_insert_with(Vec::new)
            .push(status);
        self
    }

    /// The classic sidecar (in `containerStatuses`) terminated with `message`.
    pub fn classic_sidecar_done(mut self, message: &str) -> Self {
        let status = container_status(
            wellknown::SIDECAR_CONTAINER,
            terminated("Completed", 0, 0, Some(message.into())),
        );
        self.status()
            .container_statuses
            .get_or_insert_with(Vec::new)
            .push(status);
        self
    }

    /// The native sidecar still running.
    pub fn native_sidecar_running(mut self) -> Self {
        let status = container_status(
            wellknown::SIDECAR_CONTAINER,
            ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..ContainerState::default()
            },
        );
        self.status()
            .init_container_statuses
            .get_or_insert_with(Vec::new)
            .push(status);
        self
    }

    /// `status.phase`.
    pub fn phase(mut self, phase: &str) -> Self {
        self.status().phase = Some(phase.into());
        self
    }

    /// The pod.
    pub fn build(self) -> Pod {
        self.pod
    }
}

fn container_status(name: &str, state: ContainerState) -> ContainerStatus {
    ContainerStatus {
        name: name.into(),
        state: Some(state),
        ..ContainerStatus::default()
    }
}

fn terminated(
    reason: &str,
    exit_code: i32,
    finished: i64,
    message: Option<String>,
) -> ContainerState {
    ContainerState {
        terminated: Some(ContainerStateTerminated {
            reason: Some(reason.into()),
            exit_code,
            finished_at: Some(at(finished)),
            message,
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    }
}

/// A summary with the given peaks and limit.
pub fn summary(peak: Option<u64>, gpu_peak: Option<u64>, limit: Option<u64>) -> Summary {
    Summary {
        version: 1,
        peak_bytes: peak,
        gpu_peak_bytes: gpu_peak,
        limit_bytes: limit,
        exit_reason: "trainer-exited".into(),
        ..Summary::default()
    }
}

/// A tiny Llama as the client reports it at train start (`Report.config`: full fine-tuning on
/// the CPU), every value the estimate needs.
pub fn tiny_llama_report() -> BTreeMap<String, f64> {
    [
        ("batch-size", 16.0),
        ("grad-accumulation", 1.0),
        ("seq-length", 512.0),
        ("grad-checkpointing", 0.0),
        ("world-size", 1.0),
        ("params", 4_300_000.0),
        ("trainable-params", 4_300_000.0),
        ("hidden-size", 64.0),
        ("num-layers", 2.0),
        ("num-heads", 4.0),
        ("num-kv-heads", 4.0),
        ("head-dim", 16.0),
        ("intermediate-size", 256.0),
        ("vocab-size", 32_000.0),
        ("num-experts", 1.0),
        ("tie-embeddings", 0.0),
        ("gated-ffn", 1.0),
        ("param-bits", 32.0),
        ("quant-bits", 0.0),
        ("optimizer", 0.0),
        ("fused-loss", 0.0),
        ("bf16", 0.0),
        ("fp16", 0.0),
        ("flash-attention", 1.0),
        ("gpu", 0.0),
        ("local-ranks", 1.0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}
