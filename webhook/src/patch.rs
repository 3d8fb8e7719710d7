//! Expressing a decision: [`Outcome`] → RFC 6902 JSON patch against the pod as it is.
//!
//! The patch is a difference: it only adds or replaces what is missing or different, so applying
//! the same [`Outcome`] to an already mutated pod yields an empty patch. Arrays are never
//! replaced wholesale: a missing array is created with `add`, an element is appended with `/-`
//! or replaced at its own index. Keys are JSON-pointer escaped (`memguard.io/estimate` →
//! `memguard.io~1estimate`).

use crate::outcome::{ClientPlan, Guarded, Mutation, Outcome, SidecarPlan};
use crate::serving::ServerAdmission;
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation, ReplaceOperation};
use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec};
use memguard_api::annotations as keys;
use memguard_api::launch::{ArgvEdit, Field};
use memguard_api::policy::SidecarMode;
use memguard_api::{env, wellknown};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// Longest `memguard.io/error` value written (the full list of annotation errors fits easily).
pub const MAX_ERROR_CHARS: usize = 1024;

/// The trainer's `terminationMessagePolicy` when the user set none.
pub const FALLBACK_TO_LOGS_ON_ERROR: &str = "FallbackToLogsOnError";

/// The sidecar's non-root user (the distroless `nonroot` uid).
pub const SIDECAR_UID: i64 = 65532;

/// The patch that takes `pod` to what `outcome` asks for. Empty when nothing needs to change.
pub fn build(pod: &Pod, outcome: &Outcome) -> Patch {
    let mut ops = Ops::default();
    match outcome {
        Outcome::Unchanged => {}
        Outcome::Skipped { error, .. } => {
            let mut error: String = error.chars().take(MAX_ERROR_CHARS).collect();
            if error.is_empty() {
                error.push_str("unknown error");
            }
            annotate(pod, &mut ops, &[(keys::ERROR, error.as_str())], &[]);
        }
        Outcome::Mutated(m) => mutation(pod, m, &mut ops),
        Outcome::Guarded(g) => guarded(pod, g, &mut ops),
        Outcome::Served(s) => served(pod, s, &mut ops),
    }
    Patch(ops.0)
}

/// Who the sidecar runs as. It reads the trainer's cgroup through `/proc/<pid>/root`, which the
/// kernel opens only with ptrace-read access: the same uid and gid as the trainer, and no
/// capability the trainer has and the sidecar lacks (docs/sidecar.md, "Reading the trainer's
/// cgroup"). So the sidecar takes the trainer's identity, and never more: the pod needs no
/// Pod Security level it did not already need.
#[derive(Debug, Clone, PartialEq)]
pub enum SidecarIdentity {
    /// The trainer's non-root uid, and its gid (the pod's, else 0, what the runtime gives a uid
    /// its image does not list): no capabilities.
    TrainerUser {
        /// `runAsUser` of the trainer (container, else pod).
        uid: i64,
        /// `runAsGroup` of the trainer, when set.
        gid: Option<i64>,
    },
    /// The trainer runs as root, or as its image's user (root in most GPU images) where the pod
    /// allows root: root, with exactly the trainer's capabilities (`add`/`drop` copied, or the
    /// runtime's defaults when the trainer names none).
    Root {
        /// `runAsGroup` of the trainer, when set.
        gid: Option<i64>,
        /// The trainer's `capabilities`, verbatim.
        capabilities: Option<Value>,
    },
    /// The trainer's uid is unknown and root is not allowed (`runAsNonRoot`), or the trainer is
    /// privileged (no capability set short of that would cover it): the distroless nonroot user.
    /// The sidecar then sees only the trainer's summed RSS, and says so.
    Default,
}

