use super::*;
use crate::mutate::{ClusterView, mutate};
use crate::testutil::{PodBuilder, bare_pod, trainer_pod};
use memguard_api::{Policy, PolicySpec};

fn policy(mode: &str) -> Policy {
    let spec: PolicySpec =
        serde_json::from_value(json!({"sidecar": {"mode": mode}})).expect("valid policy");
    spec.resolved().expect("valid values")
}

/// Mutates, applies the patch, and checks the result is still a Pod. Returns (patch, result).
fn apply(pod: &Value, policy: &Policy) -> (Patch, Value) {
    let typed: Pod = serde_json::from_value(pod.clone()).expect("input is a pod");
    let outcome = mutate(&typed, policy, &ClusterView::default());
    let patch = build(&typed, &outcome);
    let mut out = pod.clone();
    json_patch::patch(&mut out, &patch).expect("the patch applies");
    let _: Pod = serde_json::from_value(out.clone()).expect("the result is still a Pod");
    (patch, out)
}

fn gpu_pod() -> PodBuilder {
    trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, "40Gi")
}

fn sidecar(out: &Value, list: &str) -> Value {
    out["spec"][list]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["name"] == wellknown::SIDECAR_CONTAINER))
        .cloned()
        .unwrap_or(Value::Null)
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .map(|e| &e["value"])
}

#[test]
fn injects_a_native_sidecar_that_keeps_restart_policy_always() {
    let (_, out) = apply(&gpu_pod().json(), &Policy::default());
    let s = sidecar(&out, "initContainers");
    assert_eq!(s["restartPolicy"], "Always");
    assert_eq!(s["terminationMessagePolicy"], "File");
    assert_eq!(out["spec"]["shareProcessNamespace"], true);
    let sc = &s["securityContext"];
    assert_eq!(
        (&sc["runAsUser"], &sc["runAsNonRoot"]),
        (&json!(0), &json!(false)),
        "the trainer says no user: its image's, root in most GPU images"
    );
    assert_eq!(
        sc["capabilities"],
        Value::Null,
        "the runtime's defaults, as the trainer's"
    );
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    let limit = s["env"]
        .as_array()
        .and_then(|e| e.iter().find(|v| v["name"] == env::TRAINER_MEMORY_LIMIT))
        .expect("downward API limit");
    assert_eq!(
        limit["valueFrom"]["resourceFieldRef"]["containerName"],
        "train"
    );
    assert_eq!(
        limit["valueFrom"]["resourceFieldRef"]["resource"],
        "limits.memory"
    );
    // The trainer and the sidecar share the signal volume.
    let mounts = |c: &Value| c["volumeMounts"][0]["mountPath"].clone();
    assert_eq!(mounts(&out["spec"]["containers"][0]), wellknown::SIGNAL_DIR);
    assert_eq!(mounts(&s), wellknown::SIGNAL_DIR);
    assert_eq!(out["spec"]["volumes"][0]["name"], wellknown::SIGNAL_VOLUME);
    let typed: Container = serde_json::from_value(s).expect("the sidecar is a valid Container");
    assert_eq!(typed.restart_policy.as_deref(), Some("Always"));
}

#[test]
fn classic_mode_adds_a_regular_container_without_restart_policy() {
    let (_, out) = apply(&gpu_pod().json(), &policy("classic"));
    assert!(out["spec"].get("initContainers").is_none());
    let s = sidecar(&out, "containers");
    assert_eq!(s["name"], wellknown::SIDECAR_CONTAINER);
    assert!(s.get("restartPolicy").is_none());
    assert_eq!(
        out["spec"]["containers"][0]["name"], "train",
        "the trainer stays first"
    );
}

#[test]
fn the_sidecar_is_told_the_pods_restart_policy() {
    for (given, told) in [
        (Some("Never"), "Never"),
        (Some("OnFailure"), "OnFailure"),
        (Some("Always"), "Always"),
        (None, "Always"),
        (Some("Sometimes"), "Always"),
    ] {
        let mut pod = gpu_pod().json();
        match given {
            Some(p) => pod["spec"]["restartPolicy"] = json!(p),
            None => {
                pod["spec"]
                    .as_object_mut()
                    .map(|s| s.remove("restartPolicy"));
            }
        }
        let (_, out) = apply(&pod, &policy("classic"));
        let s = sidecar(&out, "containers");
        assert_eq!(
            env_value(&s, env::SIDECAR_POD_RESTART_POLICY),
            Some(&json!(told)),
            "{given:?}"
        );
    }
}

#[test]
fn a_second_call_on_the_mutated_pod_changes_nothing() {
    let pods = [
        ("gpu", gpu_pod().json(), Policy::default()),
        ("classic", gpu_pod().json(), policy("classic")),
        (
            "downgraded with env-map and valueFrom",
            gpu_pod()
                .annotate(keys::BATCH_SIZE, "8")
                .annotate(keys::SEQ_LENGTH, "8192")
                .annotate(keys::ENV_MAP, "batch-size=BS")
                .env_from_configmap("BS")
                .json(),
            Policy::default(),
        ),
        ("skipped", bare_pod().json(), Policy::default()),
    ];
    for (name, pod, policy) in pods {
        let (first, once) = apply(&pod, &policy);
        assert!(!first.0.is_empty(), "{name}: first call patches");
        let (second, twice) = apply(&once, &policy);
        assert!(second.0.is_empty(), "{name}: second patch {second:?}");
        assert_eq!(once, twice);
    }
}