impl SidecarIdentity {
    /// From the trainer's effective security context (the container's fields over the pod's).
    pub fn of_trainer(pod: &Pod, trainer: &Container) -> SidecarIdentity {
        let psc = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
        let csc = trainer.security_context.as_ref();
        if csc.and_then(|c| c.privileged) == Some(true) {
            return SidecarIdentity::Default;
        }
        let uid = csc
            .and_then(|c| c.run_as_user)
            .or(psc.and_then(|p| p.run_as_user));
        let gid = csc
            .and_then(|c| c.run_as_group)
            .or(psc.and_then(|p| p.run_as_group));
        let non_root = csc
            .and_then(|c| c.run_as_non_root)
            .or(psc.and_then(|p| p.run_as_non_root));
        match uid {
            Some(uid) if uid != 0 => SidecarIdentity::TrainerUser { uid, gid },
            Some(_) => SidecarIdentity::Root {
                gid,
                capabilities: capabilities(csc),
            },
            None if non_root == Some(true) => SidecarIdentity::Default,
            None => SidecarIdentity::Root {
                gid,
                capabilities: capabilities(csc),
            },
        }
    }

    /// The sidecar's `securityContext`: read-only root filesystem, no privilege escalation and
    /// the runtime's seccomp profile in every case.
    pub fn security_context(&self) -> Value {
        let mut sc = json!({
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "seccompProfile": {"type": "RuntimeDefault"},
        });
        match self {
            SidecarIdentity::TrainerUser { uid, gid } => {
                sc["runAsNonRoot"] = json!(true);
                sc["runAsUser"] = json!(uid);
                // Always a group: left out, each container would take its own image's group for
                // the uid (65532 in ours), and ptrace-read access needs the gids to match. A
                // trainer with no runAsGroup whose image does not list its uid runs as gid 0.
                sc["runAsGroup"] = json!(gid.unwrap_or(0));
                sc["capabilities"] = json!({"drop": ["ALL"]});
            }
            SidecarIdentity::Root { gid, capabilities } => {
                sc["runAsNonRoot"] = json!(false);
                sc["runAsUser"] = json!(0);
                sc["runAsGroup"] = json!(gid.unwrap_or(0));
                if let Some(caps) = capabilities {
                    sc["capabilities"] = caps.clone();
                }
            }
            SidecarIdentity::Default => {
                sc["runAsNonRoot"] = json!(true);
                sc["runAsUser"] = json!(SIDECAR_UID);
                sc["runAsGroup"] = json!(SIDECAR_UID);
                sc["capabilities"] = json!({"drop": ["ALL"]});
            }
        }
        sc
    }
}

fn capabilities(csc: Option<&k8s_openapi::api::core::v1::SecurityContext>) -> Option<Value> {
    let caps = csc?.capabilities.as_ref()?;
    serde_json::to_value(caps)
        .ok()
        .filter(|v| v.as_object().is_some_and(|o| !o.is_empty()))
}

/// The sidecar container as injected (JSON, ready for the patch). `restart_policy` is the pod's
/// (`None`: Kubernetes' default, `Always`): the sidecar waits for an OOM-killed trainer's
/// in-place restart only when one can come.
pub fn sidecar_container(
    plan: &SidecarPlan,
    trainer: &str,
    identity: &SidecarIdentity,
    restart_policy: Option<&str>,
) -> Value {
    let r = &plan.resources;
    let mut requests = Map::new();
    if let Some(cpu) = &r.cpu_request {
        requests.insert("cpu".into(), json!(cpu));
    }
    if let Some(mem) = &r.memory_request {
        requests.insert("memory".into(), json!(mem));
    }
    let mut limits = Map::new();
    if let Some(mem) = &r.memory_limit {
        limits.insert("memory".into(), json!(mem));
    }
    let mut env: Vec<Value> = plan
        .env
        .iter()
        .map(|(name, value)| json!({"name": name, "value": value}))
        .collect();
    env.push(json!({
        "name": env::SIDECAR_POD_RESTART_POLICY,
        // Only what the sidecar parses: an unknown value (the API server rejects it after
        // admission anyway) must not stop the sidecar.
        "value": restart_policy
            .filter(|p| matches!(*p, "OnFailure" | "Never"))
            .unwrap_or("Always"),
    }));
    env.push(json!({
        "name": env::TRAINER_MEMORY_LIMIT,
        "valueFrom": {"resourceFieldRef": {
            "containerName": trainer,
            "resource": "limits.memory",
            "divisor": "1",
        }},
    }));
    let metrics_port: u16 = wellknown::SIDECAR_METRICS_LISTEN
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(9092);
    let mut resources = Map::new();
    if !requests.is_empty() {
        resources.insert("requests".into(), Value::Object(requests));
    }
    if !limits.is_empty() {
        resources.insert("limits".into(), Value::Object(limits));
    }
    let mut c = json!({
        "name": wellknown::SIDECAR_CONTAINER,
        "image": plan.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["memguard-sidecar"],
        "env": env,
        "ports": [{
            "name": wellknown::SIDECAR_METRICS_PORT_NAME,
            "containerPort": metrics_port,
            "protocol": "TCP",
        }],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": wellknown::SIDECAR_METRICS_PORT_NAME},
            "periodSeconds": 10,
        },
        "resources": resources,
        "securityContext": identity.security_context(),
        "terminationMessagePath": wellknown::TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "volumeMounts": [{"name": wellknown::SIGNAL_VOLUME, "mountPath": wellknown::SIGNAL_DIR}],
    });
    if plan.mode == SidecarMode::Native {
        c["restartPolicy"] = json!("Always");
    }
    c
}

#[derive(Default)]
struct Ops(Vec<PatchOperation>);

impl Ops {
    fn add(&mut self, path: &[&str], value: Value) {
        self.0.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(path.iter().copied()),
            value,
        }));
    }

    fn replace(&mut self, path: &[&str], value: Value) {
        self.0.push(PatchOperation::Replace(ReplaceOperation {
            path: PointerBuf::from_tokens(path.iter().copied()),
            value,
        }));
    }

    /// Whether the array at `path` exists once the operations so far are applied: it did before,
    /// or an earlier step created it (an `add` of the whole array).
    fn exists_after(&self, path: &[&str], existed: bool) -> bool {
        let path = PointerBuf::from_tokens(path.iter().copied());
        existed
            || self
                .0
                .iter()
                .any(|op| matches!(op, PatchOperation::Add(a) if a.path == path))
    }

    fn remove(&mut self, path: &[&str]) {
        self.0.push(PatchOperation::Remove(RemoveOperation {
            path: PointerBuf::from_tokens(path.iter().copied()),
        }));
    }
}

/// The patch of a mutated pod: one named step per concern, in the order their operations go.
fn mutation(pod: &Pod, m: &Mutation, ops: &mut Ops) {
    let Some(spec) = pod.spec.as_ref() else {
        return;
    };
    let Some(trainer) = spec.containers.get(m.trainer_index) else {
        return;
    };
    let trainer_index = m.trainer_index.to_string();
    let trainer_path = ["spec", "containers", trainer_index.as_str()];
    trainer_env(trainer, &trainer_path, m, ops);
    trainer_command_line(trainer, &trainer_path, m, ops);
    injection(
        pod,
        trainer,
        &trainer_path,
        &m.sidecar,
        m.client.as_ref(),
        ops,
    );
    shm(spec, trainer, &trainer_path, m, ops);
    placement(spec, m, ops);
    shared_pid_namespace(spec, ops);
    estimate_and_error(pod, m, ops);
}

/// The patch of a trainer guarded at run time only ([`Guarded`]): the sidecar, the client and
/// what they share, as for a mutation, and `memguard.io/error` saying why nothing was planned.
/// Its command line, its knobs and its placement are left as they are.
fn guarded(pod: &Pod, g: &Guarded, ops: &mut Ops) {
    let Some(spec) = pod.spec.as_ref() else {
        return;
    };
    let Some(trainer) = spec.containers.get(g.trainer_index) else {
        return;
    };
    let trainer_index = g.trainer_index.to_string();
    let trainer_path = ["spec", "containers", trainer_index.as_str()];
    let desired: Vec<(&str, &str)> = g
        .trainer_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    set_env(trainer, &trainer_path, &desired, ops);
    injection(
        pod,
        trainer,
        &trainer_path,
        &g.sidecar,
        g.client.as_ref(),
        ops,
    );
    shared_pid_namespace(spec, ops);
    let reason: String = g.reason.chars().take(MAX_ERROR_CHARS).collect();
    annotate(
        pod,
        ops,
        &[(keys::ERROR, reason.as_str())],
        &[keys::ESTIMATE],
    );
}