#[test]
fn idempotent_even_after_the_api_server_fills_in_defaults() {
    let (_, mut once) = apply(&gpu_pod().json(), &Policy::default());
    let s = once["spec"]["initContainers"]
        .as_array_mut()
        .and_then(|l| l.last_mut())
        .expect("sidecar");
    s["readinessProbe"]["timeoutSeconds"] = json!(1);
    s["readinessProbe"]["successThreshold"] = json!(1);
    s["readinessProbe"]["failureThreshold"] = json!(3);
    s["readinessProbe"]["httpGet"]["scheme"] = json!("HTTP");
    s["securityContext"]["privileged"] = json!(false);
    let (second, _) = apply(&once, &Policy::default());
    assert!(second.0.is_empty(), "{second:?}");
}

#[test]
fn an_outdated_sidecar_is_replaced_in_place() {
    let (_, mut once) = apply(&gpu_pod().json(), &Policy::default());
    once["spec"]["initContainers"][0]["image"] = json!("old:0.0.1");
    let (patch, twice) = apply(&once, &Policy::default());
    assert_eq!(patch.0.len(), 1, "{patch:?}");
    assert_eq!(patch.0[0].path().to_string(), "/spec/initContainers/0");
    assert_eq!(
        twice["spec"]["initContainers"][0]["image"],
        json!(Policy::default().sidecar_image)
    );
}

#[test]
fn never_clobbers_existing_arrays() {
    let pod = gpu_pod()
        .spec(
            "initContainers",
            json!([{"name": "fetch", "image": "busybox"}]),
        )
        .spec("volumes", json!([{"name": "data", "emptyDir": {}}]))
        .env("KEEP", "me")
        .json();
    let (patch, out) = apply(&pod, &Policy::default());
    let paths: Vec<String> = patch.0.iter().map(|op| op.path().to_string()).collect();
    assert!(
        paths.contains(&"/spec/initContainers/-".to_string()),
        "{paths:?}"
    );
    assert!(paths.contains(&"/spec/volumes/-".to_string()), "{paths:?}");
    assert!(
        paths.contains(&"/spec/containers/0/env/-".to_string()),
        "{paths:?}"
    );
    assert_eq!(out["spec"]["initContainers"][0]["name"], "fetch");
    assert_eq!(
        out["spec"]["initContainers"][1]["name"],
        wellknown::SIDECAR_CONTAINER
    );
    assert_eq!(out["spec"]["volumes"][0]["name"], "data");
    assert_eq!(
        env_value(&out["spec"]["containers"][0], "KEEP"),
        Some(&json!("me"))
    );
}

#[test]
fn creates_missing_arrays_with_add() {
    let (patch, _) = apply(&gpu_pod().json(), &Policy::default());
    let adds: Vec<(String, bool)> = patch
        .0
        .iter()
        .filter_map(|op| match op {
            PatchOperation::Add(a) => Some((a.path.to_string(), a.value.is_array())),
            _ => None,
        })
        .collect();
    for path in [
        "/spec/initContainers",
        "/spec/volumes",
        "/spec/containers/0/env",
        "/spec/containers/0/volumeMounts",
    ] {
        assert!(
            adds.contains(&(path.to_string(), true)),
            "{path} in {adds:?}"
        );
    }
}

#[test]
fn rewrites_existing_variables_in_place() {
    let pod = gpu_pod()
        .annotate(keys::ENV_MAP, "batch-size=BS,grad-accumulation=GA")
        .annotate(keys::GRAD_ACCUMULATION, "1")
        .env("BS", "999")
        .env_from_configmap("GA")
        .env(env::BATCH_SIZE, "999")
        .json();
    let (patch, out) = apply(&pod, &Policy::default());
    let replaced: Vec<String> = patch
        .0
        .iter()
        .filter(|op| matches!(op, PatchOperation::Replace(_)))
        .map(|op| op.path().to_string())
        .collect();
    assert_eq!(
        replaced,
        [
            "/spec/containers/0/env/2",
            "/spec/containers/0/env/0",
            "/spec/containers/0/env/1"
        ]
    );
    let trainer = &out["spec"]["containers"][0];
    assert_eq!(trainer["env"][0]["name"], "BS", "order kept");
    assert_ne!(trainer["env"][0]["value"], "999");
    assert!(
        trainer["env"][1].get("valueFrom").is_none(),
        "valueFrom replaced by a value"
    );
    assert_eq!(
        env_value(trainer, env::BATCH_SIZE),
        Some(&trainer["env"][0]["value"])
    );
}

#[test]
fn escapes_annotation_keys_in_json_pointers() {
    let (patch, out) = apply(&gpu_pod().json(), &Policy::default());
    let path = patch
        .0
        .iter()
        .map(|op| op.path().to_string())
        .find(|p| p.starts_with("/metadata/annotations"))
        .expect("annotation op");
    assert_eq!(path, "/metadata/annotations/memguard.io~1estimate");
    let summary: Value = serde_json::from_str(
        out["metadata"]["annotations"][keys::ESTIMATE]
            .as_str()
            .expect("string"),
    )
    .expect("compact JSON");
    assert_eq!(summary["v"], 1);
}

#[test]
fn a_skipped_pod_only_gets_the_error_annotation() {
    let pod = trainer_pod().annotate(keys::BATCH_SIZE, "lots").json();
    let (patch, out) = apply(&pod, &Policy::default());
    assert_eq!(patch.0.len(), 1, "{patch:?}");
    let error = out["metadata"]["annotations"][keys::ERROR]
        .as_str()
        .expect("error");
    assert!(error.contains("batch-size"), "{error}");
    let mut expected = pod.clone();
    expected["metadata"]["annotations"][keys::ERROR] = json!(error);
    assert_eq!(out, expected);
}

#[test]
fn a_fixed_pod_loses_its_stale_error() {
    let pod = gpu_pod()
        .annotate(keys::ERROR, "batch-size: old problem")
        .json();
    let (_, out) = apply(&pod, &Policy::default());
    assert!(out["metadata"]["annotations"].get(keys::ERROR).is_none());
}

#[test]
fn respects_what_the_pod_already_has() {
    // A user mount at the signal dir, the sidecar already among regular containers, hostPID.
    let pod = gpu_pod()
        .spec("hostPID", json!(true))
        .spec("volumes", json!([{"name": "mine", "emptyDir": {}}]))
        .json();
    let mut pod = pod;
    pod["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "mine", "mountPath": "/var/run/memguard/"}]);
    pod["spec"]["containers"]
        .as_array_mut()
        .expect("array")
        .push(json!({"name": wellknown::SIDECAR_CONTAINER, "image": "custom"}));
    let (_, out) = apply(&pod, &Policy::default());
    assert!(
        out["spec"].get("shareProcessNamespace").is_none(),
        "hostPID excludes it"
    );
    assert!(
        out["spec"].get("initContainers").is_none(),
        "no second sidecar"
    );
    let mounts = out["spec"]["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts");
    assert_eq!(mounts.len(), 1, "no duplicate mount path");
}

#[test]
fn the_trainer_falls_back_to_its_logs_on_error_unless_the_user_chose() {
    let (_, out) = apply(&gpu_pod().json(), &Policy::default());
    let trainer = &out["spec"]["containers"][0];
    assert_eq!(trainer["terminationMessagePolicy"], "FallbackToLogsOnError");
    let (_, again) = apply(&out, &Policy::default());
    assert_eq!(again, out, "idempotent");
    let mut own = gpu_pod().json();
    own["spec"]["containers"][0]["terminationMessagePolicy"] = json!("File");
    let (_, out) = apply(&own, &Policy::default());
    assert_eq!(
        out["spec"]["containers"][0]["terminationMessagePolicy"],
        "File"
    );
}

#[test]
fn unchanged_outcome_is_an_empty_patch() {
    let pod: Pod = serde_json::from_value(trainer_pod().unlabelled().json()).expect("pod");
    assert!(build(&pod, &Outcome::Unchanged).0.is_empty());
}

#[test]
fn contains_ignores_extra_fields_but_not_different_ones() {
    let have = json!({"a": 1, "b": [{"x": 1, "y": 2}], "extra": true});
    assert!(contains(&have, &json!({"a": 1, "b": [{"x": 1}]})));
    assert!(!contains(&have, &json!({"a": 2})));
    assert!(!contains(&have, &json!({"b": [{"x": 1}, {"x": 2}]})));
    assert!(!contains(&have, &json!({"missing": 1})));
}

/// Hostile annotation values, on every input key, alone and three at a time: no panic, a
/// decision every time, and a mutated pod is a valid Pod that a second pass leaves alone.
#[test]
fn hostile_annotations_never_panic_and_always_yield_a_valid_idempotent_patch() {
    use memguard_api::annotations::INPUT_KEYS;
    const HOSTILE: &[&str] = &[
        "",
        " ",
        "0",
        "-1",
        "1",
        "2",
        "3",
        "7",
        "1e308",
        "1e-308",
        "NaN",
        "inf",
        "-0",
        "18446744073709551615",
        "18446744073709551616",
        "4294967297",
        "0.5",
        "1.5",
        "1,000",
        "１２",
        "true",
        "false",
        "yes",
        "lora",
        "qlora",
        "full",
        "zero3",
        "fsdp",
        "cpu",
        "mps",
        "80GiB",
        "1Ki",
        "999999999999Ei",
        "0.0000001",
        "llama-3-8b",
        "mixtral-8x7b",
        "batch-size=A,seq-length=B",
        "batch-size=MEMGUARD_X",
        "=",
        "q,v,,",
        "train",
        "nope",
        "\u{0}",
        "a\nb",
        "😀",
    ];
    let policy = policy("native");
    let (mut checked, mut mutated, mut skipped) = (0usize, 0usize, 0usize);
    let mut check = |pod: PodBuilder, what: &str| {
        let json = pod.json();
        let built: Pod = serde_json::from_value(json.clone()).expect("builder makes valid pods");
        let outcome = mutate(&built, &policy, &ClusterView::default());
        mutated += usize::from(matches!(outcome, Outcome::Mutated(_)));
        skipped += usize::from(matches!(outcome, Outcome::Skipped { .. }));
        let patch = build(&built, &outcome);
        let mut out = json.clone();
        json_patch::patch(&mut out, &patch).unwrap_or_else(|e| panic!("{what}: {e}"));
        let again: Pod = serde_json::from_value(out.clone())
            .unwrap_or_else(|e| panic!("{what}: the patched pod is not a Pod: {e}"));
        let second = build(&again, &mutate(&again, &policy, &ClusterView::default()));
        assert!(second.0.is_empty(), "{what}: not idempotent: {second:?}");
        checked += 1;
    };
    for key in INPUT_KEYS {
        for value in HOSTILE {
            check(gpu_pod().annotate(key, value), &format!("{key}={value:?}"));
            check(
                bare_pod().annotate(key, value),
                &format!("bare {key}={value:?}"),
            );
        }
    }
    // Three keys at a time, chosen by a fixed LCG so a failure reproduces.
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        usize::try_from(state >> 33).unwrap_or(0) % n
    };
    for _ in 0..1500 {
        let mut pod = gpu_pod();
        let mut what = String::new();
        for _ in 0..3 {
            let (key, value) = (
                INPUT_KEYS[next(INPUT_KEYS.len())],
                HOSTILE[next(HOSTILE.len())],
            );
            pod = pod.annotate(key, value);
            what.push_str(&format!("{key}={value:?} "));
        }
        check(pod, &what);
    }
    // Both paths are exercised, not just the early refusals.
    assert!(
        checked > 2000 && mutated > 50 && skipped > 1000,
        "{checked} checked, {mutated} mutated, {skipped} skipped"
    );
}