/// What a planned and a run-time-only guard share: the signal volume and its mount, the
/// trainer's termination message policy, the client and the sidecar.
fn injection(
    pod: &Pod,
    trainer: &Container,
    trainer_path: &[&str],
    sidecar_plan: &SidecarPlan,
    client_plan: Option<&ClientPlan>,
    ops: &mut Ops,
) {
    let Some(spec) = pod.spec.as_ref() else {
        return;
    };
    signal_mount(trainer, trainer_path, ops);
    termination_message(trainer, trainer_path, ops);
    signal_volume(spec, ops);
    // The client's init container goes before a native sidecar: it has run to completion
    // before the sidecar starts looking for the trainer, so its process is never taken for it.
    client(
        pod,
        spec,
        trainer,
        trainer_path,
        client_plan,
        sidecar_plan,
        ops,
    );
    sidecar(pod, spec, trainer, sidecar_plan, ops);
}

/// The trainer's env: memguard's variables, then the user's own, rewritten in place.
fn trainer_env(trainer: &Container, trainer_path: &[&str], m: &Mutation, ops: &mut Ops) {
    let desired: Vec<(&str, &str)> = m
        .trainer_env
        .iter()
        .chain(&m.user_env)
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    set_env(trainer, trainer_path, &desired, ops);
}

/// The trainer's `command` and `args` as rewritten in its own flags (only when they differ).
fn trainer_command_line(trainer: &Container, trainer_path: &[&str], m: &Mutation, ops: &mut Ops) {
    let Some(line) = &m.command_line else {
        return;
    };
    for (key, have, want) in [
        ("command", &trainer.command, &line.command),
        ("args", &trainer.args, &line.args),
    ] {
        let Some(want) = want else { continue };
        if have.as_ref() == Some(want) {
            continue;
        }
        let mut path = trainer_path.to_vec();
        path.push(key);
        let value = json!(want);
        if have.is_some() {
            ops.replace(&path, value);
        } else {
            ops.add(&path, value);
        }
    }
}

/// The signal volume mounted in the trainer (unless something is mounted there already).
fn signal_mount(trainer: &Container, trainer_path: &[&str], ops: &mut Ops) {
    let mounted = trainer.volume_mounts.iter().flatten().any(|vm| {
        vm.name == wellknown::SIGNAL_VOLUME
            || vm.mount_path.trim_end_matches('/') == wellknown::SIGNAL_DIR
    });
    if !mounted {
        let mount = json!({"name": wellknown::SIGNAL_VOLUME, "mountPath": wellknown::SIGNAL_DIR});
        append(
            ops,
            trainer_path,
            "volumeMounts",
            trainer.volume_mounts.is_some(),
            mount,
        );
    }
}

/// A trainer that dies of a CUDA OOM without writing a record still reaches the profile
/// controller: on an error exit with an empty termination message the kubelet keeps the log
/// tail, which ends in "CUDA out of memory". A policy the user chose is theirs.
fn termination_message(trainer: &Container, trainer_path: &[&str], ops: &mut Ops) {
    if trainer.termination_message_policy.is_none() {
        ops.add(
            &[trainer_path, &["terminationMessagePolicy"]].concat(),
            json!(FALLBACK_TO_LOGS_ON_ERROR),
        );
    }
}

/// The memory-backed `/dev/shm` of a trainer with DataLoader workers ([`Mutation::shm`]): the
/// volume, unless one of its name is there, and its mount, unless something is mounted at
/// `/dev/shm` already.
fn shm(spec: &PodSpec, trainer: &Container, trainer_path: &[&str], m: &Mutation, ops: &mut Ops) {
    let Some(size) = m.shm else {
        return;
    };
    let name = wellknown::SHM_VOLUME;
    if !spec.volumes.iter().flatten().any(|v| v.name == name) {
        let exists = ops.exists_after(&["spec", "volumes"], spec.volumes.is_some());
        let size_limit = format!("{}Mi", size.0.div_ceil(1 << 20));
        let volume =
            json!({"name": name, "emptyDir": {"medium": "Memory", "sizeLimit": size_limit}});
        append(ops, &["spec"], "volumes", exists, volume);
    }
    let mounted = trainer
        .volume_mounts
        .iter()
        .flatten()
        .any(|vm| vm.mount_path.trim_end_matches('/') == wellknown::SHM_DIR);
    if !mounted {
        let mounts = [trainer_path, &["volumeMounts"]].concat();
        let exists = ops.exists_after(&mounts, trainer.volume_mounts.is_some());
        let mount = json!({"name": name, "mountPath": wellknown::SHM_DIR});
        append(ops, trainer_path, "volumeMounts", exists, mount);
    }
}