/// The sidecar's securityContext for a trainer with `pod_sc` / `trainer_sc`.
fn sidecar_sc(pod_sc: Value, trainer_sc: Value) -> Value {
    let mut pod = gpu_pod().json();
    if !pod_sc.is_null() {
        pod["spec"]["securityContext"] = pod_sc;
    }
    if !trainer_sc.is_null() {
        pod["spec"]["containers"][0]["securityContext"] = trainer_sc;
    }
    let (_, out) = apply(&pod, &Policy::default());
    sidecar(&out, "initContainers")["securityContext"].clone()
}

#[test]
fn the_sidecar_takes_a_non_root_trainers_uid_and_gid_and_no_capabilities() {
    let sc = sidecar_sc(json!({"runAsUser": 1000, "runAsGroup": 2000}), Value::Null);
    assert_eq!(sc["runAsUser"], 1000);
    assert_eq!(sc["runAsGroup"], 2000);
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    let sc = sidecar_sc(
        json!({"runAsUser": 1000, "runAsGroup": 2000}),
        json!({"runAsUser": 1234}),
    );
    assert_eq!(
        (&sc["runAsUser"], &sc["runAsGroup"]),
        (&json!(1234), &json!(2000)),
        "the container's field over the pod's"
    );
    let sc = sidecar_sc(Value::Null, json!({"runAsUser": 1234}));
    assert_eq!(
        sc["runAsGroup"], 0,
        "gid unknown: 0, as the runtime gives a uid its image does not list; left out, the \
         sidecar took its own image's group (65532) and lost the trainer's cgroup (issue #26)"
    );
}

#[test]
fn a_root_trainer_gives_a_root_sidecar_exactly_its_capabilities() {
    let caps = json!({"add": ["IPC_LOCK"], "drop": ["NET_RAW"]});
    let sc = sidecar_sc(Value::Null, json!({"runAsUser": 0, "capabilities": caps}));
    assert_eq!(
        (&sc["runAsUser"], &sc["runAsGroup"], &sc["runAsNonRoot"]),
        (&json!(0), &json!(0), &json!(false))
    );
    assert_eq!(sc["capabilities"], caps, "never more than the trainer has");
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
}

#[test]
fn an_unknown_non_root_uid_or_a_privileged_trainer_keeps_the_nonroot_sidecar() {
    let default = json!({
        "runAsNonRoot": true, "runAsUser": SIDECAR_UID, "runAsGroup": SIDECAR_UID,
        "readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
    });
    assert_eq!(
        sidecar_sc(json!({"runAsNonRoot": true}), Value::Null),
        default
    );
    assert_eq!(
        sidecar_sc(Value::Null, json!({"runAsUser": 0, "privileged": true})),
        default
    );
}

/// A GPU pod whose trainer starts Python inside `bash -c`, optionally with its own PYTHONPATH.
fn python_pod(pythonpath: Option<&str>) -> Value {
    let mut b = gpu_pod();
    if let Some(p) = pythonpath {
        b = b.env(env::PYTHONPATH, p);
    }
    let mut pod = b.json();
    pod["spec"]["containers"][0]["command"] = json!(["bash", "-c", "pip list && torchrun t.py"]);
    pod
}

fn named<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    list.as_array()?.iter().find(|c| c["name"] == name)
}

#[test]
fn a_python_trainer_gets_the_client_copied_mounted_and_first_on_its_path() {
    let (_, out) = apply(&python_pod(None), &Policy::default());
    let init = named(&out["spec"]["initContainers"], wellknown::CLIENT_CONTAINER)
        .expect("the client's init container");
    assert_eq!(
        init["command"],
        json!(["memguard", "client", "install", wellknown::CLIENT_DIR])
    );
    assert_eq!(
        init["image"],
        Policy::default().sidecar_image,
        "the sidecar's image"
    );
    assert!(
        init.get("restartPolicy").is_none(),
        "a plain init container: it runs to completion"
    );
    let sidecar = sidecar(&out, "initContainers");
    assert_eq!(init["securityContext"], sidecar["securityContext"]);
    assert_eq!(init["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(init["resources"], sidecar["resources"]);
    assert!(named(&out["spec"]["volumes"], wellknown::CLIENT_CONTAINER).is_some());
    let trainer = &out["spec"]["containers"][0];
    let mount = named(&trainer["volumeMounts"], wellknown::CLIENT_CONTAINER).expect("mounted");
    assert_eq!(
        (&mount["mountPath"], &mount["readOnly"]),
        (&json!(wellknown::CLIENT_DIR), &json!(true))
    );
    assert_eq!(
        env_value(trainer, env::PYTHONPATH),
        Some(&json!(wellknown::CLIENT_DIR))
    );
    let typed: Container = serde_json::from_value(init.clone()).expect("a valid Container");
    assert_eq!(typed.name, wellknown::CLIENT_CONTAINER);
    // Before the native sidecar: it has exited when the sidecar starts looking for the trainer.
    let names: Vec<&Value> = out["spec"]["initContainers"]
        .as_array()
        .expect("init containers")
        .iter()
        .map(|c| &c["name"])
        .collect();
    assert_eq!(
        names,
        [wellknown::CLIENT_CONTAINER, wellknown::SIDECAR_CONTAINER]
    );
}

#[test]
fn the_users_pythonpath_is_kept_after_the_client_and_a_second_call_changes_nothing() {
    for policy in [Policy::default(), policy("classic")] {
        let (_, once) = apply(&python_pod(Some("/app:/lib")), &policy);
        let trainer = &once["spec"]["containers"][0];
        let want = format!("{}:/app:/lib", wellknown::CLIENT_DIR);
        assert_eq!(env_value(trainer, env::PYTHONPATH), Some(&json!(want)));
        let (second, twice) = apply(&once, &policy);
        assert!(second.0.is_empty(), "{second:?}");
        assert_eq!(once, twice);
    }
}

#[test]
fn the_policy_the_pod_or_a_non_python_command_keep_the_client_out() {
    let off: PolicySpec =
        serde_json::from_value(json!({"client": {"inject": false}})).expect("valid");
    let other: PolicySpec =
        serde_json::from_value(json!({"client": {"image": "reg/mg:1"}})).expect("valid");
    let mut opted_out = python_pod(None);
    opted_out["metadata"]["annotations"][keys::INJECT_CLIENT] = json!("false");
    let mut shell = python_pod(None);
    shell["spec"]["containers"][0]["command"] = json!(["sh", "-c", "./train"]);
    let mut from_ref = python_pod(None);
    from_ref["spec"]["containers"][0]["env"] = json!([{"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]);
    let cases = [
        (
            "policy off",
            python_pod(None),
            off.resolved().expect("valid"),
            false,
        ),
        ("pod opted out", opted_out, Policy::default(), false),
        ("not python", shell, Policy::default(), false),
        ("no command", gpu_pod().json(), Policy::default(), false),
        ("valueFrom PYTHONPATH", from_ref, Policy::default(), false),
        (
            "own image",
            python_pod(None),
            other.resolved().expect("valid"),
            true,
        ),
    ];
    for (name, pod, policy, injected) in cases {
        let (_, out) = apply(&pod, &policy);
        let init = named(&out["spec"]["initContainers"], wellknown::CLIENT_CONTAINER);
        assert_eq!(init.is_some(), injected, "{name}");
        assert!(
            out["spec"]["containers"][0]["volumeMounts"]
                .as_array()
                .is_some_and(|m| m.iter().all(|m| m["name"] != wellknown::CLIENT_CONTAINER))
                != injected,
            "{name}"
        );
        if let Some(init) = init {
            assert_eq!(init["image"], "reg/mg:1", "{name}");
        }
    }
}

/// The trainer's own values, read and rewritten (issue 27): a second admission reads the
/// values recorded as read, not memguard's rewrite, so it reaches the same plan and the patch
/// is empty; the rewrite keeps `batch × accumulation` (8 × 4).
#[test]
fn read_and_rewritten_variables_are_idempotent() {
    // No batch annotation: the trainer's BS is the batch.
    let pod = bare_pod()
        .annotate(keys::MODEL, "llama-3-8b")
        .annotate(keys::METHOD, "lora")
        .gpus(1)
        .annotate(keys::GPU_MEMORY, "24Gi")
        .annotate(keys::SEQ_LENGTH, "8192")
        .annotate(keys::ENV_MAP, "batch-size=BS,grad-accumulation=GA")
        .env("BS", "8")
        .env("GA", "4")
        .json();
    let (patch, out) = apply(&pod, &Policy::default());
    assert!(!patch.0.is_empty());
    let trainer = &out["spec"]["containers"][0];
    let value = |name| -> u64 {
        env_value(trainer, name)
            .and_then(Value::as_str)
            .and_then(|v| v.parse().ok())
            .expect("a literal")
    };
    assert!(value("BS") < 8, "downgraded");
    assert_eq!(value("BS") * value("GA"), 32, "{trainer}");
    let (second, _) = apply(&out, &Policy::default());
    assert!(second.0.is_empty(), "not idempotent: {second:?}");
}

/// Issue 27, defect 2: a stock launch whose args hard-code `--max_seq_length 4096` is planned
/// at 4096 (read from the args, not the default), the knobs the plan changes are rewritten in
/// the trainer's own flags inside the `bash -c` string (the rest byte for byte), the warning
/// leads with them, and a second admission changes nothing.
#[test]
fn a_stock_launch_is_planned_on_its_flags_and_rewritten_in_them() {
    let script = "pip install -q trl && accelerate launch --num_processes 1 sft.py \
                  --model_name_or_path meta-llama/Llama-3.1-8B --max_seq_length 4096 \
                  --per_device_train_batch_size 8 --gradient_accumulation_steps 1 \
                  --output_dir /out";
    let pod = || {
        bare_pod()
            .annotate(keys::MODEL, "llama-3-8b")
            .annotate(keys::METHOD, "lora")
            .gpus(1)
            .command_line(&["bash", "-c"], &[script])
    };
    let typed: Pod =
        serde_json::from_value(pod().annotate(keys::GPU_MEMORY, "24Gi").json()).expect("a pod");
    let Outcome::Mutated(m) = mutate(&typed, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    assert_eq!(
        m.estimate.read["seq-length"], "4096",
        "planned from the args"
    );
    assert_eq!(m.estimate.sources["seq-length"], "args");
    assert_eq!(m.estimate.sources["batch-size"], "args");
    assert_eq!(m.estimate.read["batch-size"], "8");
    let cfg = &m.plan.config;
    assert!(cfg.batch_size < 8, "downgraded: {:?}", m.plan.steps);
    assert_eq!(
        cfg.batch_size * cfg.grad_accumulation,
        8,
        "effective batch kept"
    );
    let (_, out) = apply(
        &pod().annotate(keys::GPU_MEMORY, "24Gi").json(),
        &Policy::default(),
    );
    let args = out["spec"]["containers"][0]["args"][0]
        .as_str()
        .expect("the script");
    // The launch line before the flags is kept byte for byte; the flags re-read as planned.
    assert!(args.starts_with("pip install -q trl && accelerate launch --num_processes 1 sft.py"));
    let items = vec!["bash".to_string(), "-c".into(), args.to_string()];
    let launch = memguard_api::launch::find(&items).expect("still a launch");
    let flags = memguard_api::launch::Flags::parse(&launch.texts(), &memguard_api::launch::HfRules);
    let read = |k| flags.value(k).map(str::to_string);
    assert_eq!(
        read("per_device_train_batch_size"),
        Some(cfg.batch_size.to_string())
    );
    assert_eq!(
        read("gradient_accumulation_steps"),
        Some(cfg.grad_accumulation.to_string())
    );
    assert_eq!(read("max_length"), Some(cfg.seq_length.to_string()));
    assert_eq!(
        flags.bool("gradient_checkpointing", &memguard_api::launch::HfRules),
        Some(cfg.grad_checkpointing).filter(|on| *on)
    );
    assert!(
        m.warnings[0].starts_with(&format!(
            "memguard: --per_device_train_batch_size 8→{}, --gradient_accumulation_steps 1→{}",
            cfg.batch_size, cfg.grad_accumulation
        )),
        "{:?}",
        m.warnings
    );
    let (second, _) = apply(&out, &Policy::default());
    assert!(second.0.is_empty(), "not idempotent: {second:?}");
    // A pod that fits as written keeps its args byte for byte.
    let (_, roomy) = apply(
        &pod().annotate(keys::GPU_MEMORY, "100Ti").json(),
        &Policy::default(),
    );
    assert_eq!(
        roomy["spec"]["containers"][0]["args"],
        json!([script]),
        "{}",
        roomy["metadata"]["annotations"]
    );
}

/// Issue 27, defect 3: a pod with only the opt-in label whose trainer is a stock TRL launch
/// (GKE's fine-tuning sample's model).
fn label_only_launch(launch: &str) -> PodBuilder {
    bare_pod()
        .gpus(1)
        .node_selector("NVIDIA-A10G")
        .command_line(&["bash", "-c"], &[launch])
}

const STOCK_SFT: &str = "pip install -q trl && accelerate launch --num_processes 1 sft.py \
                         --model_name_or_path google/gemma-2b --use_peft --lora_r 16 \
                         --per_device_train_batch_size 8 --gradient_accumulation_steps 2 \
                         --max_seq_length 2048 --bf16 --output_dir /out";

/// The model and the method come from the launch: the pod is planned, its flags rewritten to a
/// config that fits with the effective batch kept, the estimate says where each value came
/// from, and a second admission changes nothing.
#[test]
fn a_label_only_stock_launch_is_planned_on_its_model_and_rewritten() {
    let pod = label_only_launch(STOCK_SFT).json();
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a pod");
    let Outcome::Mutated(m) = mutate(&typed, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    assert!(m.error.is_none(), "{:?}", m.error);
    assert_eq!(
        m.plan.config.model.name.as_deref(),
        Some("gemma-2b"),
        "the model of --model_name_or_path"
    );
    assert_eq!(m.plan.config.method, memguard_estimator::Method::Lora);
    for (what, source) in [
        ("model", "args"),
        ("method", "args"),
        ("batch-size", "args"),
        ("grad-accumulation", "args"),
        ("seq-length", "args"),
    ] {
        assert_eq!(
            m.estimate.sources.get(what).map(String::as_str),
            Some(source),
            "{what}: {:?}",
            m.estimate.sources
        );
    }
    let cfg = &m.plan.config;
    assert!(
        cfg.batch_size < 8,
        "downgraded on an A10G: {:?}",
        m.plan.steps
    );
    let (_, out) = apply(&pod, &Policy::default());
    let script = out["spec"]["containers"][0]["args"][0]
        .as_str()
        .expect("the script");
    let items = vec!["bash".to_string(), "-c".into(), script.to_string()];
    let launch = memguard_api::launch::find(&items).expect("still a launch");
    let flags = memguard_api::launch::Flags::parse(&launch.texts(), &memguard_api::launch::HfRules);
    let read = |k| {
        flags
            .value(k)
            .and_then(|v| v.parse::<u64>().ok())
            .expect("a count")
    };
    let (batch, accumulation) = (
        read("per_device_train_batch_size"),
        read("gradient_accumulation_steps"),
    );
    assert_eq!(batch * accumulation, 16, "effective batch kept: {script}");
    // The args re-read as the plan, and the plan fits the A10G's budget.
    assert_eq!(
        (batch, accumulation, read("max_length")),
        (cfg.batch_size, cfg.grad_accumulation, cfg.seq_length)
    );
    let budget = m.budget.as_ref().expect("an A10G budget");
    assert!(
        m.plan.total() <= budget.bytes,
        "fits: {:?} > {:?}",
        m.plan.total(),
        budget.bytes
    );
    let (second, _) = apply(&out, &Policy::default());
    assert!(second.0.is_empty(), "not idempotent: {second:?}");
}

/// A launch that leaves out the batch runs at the parser's default (8 per device), not
/// memguard's (1): TRL's `trl sft` with no batch flag is planned at 8, checkpointing on and
/// sequence 1024 (TRL's defaults), and the downgrade is appended in its flags. A bespoke script (no flag only
/// `TrainingArguments` defines) gets no such default.
#[test]
fn a_launch_without_batch_flags_is_planned_at_the_parsers_defaults() {
    let launch = "trl sft --model_name_or_path google/gemma-2b --dataset_name trl-lib/Capybara";
    let typed: Pod = serde_json::from_value(label_only_launch(launch).json()).expect("a pod");
    let Outcome::Mutated(m) = mutate(&typed, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    assert_eq!(m.estimate.sources["batch-size"], "default:trl");
    assert_eq!(m.estimate.sources["model"], "args");
    assert!(
        m.changed
            .iter()
            .any(|c| c.starts_with("--per_device_train_batch_size 8→")),
        "{:?}",
        m.changed
    );
    assert!(
        !m.changed
            .iter()
            .any(|c| c.contains("gradient_checkpointing"))
    );
    // TRL's SFTConfig cuts at max_length 1024 by default: planned there, not at 2048.
    assert_eq!(m.plan.config.seq_length, 1024);
    assert_eq!(m.estimate.sources["seq-length"], "default:trl");
    let bespoke = "python train.py --model_name_or_path google/gemma-2b --lr 1e-4";
    let typed: Pod = serde_json::from_value(label_only_launch(bespoke).json()).expect("a pod");
    let Outcome::Mutated(m) = mutate(&typed, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    assert!(m.changed.is_empty(), "{:?}", m.changed);
    assert_eq!(m.plan.config.batch_size, 1, "memguard's own default");
}

/// A model given as a Hugging Face cache path is read as its repository id.
#[test]
fn a_cache_path_names_its_model() {
    let launch = "python train.py --model_name_or_path \
                  /cache/hub/models--google--gemma-2b/snapshots/abc123 \
                  --per_device_train_batch_size 2";
    let typed: Pod = serde_json::from_value(label_only_launch(launch).json()).expect("a pod");
    let Outcome::Mutated(m) = mutate(&typed, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    assert_eq!(m.plan.config.model.name.as_deref(), Some("gemma-2b"));
    assert_eq!(m.plan.config.method, memguard_estimator::Method::Full);
    assert_eq!(m.estimate.sources["model"], "args");
}

/// A model nobody knows is said clearly (the model, where memguard looked, the nearest known);
/// the Python trainer is guarded at run time (issue 37: the sidecar and the client), and its
/// command line is left as it was.
#[test]
fn an_unknown_model_in_the_launch_is_said_and_the_trainer_guarded() {
    let launch = STOCK_SFT.replace("google/gemma-2b", "acme/secret-13b");
    let pod = label_only_launch(&launch).json();
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a pod");
    match mutate(&typed, &Policy::default(), &ClusterView::default()) {
        Outcome::Guarded(g) => {
            let error = &g.reason;
            assert!(error.contains("acme/secret-13b"), "{error}");
            assert!(error.contains("--model_name_or_path"), "{error}");
            assert!(error.contains("unknown model"), "{error}");
            assert!(error.contains("nearest known"), "{error}");
            assert!(error.contains("guarded at run time"), "{error}");
            // The sidecar plans at train start on the config the trainer reports: against the
            // policy's ratio and floors, with no per-device budget (admission computed none).
            let train_start = g
                .sidecar
                .env
                .iter()
                .find(|(k, _)| k == memguard_api::env::SIDECAR_TRAIN_START)
                .map(|(_, v)| v.as_str());
            let parsed = memguard_api::train_start::TrainStartPolicy::parse(
                train_start.expect("train-start settings"),
            )
            .expect("parses");
            assert_eq!(parsed.budget_bytes, None);
            assert_eq!(parsed.safety_ratio, Some(Policy::default().safety_ratio));
            assert_eq!(parsed.floors, Some(Policy::default().floors));
        }
        other => panic!("{other:?}"),
    }
    let (_, out) = apply(&pod, &Policy::default());
    let trainer = &out["spec"]["containers"][0];
    assert_eq!(trainer["args"], pod["spec"]["containers"][0]["args"]);
    assert_eq!(trainer["command"], pod["spec"]["containers"][0]["command"]);
    let init = out["spec"]["initContainers"]
        .as_array()
        .expect("init containers");
    let names: Vec<&str> = init.iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(names, ["memguard-client", "memguard-sidecar"]);
    let env: Vec<&str> = trainer["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(env.contains(&"MEMGUARD_SIDECAR_URL") && env.contains(&"PYTHONPATH"));
    assert!(
        !env.contains(&"MEMGUARD_BATCH_SIZE"),
        "nothing planned: {env:?}"
    );
    let annotations = &out["metadata"]["annotations"];
    assert!(annotations.get("memguard.io/estimate").is_none());
    assert!(
        annotations["memguard.io/error"]
            .as_str()
            .is_some_and(|e| e.starts_with("not planned at admission"))
    );
    let (second, _) = apply(&out, &Policy::default());
    assert!(second.0.is_empty(), "not idempotent: {second:?}");
    // A trainer that does not run Python gets nothing: a skip, as before.
    let shell = label_only_launch("./train --model acme/secret-13b").json();
    let typed: Pod = serde_json::from_value(shell).expect("a pod");
    assert!(matches!(
        mutate(&typed, &Policy::default(), &ClusterView::default()),
        Outcome::Skipped { .. }
    ));
}

/// A label-only pod whose launch cannot be read says why, and is guarded at run time.
#[test]
fn a_label_only_pod_with_an_unreadable_launch_says_why_it_is_skipped() {
    let typed: Pod = serde_json::from_value(
        bare_pod()
            .gpus(1)
            .command_line(&["python", "-c"], &["import trl"])
            .json(),
    )
    .expect("a pod");
    match mutate(&typed, &Policy::default(), &ClusterView::default()) {
        Outcome::Guarded(g) => {
            assert!(g.reason.contains("no training annotations"), "{}", g.reason);
            assert!(g.reason.contains("could not be read"), "{}", g.reason);
        }
        other => panic!("{other:?}"),
    }
}

/// TRL's `ModelConfig` quantization flags name the method: `--load_in_4bit` is QLoRA (a 4-bit
/// base), `--load_in_8bit` LoRA on an 8-bit base, and the plan is made on it: less memory
/// than LoRA on a 16-bit base. `--use_bnb_nested_quant` quantizes the 4-bit base's constants
/// again (`double-quant`); alone it quantizes nothing.
#[test]
fn trl_quantization_flags_make_the_method() {
    let admit = |extra: &str| {
        let launch = STOCK_SFT.replace("--use_peft", &format!("--use_peft {extra}"));
        let typed: Pod = serde_json::from_value(label_only_launch(&launch).json()).expect("a pod");
        match mutate(&typed, &Policy::default(), &ClusterView::default()) {
            Outcome::Mutated(m) => *m,
            other => panic!("mutated: {other:?}"),
        }
    };
    let lora = admit("");
    let four = admit("--load_in_4bit --use_bnb_nested_quant");
    let eight = admit("--load_in_8bit");
    let nested_only = admit("--use_bnb_nested_quant");
    use memguard_estimator::Method;
    assert_eq!(lora.plan.config.method, Method::Lora);
    assert_eq!(four.plan.config.method, Method::Qlora);
    assert_eq!(four.estimate.sources["method"], "args");
    assert!(four.plan.config.double_quant, "--use_bnb_nested_quant");
    assert_eq!(four.estimate.sources["double-quant"], "args");
    assert!(!admit("--load_in_4bit").plan.config.double_quant);
    assert_eq!(eight.plan.config.method, Method::Lora);
    assert_eq!(eight.plan.config.model_bits, Some(8));
    assert_eq!(eight.estimate.sources["model-bits"], "args");
    assert_eq!(nested_only.plan.config, lora.plan.config);
    // The estimate of the same config as written: 4-bit < 8-bit < 16-bit base.
    let weights = |m: &crate::mutate::Mutation| {
        m.plan
            .estimate
            .component(memguard_estimator::Component::Weights)
    };
    assert!(
        weights(&four) < weights(&eight) && weights(&eight) < weights(&lora),
        "{:?} {:?} {:?}",
        weights(&four),
        weights(&eight),
        weights(&lora)
    );
}