/// The volume the sidecar and the trainer share.
fn signal_volume(spec: &PodSpec, ops: &mut Ops) {
    let has_volume = spec
        .volumes
        .iter()
        .flatten()
        .any(|v| v.name == wellknown::SIGNAL_VOLUME);
    if !has_volume {
        let volume = json!({"name": wellknown::SIGNAL_VOLUME, "emptyDir": {}});
        append(ops, &["spec"], "volumes", spec.volumes.is_some(), volume);
    }
}

/// The sidecar, in the list its mode asks for. One already present in the other list is left
/// alone: two containers with one name would make the pod invalid.
fn sidecar(pod: &Pod, spec: &PodSpec, trainer: &Container, plan: &SidecarPlan, ops: &mut Ops) {
    let desired = sidecar_container(
        plan,
        &trainer.name,
        &SidecarIdentity::of_trainer(pod, trainer),
        spec.restart_policy.as_deref(),
    );
    let init: &[Container] = spec.init_containers.as_deref().unwrap_or_default();
    let (list_key, list, list_exists, other) = match plan.mode {
        SidecarMode::Native => (
            "initContainers",
            init,
            ops.exists_after(&["spec", "initContainers"], spec.init_containers.is_some()),
            spec.containers.as_slice(),
        ),
        SidecarMode::Classic => ("containers", spec.containers.as_slice(), true, init),
    };
    let in_other = other.iter().any(|c| c.name == wellknown::SIDECAR_CONTAINER);
    match list
        .iter()
        .position(|c| c.name == wellknown::SIDECAR_CONTAINER)
    {
        Some(i) => {
            let current = serde_json::to_value(&list[i]).unwrap_or(Value::Null);
            if !contains(&current, &desired) {
                ops.replace(&["spec", list_key, &i.to_string()], desired);
            }
        }
        None if in_other => {}
        None => append(ops, &["spec"], list_key, list_exists, desired),
    }
}

/// The init container that writes the Python client (`memguard client install DIR`, so the
/// image needs no shell), with the sidecar's resources and security context rules.
pub fn client_container(image: &str, sidecar: &SidecarPlan, identity: &SidecarIdentity) -> Value {
    let r = &sidecar.resources;
    let mut resources = Map::new();
    let requests: Map<String, Value> = [("cpu", &r.cpu_request), ("memory", &r.memory_request)]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), json!(v.as_ref()?))))
        .collect();
    if !requests.is_empty() {
        resources.insert("requests".into(), Value::Object(requests));
    }
    if let Some(mem) = &r.memory_limit {
        resources.insert("limits".into(), json!({"memory": mem}));
    }
    json!({
        "name": wellknown::CLIENT_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [wellknown::CLI_BINARY, "client", "install", wellknown::CLIENT_DIR],
        "resources": resources,
        "securityContext": identity.security_context(),
        "terminationMessagePolicy": FALLBACK_TO_LOGS_ON_ERROR,
        "volumeMounts": [{"name": wellknown::CLIENT_CONTAINER, "mountPath": wellknown::CLIENT_DIR}],
    })
}

/// The Python client (issue: stock trainers follow the signal): its `emptyDir`, the init
/// container that fills it, the read-only mount in the trainer, and the directory first on the
/// trainer's `PYTHONPATH` (the user's value kept after it). Nothing when the decision left it out.
fn client(
    pod: &Pod,
    spec: &PodSpec,
    trainer: &Container,
    trainer_path: &[&str],
    plan: Option<&ClientPlan>,
    sidecar: &SidecarPlan,
    ops: &mut Ops,
) {
    let Some(plan) = plan else {
        return;
    };
    let name = wellknown::CLIENT_CONTAINER;
    if spec.containers.iter().any(|c| c.name == name) {
        return; // a container of that name already: a second would make the pod invalid
    }
    if !spec.volumes.iter().flatten().any(|v| v.name == name) {
        let exists = ops.exists_after(&["spec", "volumes"], spec.volumes.is_some());
        append(
            ops,
            &["spec"],
            "volumes",
            exists,
            json!({"name": name, "emptyDir": {}}),
        );
    }
    let desired = client_container(
        &plan.image,
        sidecar,
        &SidecarIdentity::of_trainer(pod, trainer),
    );
    let init: &[Container] = spec.init_containers.as_deref().unwrap_or_default();
    match init.iter().position(|c| c.name == name) {
        Some(i) => {
            let current = serde_json::to_value(&init[i]).unwrap_or(Value::Null);
            if !contains(&current, &desired) {
                ops.replace(&["spec", "initContainers", &i.to_string()], desired);
            }
        }
        None => {
            let exists =
                ops.exists_after(&["spec", "initContainers"], spec.init_containers.is_some());
            append(ops, &["spec"], "initContainers", exists, desired);
        }
    }
    let mounted =
        trainer.volume_mounts.iter().flatten().any(|vm| {
            vm.name == name || vm.mount_path.trim_end_matches('/') == wellknown::CLIENT_DIR
        });
    if !mounted {
        let mounts = [trainer_path, &["volumeMounts"]].concat();
        let exists = ops.exists_after(&mounts, trainer.volume_mounts.is_some());
        let mount = json!({"name": name, "mountPath": wellknown::CLIENT_DIR, "readOnly": true});
        append(ops, trainer_path, "volumeMounts", exists, mount);
    }
    let current = trainer
        .env
        .iter()
        .flatten()
        .position(|e| e.name == env::PYTHONPATH);
    let value = |user: Option<&str>| match user.filter(|v| !v.is_empty()) {
        Some(v)
            if v.split(':')
                .any(|p| p.trim_end_matches('/') == wellknown::CLIENT_DIR) =>
        {
            v.to_string()
        }
        Some(v) => format!("{}:{v}", wellknown::CLIENT_DIR),
        None => wellknown::CLIENT_DIR.to_string(),
    };
    match current {
        Some(i) => {
            let e = &trainer.env.as_deref().unwrap_or_default()[i];
            let want = value(e.value.as_deref());
            if e.value.as_deref() != Some(want.as_str()) || e.value_from.is_some() {
                let index = i.to_string();
                let path = [trainer_path, &["env", index.as_str()]].concat();
                ops.replace(&path, json!({"name": env::PYTHONPATH, "value": want}));
            }
        }
        None => {
            let exists =
                ops.exists_after(&[trainer_path, &["env"]].concat(), trainer.env.is_some());
            let var = json!({"name": env::PYTHONPATH, "value": value(None)});
            append(ops, trainer_path, "env", exists, var);
        }
    }
}

/// The placement's node affinity, merged into the pod's.
fn placement(spec: &PodSpec, m: &Mutation, ops: &mut Ops) {
    if let Some(affinity) = &m.affinity
        && spec.affinity.as_ref() != Some(affinity)
    {
        // `add` on an existing member replaces it (RFC 6902 §4.1): the merged affinity keeps
        // everything the user wrote.
        ops.add(&["spec", "affinity"], json!(affinity));
    }
}

/// The sidecar finds the trainer's processes (and cgroup) through a shared PID namespace.
/// hostPID pods already share the host's, and may not set both.
fn shared_pid_namespace(spec: &PodSpec, ops: &mut Ops) {
    if spec.share_process_namespace != Some(true) && spec.host_pid != Some(true) {
        ops.add(&["spec", "shareProcessNamespace"], json!(true));
    }
}

/// The patch of an inference server: its argv rewritten in place (only the values that
/// change), its estimate, and its error when it cannot start in its share (a stale one goes).
fn served(pod: &Pod, s: &ServerAdmission, ops: &mut Ops) {
    server_args(pod, s, ops);
    let estimate = [(keys::ESTIMATE, s.estimate.as_str())];
    match &s.error {
        Some(error) => {
            let error: String = error.chars().take(MAX_ERROR_CHARS).collect();
            annotate(pod, ops, &[estimate[0], (keys::ERROR, error.as_str())], &[]);
        }
        None => annotate(pod, ops, &estimate, &[keys::ERROR]),
    }
}

/// The server's `command`/`args` edits: an element replaced at its index, a missing flag
/// appended (the field created when absent).
fn server_args(pod: &Pod, s: &ServerAdmission, ops: &mut Ops) {
    let Some(container) = pod
        .spec
        .as_ref()
        .and_then(|spec| spec.containers.get(s.container_index))
    else {
        return;
    };
    let index = s.container_index.to_string();
    let mut exists = [container.command.is_some(), container.args.is_some()];
    for edit in &s.edits {
        match edit {
            ArgvEdit::Replace {
                field,
                index: i,
                value,
            } => ops.replace(
                &["spec", "containers", &index, field.name(), &i.to_string()],
                json!(value),
            ),
            ArgvEdit::Append { field, value } => {
                let slot = &mut exists[usize::from(*field == Field::Args)];
                append(
                    ops,
                    &["spec", "containers", &index],
                    field.name(),
                    *slot,
                    json!(value),
                );
                *slot = true;
            }
        }
    }
}

/// `memguard.io/estimate`, and `memguard.io/error` when there is a verdict (a stale one goes).
fn estimate_and_error(pod: &Pod, m: &Mutation, ops: &mut Ops) {
    let estimate = m.estimate.to_json();
    match &m.error {
        Some(error) => {
            let error: String = error.chars().take(MAX_ERROR_CHARS).collect();
            annotate(
                pod,
                ops,
                &[
                    (keys::ESTIMATE, estimate.as_str()),
                    (keys::ERROR, error.as_str()),
                ],
                &[],
            );
        }
        None => annotate(
            pod,
            ops,
            &[(keys::ESTIMATE, estimate.as_str())],
            &[keys::ERROR],
        ),
    }
}

fn annotate(pod: &Pod, ops: &mut Ops, set: &[(&str, &str)], stale: &[&str]) {
    let current = pod.metadata.annotations.as_ref();
    let mut missing = BTreeMap::new();
    for (key, value) in set {
        if current.and_then(|a| a.get(*key)).map(String::as_str) != Some(*value) {
            missing.insert(key.to_string(), value.to_string());
        }
    }
    match current {
        None if !missing.is_empty() => ops.add(&["metadata", "annotations"], json!(missing)),
        _ => {
            for (key, value) in missing {
                ops.add(&["metadata", "annotations", &key], json!(value));
            }
        }
    }
    for key in stale {
        if current.is_some_and(|a| a.contains_key(*key)) {
            ops.remove(&["metadata", "annotations", key]);
        }
    }
}

/// Adds `value` to the array `parent/key`: creates the array when it is absent, else appends.
fn append(ops: &mut Ops, parent: &[&str], key: &str, exists: bool, value: Value) {
    let mut path: Vec<&str> = parent.to_vec();
    path.push(key);
    if exists {
        path.push("-");
        ops.add(&path, value);
    } else {
        ops.add(&path, json!([value]));
    }
}

/// Literal variables on a container: unchanged when equal, replaced in place when different
/// (including a `valueFrom`), appended when absent.
fn set_env(container: &Container, path: &[&str], desired: &[(&str, &str)], ops: &mut Ops) {
    let current: &[EnvVar] = container.env.as_deref().unwrap_or_default();
    let mut seen = std::collections::HashSet::new();
    let mut appended = Vec::new();
    for (name, value) in desired {
        if !seen.insert(*name) {
            continue;
        }
        let var = json!({"name": name, "value": value});
        match current.iter().position(|e| e.name == *name) {
            Some(i) => {
                let e = &current[i];
                if e.value.as_deref() != Some(*value) || e.value_from.is_some() {
                    let mut p = path.to_vec();
                    let index = i.to_string();
                    p.extend(["env", index.as_str()]);
                    ops.replace(&p, var);
                }
            }
            None => appended.push(var),
        }
    }
    if appended.is_empty() {
        return;
    }
    if container.env.is_none() {
        let mut p = path.to_vec();
        p.push("env");
        ops.add(&p, Value::Array(appended));
    } else {
        for var in appended {
            append(ops, path, "env", true, var);
        }
    }
}

/// Whether `have` carries everything `want` says (extra fields in `have`, such as defaults the
/// API server filled in, are ignored; arrays must match element by element).
pub fn contains(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::Object(h), Value::Object(w)) => w
            .iter()
            .all(|(k, wv)| h.get(k).is_some_and(|hv| contains(hv, wv))),
        (Value::Array(h), Value::Array(w)) => {
            h.len() == w.len() && h.iter().zip(w).all(|(a, b)| contains(a, b))
        }
        _ => have == want,
    }
}

#[cfg(test)]
mod tests;
