//! The Helm chart, driven through the real `helm` and validated with `kubernetes-validate`.
//!
//! Tools are found through `HELM` / `KUBERNETES_VALIDATE` / `MEMGUARD_TOOLS` / PATH; without
//! them the tests print a loud SKIP locally and fail in CI (`CI=true`).

use memguard_api::crd::{self, MemguardPolicy};
use memguard_api::policy::{DEFAULT_SIDECAR_IMAGE, PolicySpec, SidecarMode};
use memguard_api::wellknown;
use memguard_e2e::*;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every rendering the tests check: the defaults, then each `ci/*.yaml`.
fn renderings(helm: &Path) -> Vec<(String, Vec<Value>)> {
    let mut out = vec![(
        "default values".to_string(),
        parse_documents(&helm_template(helm, &[]).unwrap_or_else(|e| panic!("default: {e}"))),
    )];
    for file in ci_values_files() {
        let path = file.to_str().expect("UTF-8 path");
        let text = helm_template(helm, &["-f", path]).unwrap_or_else(|e| panic!("{path}: {e}"));
        out.push((file_label(&file), parse_documents(&text)));
    }
    out
}

fn file_label(file: &Path) -> String {
    format!("ci/{}", file.file_name().expect("file").to_string_lossy())
}

fn render_with(helm: &Path, values_file: &str) -> Vec<Value> {
    let path = chart_dir().join("ci").join(values_file);
    let path = path.to_str().expect("UTF-8");
    parse_documents(&helm_template(helm, &["-f", path]).unwrap_or_else(|e| panic!("{e}")))
}

fn read_yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn values_yaml() -> Value {
    read_yaml(&chart_dir().join("values.yaml"))
}

// === Chart metadata and values ===

#[test]
fn chart_app_version_is_the_workspace_version_and_needs_kubernetes_1_33() {
    let chart = read_yaml(&chart_dir().join("Chart.yaml"));
    assert_eq!(
        chart["appVersion"],
        env!("CARGO_PKG_VERSION"),
        "Chart.yaml appVersion must be the workspace version"
    );
    assert_eq!(chart["kubeVersion"], ">=1.33.0-0");
    assert_eq!(chart["apiVersion"], "v2");
    // The policy's built-in sidecar image is the chart's default image.
    let values = values_yaml();
    let image = format!(
        "{}:{}",
        values["image"]["repository"].as_str().expect("repository"),
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(image, DEFAULT_SIDECAR_IMAGE);
}

/// Closed schema: every object schema that lists properties forbids others.
#[test]
fn values_schema_closes_every_object() {
    fn walk(path: &str, s: &Value, open: &mut Vec<String>) {
        if let Some(props) = s.get("properties").and_then(Value::as_object) {
            if s.get("additionalProperties") != Some(&json!(false)) {
                open.push(path.to_string());
            }
            for (k, v) in props {
                walk(&format!("{path}.{k}"), v, open);
            }
        }
        for key in ["items", "additionalProperties"] {
            if let Some(v) = s.get(key).filter(|v| v.is_object()) {
                walk(&format!("{path}[{key}]"), v, open);
            }
        }
        for key in ["anyOf", "oneOf", "allOf"] {
            for v in s.get(key).and_then(Value::as_array).into_iter().flatten() {
                walk(path, v, open);
            }
        }
    }
    let schema = read_json(&chart_dir().join("values.schema.json"));
    let mut open = Vec::new();
    walk("", &schema, &mut open);
    assert!(
        open.is_empty(),
        "schema objects without additionalProperties: false: {open:?}"
    );
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every key of values.yaml that the schema declares carries a comment; every leaf a helm-docs
/// `# --` comment. Keys of free maps (labels, gpuMemory) are data, not keys.
#[test]
fn values_yaml_documents_every_key() {
    let schema = read_json(&chart_dir().join("values.schema.json"));
    let text = std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml");
    let lines: Vec<&str> = text.lines().collect();
    // (indent, key, documented with `# --`: its subtree is covered)
    let mut stack: Vec<(usize, String, bool)> = Vec::new();
    let mut undocumented = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with('-') {
            continue;
        }
        let Some((key, rest)) = trimmed.split_once(':') else {
            continue;
        };
        let indent = line.len() - trimmed.len();
        while stack.last().is_some_and(|(d, _, _)| *d >= indent) {
            stack.pop();
        }
        let covered = stack.iter().any(|(_, _, doc)| *doc);
        // The schema node of this key, if the schema declares it.
        let mut node = &schema;
        let mut declared = true;
        for k in stack.iter().map(|(_, k, _)| k.as_str()).chain([key]) {
            match node["properties"].get(k) {
                Some(n) => node = n,
                None => {
                    declared = false;
                    break;
                }
            }
        }
        let mut comments = Vec::new();
        for prev in lines[..i].iter().rev() {
            let p = prev.trim_start();
            if p.starts_with('#') {
                comments.push(p);
            } else {
                break;
            }
        }
        let helm_docs = comments.iter().any(|c| c.starts_with("# --"));
        stack.push((indent, key.to_string(), helm_docs));
        if !declared || covered {
            continue;
        }
        let is_group = rest.trim().is_empty() && node.get("properties").is_some();
        let documented = if is_group {
            !comments.is_empty()
        } else {
            helm_docs
        };
        if !documented {
            let path: Vec<&str> = stack.iter().map(|(_, k, _)| k.as_str()).collect();
            undocumented.push(path.join("."));
        }
    }
    assert!(
        undocumented.is_empty(),
        "values.yaml keys without a `# --` comment: {undocumented:?}"
    );
}

// === helm lint and template ===

#[test]
fn helm_lint_strict_passes_for_defaults_and_every_ci_values_file() {
    let Some(helm) = helm() else { return };
    let mut runs: Vec<Option<PathBuf>> = vec![None];
    runs.extend(ci_values_files().into_iter().map(Some));
    for values in runs {
        let mut cmd = Command::new(&helm);
        cmd.args([
            "lint",
            "--strict",
            "--kube-version",
            KUBE_VERSION,
            "--namespace",
            NAMESPACE,
        ])
        .arg(chart_dir());
        if let Some(v) = &values {
            cmd.arg("-f").arg(v);
        }
        let out = run(&mut cmd);
        assert!(
            out.status.success(),
            "helm lint --strict failed for {values:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn kubernetes_older_than_1_33_is_refused() {
    let Some(helm) = helm() else { return };
    let chart = chart_dir();
    let out = run(Command::new(&helm)
        .args(["template", RELEASE])
        .arg(&chart)
        .args(["--kube-version", "1.32.0"]));
    assert!(!out.status.success(), "rendered for Kubernetes 1.32");
    assert!(String::from_utf8_lossy(&out.stderr).contains("kubeVersion"));
}

/// Kinds `kubernetes-validate` knows (built into Kubernetes 1.33).
const BUILTIN_API_VERSIONS: &[&str] = &[
    "v1",
    "apps/v1",
    "policy/v1",
    "rbac.authorization.k8s.io/v1",
    "admissionregistration.k8s.io/v1",
    "networking.k8s.io/v1",
];
/// Third-party kinds: no schema here to validate against (cert-manager, Prometheus Operator), except
/// the PrometheusRule, checked against its v1 shape ([`validate_prometheus_rule`]) here and with
/// promtool in `tests/alerts.rs`.
const THIRD_PARTY_API_VERSIONS: &[&str] = &["cert-manager.io/v1", "monitoring.coreos.com/v1"];

#[test]
fn every_rendered_manifest_is_valid_for_kubernetes_1_33() {
    let Some(helm) = helm() else { return };
    let Some(validator) = kubernetes_validate() else {
        return;
    };
    let Some(python) = python_with_jsonschema() else {
        return;
    };
    let policy_schema = crd::crds()
        .into_iter()
        .map(|c| serde_json::to_value(c).expect("serializes"))
        .find(|c| c["spec"]["names"]["kind"] == "MemguardPolicy")
        .expect("MemguardPolicy CRD")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        .clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut files = Vec::new();
    let mut skipped = BTreeSet::new();
    let mut rules = 0;
    for (label, docs) in renderings(&helm) {
        assert!(docs.len() >= 10, "{label}: only {} documents", docs.len());
        for (i, doc) in docs.iter().enumerate() {
            let api_version = doc["apiVersion"].as_str().expect("apiVersion");
            let what = format!("{label}: {}", describe(doc));
            if BUILTIN_API_VERSIONS.contains(&api_version) {
                let file = dir.path().join(format!(
                    "{}-{i}-{}.yaml",
                    label.replace('/', "_"),
                    doc["kind"].as_str().expect("kind")
                ));
                std::fs::write(&file, doc.to_string()).expect("write manifest");
                files.push(file);
            } else if api_version == "training.memguard.io/v1alpha1" {
                assert_eq!(doc["kind"], "MemguardPolicy", "{what}");
                validate_against_crd(&python, &policy_schema, doc)
                    .unwrap_or_else(|e| panic!("{what} does not match its CRD schema:\n{e}"));
                let policy: MemguardPolicy =
                    serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
                policy
                    .spec
                    .resolved()
                    .unwrap_or_else(|e| panic!("{what}: {e:?}"));
            } else if api_version == "monitoring.coreos.com/v1" && doc["kind"] == "PrometheusRule" {
                validate_prometheus_rule(&python, doc)
                    .unwrap_or_else(|e| panic!("{what} is not a valid PrometheusRule:\n{e}"));
                rules += 1;
            } else if THIRD_PARTY_API_VERSIONS.contains(&api_version) {
                skipped.insert(format!(
                    "{api_version} {}",
                    doc["kind"].as_str().expect("kind")
                ));
            } else {
                panic!("{what}: unexpected apiVersion {api_version}");
            }
        }
    }
    if let Err(out) = validate_manifests(&validator, &files) {
        panic!("kubernetes-validate --strict rejected rendered manifests:\n{out}");
    }
    assert!(
        rules > 0,
        "no ci/*.yaml renders the PrometheusRule: its schema check never ran"
    );
    eprintln!(
        "note: not schema-validated (third-party CRDs, no schema offline): {skipped:?}; \
         their fields are checked by the chart tests below"
    );
}

/// The rendered default manifests, so chart changes show in review. Generated certificates are
/// redacted (they differ on every render). Update with `INSTA_UPDATE=always cargo test -p
/// memguard-e2e --test chart` or `cargo insta review`.
#[test]
fn default_render_snapshot() {
    let Some(helm) = helm() else { return };
    let text = helm_template(&helm, &[]).expect("renders");
    let redacted: String = text
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            for key in ["tls.crt: ", "tls.key: ", "ca.crt: ", "caBundle: "] {
                if trimmed.starts_with(key) {
                    let indent = &line[..line.len() - trimmed.len()];
                    return format!("{indent}{key}<generated>\n");
                }
            }
            format!("{line}\n")
        })
        .collect();
    insta::assert_snapshot!("default-render", redacted);
}

// === Rejected values ===

fn expect_failure(helm: &Path, sets: &[&str], expected: &str) {
    let mut args = Vec::new();
    for s in sets {
        // Helm's --set keeps floats as strings; numbers go through --set-json.
        match s.strip_prefix("json:") {
            Some(json) => args.extend(["--set-json", json]),
            None => args.extend(["--set", s]),
        }
    }
    match helm_template(helm, &args) {
        Ok(_) => panic!("{sets:?} rendered; it should fail with {expected:?}"),
        Err(stderr) => assert!(
            stderr.contains(expected),
            "{sets:?} failed without {expected:?}:\n{stderr}"
        ),
    }
}

#[test]
fn misspelt_values_are_rejected_by_the_schema() {
    let Some(helm) = helm() else { return };
    expect_failure(&helm, &["webhook.replica=3"], "replica");
    expect_failure(&helm, &["tls.certManager.enable=true"], "enable");
    expect_failure(&helm, &["sidecarr.mode=classic"], "sidecarr");
    expect_failure(&helm, &["sidecar.mode=sidecar"], "/sidecar/mode");
    expect_failure(&helm, &["webhook.timeoutSeconds=60"], "timeoutSeconds");
    expect_failure(
        &helm,
        &["json:policy.safetyRatio=1.5"],
        "/policy/safetyRatio",
    );
    expect_failure(&helm, &["policy.envNames.batchsize=BS"], "batchsize");
}

#[test]
fn contradictory_values_fail_with_a_message_naming_the_fix() {
    let Some(helm) = helm() else { return };
    let ca = std::fs::read_to_string(chart_dir().join("ci/existing-secret-values.yaml"))
        .expect("ci file");
    let ca = ca
        .lines()
        .find_map(|l| l.trim().strip_prefix("caBundle: "))
        .expect("caBundle in ci/existing-secret-values.yaml")
        .to_string();
    let ca_set = format!("tls.caBundle={ca}");
    let cases: &[(&[&str], &str)] = &[
        (
            &["tls.certManager.enabled=true", "tls.existingSecret=mine"],
            "tls.certManager.enabled and tls.existingSecret are two different TLS modes",
        ),
        (
            &["tls.existingSecret=mine"],
            "tls.existingSecret needs tls.caBundle",
        ),
        (&[&ca_set], "tls.caBundle is set without tls.existingSecret"),
        (
            &["tls.certManager.enabled=true", &ca_set],
            "tls.caBundle is not used with tls.certManager.enabled",
        ),
        (
            &["tls.existingSecret=mine", "tls.caBundle=bm90IGEgY2VydA=="],
            "tls.caBundle must be a base64-encoded PEM",
        ),
        (
            &["tls.certManager.issuerRef.name=corp-ca"],
            "tls.certManager.issuerRef.name is set but tls.certManager.enabled is false",
        ),
        (
            &["webhook.replicas=1"],
            "webhook.podDisruptionBudget.minAvailable (1) must be below webhook.replicas (1)",
        ),
        (
            &[
                "json:policy.thresholds.warn=0.9",
                "json:policy.thresholds.downgrade=0.8",
            ],
            "policy.thresholds must satisfy 0 < warn < downgrade < critical <= 1",
        ),
        (
            &["webhook.metricsPort=8443"],
            "webhook.port and webhook.metricsPort must differ",
        ),
    ];
    for (sets, expected) in cases {
        expect_failure(&helm, sets, expected);
    }
}

// === Wiring between objects, and the contract ===

fn arg_after<'a>(args: &'a [Value], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("webhook args lack {flag}: {args:?}"));
    args[i + 1].as_str().expect("string arg")
}

#[test]
fn webhook_configuration_agrees_with_the_contract_service_and_deployment() {
    let Some(helm) = helm() else { return };
    for (label, docs) in renderings(&helm) {
        let mwc = find_kind(&docs, "MutatingWebhookConfiguration");
        let hooks = mwc["webhooks"].as_array().expect("webhooks");
        assert_eq!(hooks.len(), 1, "{label}");
        let hook = &hooks[0];
        let svc_ref = &hook["clientConfig"]["service"];
        assert_eq!(svc_ref["path"], wellknown::WEBHOOK_PATH, "{label}");
        assert_eq!(svc_ref["namespace"], NAMESPACE, "{label}");
        assert_eq!(
            hook["objectSelector"],
            json!({"matchLabels": {wellknown::ENABLED_LABEL: wellknown::ENABLED_VALUE}}),
            "{label}"
        );
        let expr = &hook["namespaceSelector"]["matchExpressions"][0];
        assert_eq!(expr["key"], "kubernetes.io/metadata.name", "{label}");
        assert_eq!(expr["operator"], "NotIn", "{label}");
        let excluded: Vec<&str> = expr["values"]
            .as_array()
            .expect("values")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            excluded.contains(&"kube-system") && excluded.contains(&NAMESPACE),
            "{label}"
        );
        assert_eq!(hook["failurePolicy"], "Ignore", "{label}");
        assert_eq!(hook["sideEffects"], "None", "{label}");
        assert_eq!(hook["reinvocationPolicy"], "IfNeeded", "{label}");
        assert_eq!(hook["admissionReviewVersions"], json!(["v1"]), "{label}");
        assert!(
            hook["timeoutSeconds"].as_u64().is_some_and(|t| t <= 10),
            "{label}"
        );
        assert_eq!(
            hook["rules"],
            json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                    "resources": ["pods"], "scope": "Namespaced"}]),
            "{label}"
        );

        // The Service it names exists, and its port leads to the container port the webhook
        // listens on, which is the contract's port.
        let service = all_of_kind(&docs, "Service")
            .into_iter()
            .find(|s| s["metadata"]["name"] == svc_ref["name"])
            .unwrap_or_else(|| panic!("{label}: no Service {}", svc_ref["name"]));
        let port = service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .find(|p| p["port"] == svc_ref["port"])
            .unwrap_or_else(|| panic!("{label}: Service has no port {}", svc_ref["port"]));
        let deploy = find_kind(&docs, "Deployment");
        let pod = &deploy["spec"]["template"];
        for (k, v) in service["spec"]["selector"].as_object().expect("selector") {
            assert_eq!(
                &pod["metadata"]["labels"][k], v,
                "{label}: Service selects no pod"
            );
        }
        let container = &pod["spec"]["containers"][0];
        let cport = container["ports"]
            .as_array()
            .expect("container ports")
            .iter()
            .find(|p| p["name"] == port["targetPort"])
            .unwrap_or_else(|| panic!("{label}: no container port {}", port["targetPort"]));
        assert_eq!(cport["containerPort"], wellknown::WEBHOOK_PORT, "{label}");
        let args = container["args"].as_array().expect("args");
        assert_eq!(
            arg_after(args, "--listen"),
            format!("0.0.0.0:{}", wellknown::WEBHOOK_PORT)
        );
        assert_eq!(
            arg_after(args, "--metrics-listen"),
            format!("0.0.0.0:{}", wellknown::WEBHOOK_METRICS_PORT)
        );
        let metrics = container["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .find(|p| p["name"] == "metrics")
            .expect("metrics port");
        assert_eq!(
            metrics["containerPort"],
            wellknown::WEBHOOK_METRICS_PORT,
            "{label}"
        );
        for probe in ["readinessProbe", "livenessProbe"] {
            assert_eq!(
                container[probe]["httpGet"]["port"], "https",
                "{label} {probe}"
            );
            assert_eq!(
                container[probe]["httpGet"]["scheme"], "HTTPS",
                "{label} {probe}"
            );
        }
        assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");

        // The files named in the args are mounted: certificate, key and policy.
        let mounts = container["volumeMounts"].as_array().expect("mounts");
        let volumes = pod["spec"]["volumes"].as_array().expect("volumes");
        let volume_for = |file: &str| {
            let m = mounts
                .iter()
                .find(|m| file.starts_with(&format!("{}/", m["mountPath"].as_str().expect("path"))))
                .unwrap_or_else(|| panic!("{label}: {file} is not under any mount"));
            volumes
                .iter()
                .find(|v| v["name"] == m["name"])
                .expect("volume of the mount")
        };
        let tls = volume_for(arg_after(args, "--tls-cert-file"));
        assert_eq!(tls, volume_for(arg_after(args, "--tls-key-file")));
        let secret_name = tls["secret"]["secretName"]
            .as_str()
            .expect("a Secret volume");
        let policy = volume_for(arg_after(args, "--policy-file"));
        let cm_name = policy["configMap"]["name"]
            .as_str()
            .expect("a ConfigMap volume");
        let cm = all_of_kind(&docs, "ConfigMap")
            .into_iter()
            .find(|c| c["metadata"]["name"] == cm_name)
            .unwrap_or_else(|| panic!("{label}: no ConfigMap {cm_name}"));
        let file = Path::new(arg_after(args, "--policy-file"))
            .file_name()
            .expect("file");
        assert!(
            cm["data"][file.to_str().expect("UTF-8")].is_string(),
            "{label}"
        );

        // The certificate Secret is the chart's, cert-manager's or the user's, per mode.
        let cert_managed = !all_of_kind(&docs, "Certificate").is_empty();
        if cert_managed {
            let cert = find_kind(&docs, "Certificate");
            assert_eq!(cert["spec"]["secretName"], secret_name, "{label}");
            let annotation = &mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"];
            assert_eq!(
                annotation.as_str(),
                Some(format!(
                    "{NAMESPACE}/{}",
                    cert["metadata"]["name"].as_str().expect("name")
                ))
                .as_deref(),
                "{label}"
            );
            assert!(hook["clientConfig"].get("caBundle").is_none(), "{label}");
            let service_host = format!("{}.{NAMESPACE}.svc", svc_ref["name"].as_str().expect("n"));
            assert!(
                cert["spec"]["dnsNames"]
                    .as_array()
                    .expect("dns")
                    .contains(&json!(service_host))
            );
        } else {
            assert!(
                hook["clientConfig"]["caBundle"].is_string(),
                "{label}: no caBundle"
            );
        }
    }
}

/// Standard base64 (what Kubernetes Secret data and caBundle use).
fn decode_b64(s: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes().filter(|&c| c != b'=' && !c.is_ascii_whitespace()) {
        let v = ALPHABET
            .iter()
            .position(|&a| a == c)
            .expect("base64 character") as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

#[test]
fn self_signed_mode_generates_a_ca_the_webhook_configuration_trusts() {
    let Some(helm) = helm() else { return };
    let Some(openssl) = find_tool("openssl", "OPENSSL").or_else(|| missing("openssl")) else {
        return;
    };
    let docs = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    let secret = find_kind(&docs, "Secret");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    let mwc = find_kind(&docs, "MutatingWebhookConfiguration");
    let ca_bundle = &mwc["webhooks"][0]["clientConfig"]["caBundle"];
    assert_eq!(
        &secret["data"]["ca.crt"], ca_bundle,
        "caBundle is the Secret's CA"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    for key in ["ca.crt", "tls.crt", "tls.key"] {
        let pem = decode_b64(secret["data"][key].as_str().expect("base64"));
        assert!(
            String::from_utf8_lossy(&pem).contains("-----BEGIN"),
            "{key} is not PEM"
        );
        std::fs::write(dir.path().join(key), pem).expect("write");
    }
    let verify = run(Command::new(&openssl)
        .arg("verify")
        .arg("-CAfile")
        .arg(dir.path().join("ca.crt"))
        .arg(dir.path().join("tls.crt")));
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );
    let san = run(Command::new(&openssl)
        .args(["x509", "-noout", "-ext", "subjectAltName", "-in"])
        .arg(dir.path().join("tls.crt")));
    let san = String::from_utf8_lossy(&san.stdout);
    let host = format!("DNS:{RELEASE}-memguard.{NAMESPACE}.svc");
    assert!(
        san.contains(&format!("{host},")) || san.contains(&format!("{host}\n")),
        "{san}"
    );
}

#[test]
fn existing_secret_mode_uses_the_given_secret_and_ca() {
    let Some(helm) = helm() else { return };
    let docs = render_with(&helm, "existing-secret-values.yaml");
    assert!(
        all_of_kind(&docs, "Secret").is_empty(),
        "the chart must not create a Secret"
    );
    let values = read_yaml(&chart_dir().join("ci/existing-secret-values.yaml"));
    let mwc = find_kind(&docs, "MutatingWebhookConfiguration");
    assert_eq!(
        mwc["webhooks"][0]["clientConfig"]["caBundle"],
        values["tls"]["caBundle"]
    );
    let deploy = find_kind(&docs, "Deployment");
    let volumes = deploy["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes");
    assert!(
        volumes
            .iter()
            .any(|v| v["secret"]["secretName"] == values["tls"]["existingSecret"])
    );
}

#[test]
fn cert_manager_mode_uses_its_own_issuer_or_the_given_one() {
    let Some(helm) = helm() else { return };
    let own = render_with(&helm, "cert-manager-values.yaml");
    let issuer = find_kind(&own, "Issuer");
    assert_eq!(issuer["spec"], json!({"selfSigned": {}}));
    let cert = find_kind(&own, "Certificate");
    assert_eq!(
        cert["spec"]["issuerRef"]["name"],
        issuer["metadata"]["name"]
    );
    assert!(all_of_kind(&own, "Secret").is_empty());

    let given = render_with(&helm, "cert-manager-issuer-values.yaml");
    assert!(all_of_kind(&given, "Issuer").is_empty());
    let cert = find_kind(&given, "Certificate");
    assert_eq!(
        cert["spec"]["issuerRef"],
        json!({"name": "internal-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"})
    );
    assert_eq!(cert["spec"]["duration"], "2160h");
}

fn policy_documents(label: &str, docs: &[Value]) -> (PolicySpec, Option<Value>) {
    let cm = all_of_kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| c["data"]["policy.yaml"].is_string())
        .unwrap_or_else(|| panic!("{label}: no policy ConfigMap"));
    let text = cm["data"]["policy.yaml"].as_str().expect("string");
    let spec: PolicySpec = serde_saphyr::from_str(text)
        .unwrap_or_else(|e| panic!("{label}: policy.yaml is not a PolicySpec: {e}\n{text}"));
    spec.resolved()
        .unwrap_or_else(|e| panic!("{label}: invalid policy: {e:?}"));
    let resource = all_of_kind(docs, "MemguardPolicy")
        .first()
        .map(|p| (*p).clone());
    (spec, resource)
}

#[test]
fn policy_file_and_default_memguard_policy_are_the_same_valid_policy() {
    let Some(helm) = helm() else { return };
    for (label, docs) in renderings(&helm) {
        let (spec, resource) = policy_documents(&label, &docs);
        let resource = resource.unwrap_or_else(|| panic!("{label}: no MemguardPolicy"));
        assert_eq!(
            resource["metadata"]["name"],
            crd::DEFAULT_POLICY_NAME,
            "{label}"
        );
        assert!(
            resource["metadata"].get("namespace").is_none(),
            "cluster-scoped"
        );
        let from_resource: PolicySpec =
            serde_json::from_value(resource["spec"].clone()).expect("a PolicySpec");
        assert_eq!(
            from_resource, spec,
            "{label}: ConfigMap and MemguardPolicy differ"
        );
    }
    let defaults = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    let (spec, _) = policy_documents("defaults", &defaults);
    let policy = spec.resolved().expect("valid");
    let built_in = PolicySpec::default().resolved().expect("valid");
    assert_eq!(policy.sidecar_image, DEFAULT_SIDECAR_IMAGE);
    assert_eq!(policy.sidecar_mode, SidecarMode::Native);
    assert_eq!(policy.safety_ratio, built_in.safety_ratio);
    assert_eq!(policy.thresholds, built_in.thresholds);
    assert_eq!(policy.floors, built_in.floors);
    assert_eq!(policy.sidecar_resources, built_in.sidecar_resources);
    assert_eq!(policy.sidecar_interval, built_in.sidecar_interval);

    let classic = render_with(&helm, "classic-sidecar-values.yaml");
    let (spec, _) = policy_documents("classic", &classic);
    let policy = spec.resolved().expect("valid");
    assert_eq!(policy.sidecar_mode, SidecarMode::Classic);
    assert_eq!(
        policy.sidecar_image,
        "registry.example.com/memguard/sidecar:0.1.0-custom"
    );
    assert_eq!(
        policy.sidecar_resources.memory_limit.as_deref(),
        Some("48Mi")
    );
    assert_eq!(
        policy.env_names[&memguard_api::Knob::BatchSize],
        "PER_DEVICE_TRAIN_BATCH_SIZE"
    );

    let none = parse_documents(
        &helm_template(&helm, &["--set", "policy.createResource=false"]).expect("renders"),
    );
    assert!(all_of_kind(&none, "MemguardPolicy").is_empty());
    policy_documents("createResource=false", &none);
}

#[test]
fn changing_the_policy_rolls_the_webhook_pods() {
    let Some(helm) = helm() else { return };
    let checksum = |sets: &[&str]| {
        let docs = parse_documents(&helm_template(&helm, sets).expect("renders"));
        find_kind(&docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
            ["checksum/config"]
            .as_str()
            .expect("checksum/config")
            .to_string()
    };
    let base = checksum(&[]);
    assert_eq!(base.len(), 64);
    assert_eq!(base, checksum(&[]), "stable across renders");
    assert_ne!(base, checksum(&["--set-json", "policy.safetyRatio=0.8"]));
    assert_ne!(base, checksum(&["--set", "sidecar.mode=classic"]));
}

#[test]
fn rbac_is_least_privilege() {
    let Some(helm) = helm() else { return };
    let docs = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    let cluster_role = find_kind(&docs, "ClusterRole");
    assert_eq!(
        cluster_role["rules"],
        json!([
            {"apiGroups": ["training.memguard.io"], "resources": ["memguardpolicies"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["training.memguard.io"], "resources": ["memoryprofiles"],
             "verbs": ["get", "list", "watch", "create"]},
            {"apiGroups": ["training.memguard.io"], "resources": ["memoryprofiles/status"],
             "verbs": ["patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["resource.k8s.io"],
             "resources": ["resourceclaims", "resourceclaimtemplates", "deviceclasses",
                           "resourceslices"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
        ])
    );
    // The release namespace: leases, and the InvalidPolicy Event on the webhook's own Pod
    // (issue 38), which the Deployment names through the downward API.
    let own = docs
        .iter()
        .find(|d| d["kind"] == "Role" && d["rules"].to_string().contains("leases"))
        .expect("the release namespace's Role");
    assert_eq!(own["metadata"]["namespace"], NAMESPACE);
    assert_eq!(
        own["rules"][1],
        json!({"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]})
    );
    let env = &find_kind(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"];
    for (name, path) in [
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("POD_UID", "metadata.uid"),
    ] {
        assert!(
            env.as_array()
                .expect("env")
                .iter()
                .any(|e| e["name"] == name && e["valueFrom"]["fieldRef"]["fieldPath"] == path),
            "{name}: {env}"
        );
    }
    // ConfigMaps in named namespaces only: a Role (read, nothing else) in each, none
    // cluster-wide, and the webhook told which; off: no rule at all, and told not to read.
    let scoped = parse_documents(
        &helm_template(&helm, &["--set", "configMaps.namespaces={ml,team-a}"]).expect("renders"),
    );
    let rules = &find_kind(&scoped, "ClusterRole")["rules"];
    assert!(!rules.to_string().contains("configmaps"), "{rules}");
    let roles: Vec<&serde_json::Value> = scoped
        .iter()
        .filter(|d| d["kind"] == "Role" && d["rules"].to_string().contains("configmaps"))
        .collect();
    assert_eq!(roles.len(), 2);
    for (role, ns) in roles.iter().zip(["ml", "team-a"]) {
        assert_eq!(role["metadata"]["namespace"], ns);
        assert_eq!(
            role["rules"],
            json!([{"apiGroups": [""], "resources": ["configmaps"],
                    "verbs": ["get", "list", "watch"]}])
        );
    }
    let bindings = scoped
        .iter()
        .filter(|d| {
            d["kind"] == "RoleBinding" && d["roleRef"]["name"].to_string().contains("config-maps")
        })
        .count();
    assert_eq!(bindings, 2);
    assert!(
        serde_json::to_string(&scoped)
            .expect("json")
            .contains("MEMGUARD_WEBHOOK_CONFIG_MAP_NAMESPACES")
    );
    let off = helm_template(
        &helm,
        &[
            "--set",
            "configMaps.read=false",
            "--set",
            "nodes.read=false",
        ],
    )
    .expect("renders");
    assert!(
        !off.contains("configmaps") && !off.contains("\"nodes\""),
        "no rule when off"
    );
    assert!(
        off.contains("MEMGUARD_WEBHOOK_NO_CONFIG_MAPS")
            && off.contains("MEMGUARD_WEBHOOK_NO_NODES")
    );
    // dra.enabled=false: no access to resource.k8s.io, and the webhook told not to watch it.
    let off = helm_template(&helm, &["--set", "dra.enabled=false"]).expect("renders");
    assert!(!off.contains("resource.k8s.io"), "no DRA rule when off");
    assert!(off.contains("MEMGUARD_WEBHOOK_NO_DRA"), "--no-dra when off");
    let role = find_kind(&docs, "Role");
    assert_eq!(role["metadata"]["namespace"], NAMESPACE);
    // Leases, and Events on the webhook's own Pod (checked above).
    assert_eq!(role["rules"].as_array().expect("rules").len(), 2);
    assert_eq!(
        role["rules"][0]["apiGroups"],
        json!(["coordination.k8s.io"])
    );
    assert_eq!(role["rules"][0]["resources"], json!(["leases"]));
    let sa = find_kind(&docs, "ServiceAccount");
    for kind in ["ClusterRoleBinding", "RoleBinding"] {
        let binding = find_kind(&docs, kind);
        assert_eq!(
            binding["subjects"][0]["name"], sa["metadata"]["name"],
            "{kind}"
        );
        assert_eq!(binding["subjects"][0]["namespace"], NAMESPACE, "{kind}");
    }
    let text = serde_json::to_string(&docs).expect("json");
    assert!(!text.contains("\"*\""), "no wildcard in any rule");
}

#[test]
fn webhook_pods_are_hardened_and_spread() {
    let Some(helm) = helm() else { return };
    for (label, docs) in renderings(&helm) {
        let deploy = find_kind(&docs, "Deployment");
        let spec = &deploy["spec"]["template"]["spec"];
        assert_eq!(spec["securityContext"]["runAsNonRoot"], true, "{label}");
        assert_eq!(spec["securityContext"]["runAsUser"], 65532, "{label}");
        assert_eq!(
            spec["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        for c in spec["containers"].as_array().expect("containers") {
            let sc = &c["securityContext"];
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{label}");
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{label}");
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{label}");
            assert!(
                c["resources"]["limits"]["memory"].is_string(),
                "{label}: memory limit"
            );
        }
        let replicas = deploy["spec"]["replicas"].as_u64().expect("replicas");
        if replicas > 1 {
            let pdb = find_kind(&docs, "PodDisruptionBudget");
            assert!(pdb["spec"]["minAvailable"].as_u64().expect("minAvailable") < replicas);
            assert!(
                spec["affinity"]["podAntiAffinity"].is_object(),
                "{label}: replicas are not spread"
            );
        }
    }
    let defaults = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    assert_eq!(find_kind(&defaults, "Deployment")["spec"]["replicas"], 2);
}

/// The metric names the dashboard reads: what the webhook (`webhook/src/metrics.rs`) and the
/// sidecar (`sidecar/src/metrics.rs`) export today.
const DASHBOARD_METRICS: &[&str] = &[
    "memguard_webhook_admission_requests_total",
    "memguard_webhook_admission_duration_seconds",
    "memguard_webhook_downgrade_steps_total",
    "memguard_webhook_certificate_expiry_timestamp_seconds",
    "memguard_sidecar_working_set_bytes",
    "memguard_sidecar_limit_bytes",
    "memguard_sidecar_memory_pressure_ratio",
    "memguard_sidecar_memory_stall_some_avg10_ratio",
    "memguard_sidecar_level",
    "memguard_sidecar_downgrades_total",
    "memguard_sidecar_gpu_memory_used_bytes",
    "memguard_sidecar_gpu_memory_total_bytes",
];

#[test]
fn dashboard_shows_every_contract_metric_and_no_other() {
    let Some(helm) = helm() else { return };
    let docs = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    let cm = all_of_kind(&docs, "ConfigMap")
        .into_iter()
        .find(|c| c["data"]["memguard.json"].is_string())
        .expect("dashboard ConfigMap");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let dashboard: Value =
        serde_json::from_str(cm["data"]["memguard.json"].as_str().expect("json")).expect("JSON");
    let mut used = BTreeSet::new();
    let mut titles = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            continue;
        }
        titles.push(panel["title"].as_str().expect("title").to_string());
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}: no query", panel["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            for token in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if token.starts_with("memguard_") {
                    used.insert(token.trim_end_matches("_bucket").to_string());
                }
            }
        }
    }
    let expected: BTreeSet<String> = DASHBOARD_METRICS.iter().map(|s| s.to_string()).collect();
    assert_eq!(used, expected);
    for wanted in [
        "vs limit",
        "pressure",
        "PSI",
        "Downgrades",
        "by outcome",
        "latency",
    ] {
        assert!(
            titles.iter().any(|t| t.contains(wanted)),
            "no panel about {wanted}: {titles:?}"
        );
    }
    let off = parse_documents(
        &helm_template(&helm, &["--set", "monitoring.dashboard.enabled=false"]).expect("renders"),
    );
    assert!(
        all_of_kind(&off, "ConfigMap")
            .iter()
            .all(|c| c["data"]["memguard.json"].is_null())
    );
}

#[test]
fn monitors_scrape_the_sidecar_and_webhook_metrics_ports() {
    let Some(helm) = helm() else { return };
    let defaults = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    assert!(
        all_of_kind(&defaults, "PodMonitor").is_empty(),
        "off by default"
    );
    assert!(
        all_of_kind(&defaults, "ServiceMonitor").is_empty(),
        "off by default"
    );
    let docs = render_with(&helm, "monitoring-values.yaml");
    let pm = find_kind(&docs, "PodMonitor");
    assert_eq!(
        pm["spec"]["podMetricsEndpoints"][0]["port"],
        wellknown::SIDECAR_METRICS_PORT_NAME
    );
    assert_eq!(
        pm["spec"]["selector"]["matchLabels"],
        json!({wellknown::ENABLED_LABEL: wellknown::ENABLED_VALUE})
    );
    assert_eq!(pm["spec"]["namespaceSelector"], json!({"any": true}));
    assert_eq!(pm["metadata"]["labels"]["release"], "kube-prometheus-stack");
    let sm = find_kind(&docs, "ServiceMonitor");
    let service = find_kind(&docs, "Service");
    let port = sm["spec"]["endpoints"][0]["port"].as_str().expect("port");
    assert!(
        service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == port)
    );
    for (k, v) in sm["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("selector")
    {
        assert_eq!(&service["metadata"]["labels"][k], v);
    }
}

#[test]
fn network_policy_admits_only_the_webhook_and_metrics_ports() {
    let Some(helm) = helm() else { return };
    let defaults = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    assert!(
        all_of_kind(&defaults, "NetworkPolicy").is_empty(),
        "off by default"
    );
    let docs = render_with(&helm, "network-policy-values.yaml");
    let np = find_kind(&docs, "NetworkPolicy");
    let deploy = find_kind(&docs, "Deployment");
    for (k, v) in np["spec"]["podSelector"]["matchLabels"]
        .as_object()
        .expect("selector")
    {
        assert_eq!(&deploy["spec"]["template"]["metadata"]["labels"][k], v);
    }
    let ports: BTreeMap<String, bool> = np["spec"]["ingress"]
        .as_array()
        .expect("ingress")
        .iter()
        .map(|rule| {
            (
                rule["ports"][0]["port"]
                    .as_str()
                    .expect("named port")
                    .to_string(),
                rule["from"].is_array(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        BTreeMap::from([("https".to_string(), false), ("metrics".to_string(), true)])
    );
}

#[test]
fn notes_show_how_to_opt_in_and_verify_with_contract_names() {
    let Some(helm) = helm() else { return };
    // A client-side dry run renders NOTES.txt without a cluster.
    let out = run(Command::new(&helm)
        .args(["install", RELEASE])
        .arg(chart_dir())
        .args(["--namespace", NAMESPACE, "--dry-run=client"])
        .env("KUBECONFIG", "/dev/null"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let notes = stdout.split("\nNOTES:\n").nth(1).expect("NOTES rendered");
    assert!(notes.contains(&format!(
        "{}: \"{}\"",
        wellknown::ENABLED_LABEL,
        wellknown::ENABLED_VALUE
    )));
    let escaped = |key: &str| key.replace('.', "\\.");
    for key in [
        memguard_api::annotations::ESTIMATE,
        memguard_api::annotations::ERROR,
    ] {
        assert!(
            notes.contains(&format!(
                "jsonpath='{{.metadata.annotations.{}}}'",
                escaped(key)
            )),
            "NOTES lack the check of {key}:\n{notes}"
        );
    }
    assert!(notes.contains(wellknown::SIDECAR_CONTAINER));
    // Every annotation the example uses is a real input key.
    for line in notes.lines().map(str::trim) {
        if let Some((key, _)) = line.split_once(": ")
            && key.starts_with(memguard_api::annotations::PREFIX)
            && key != wellknown::ENABLED_LABEL
        {
            assert!(
                memguard_api::annotations::INPUT_KEYS.contains(&key),
                "NOTES use unknown annotation {key}"
            );
        }
    }
}

/// The dashboard's metric names are registered by the code that exports them (a source check:
/// the binaries are not run).
#[test]
fn dashboard_metrics_are_registered_by_the_webhook_and_the_sidecar() {
    assert_metrics_registered(DASHBOARD_METRICS.iter().copied(), "the dashboard");
}

/// `ci/custom-model-values.yaml`: a Helm-installed policy adds a model; the ConfigMap the webhook
/// starts from and the `MemguardPolicy` it watches both resolve it, by name and by alias, to the
/// config given, with the published count (the CRD schema check is in
/// `every_rendered_manifest_is_valid_for_kubernetes_1_33`).
#[test]
fn a_custom_model_in_the_values_reaches_both_policy_documents() {
    let Some(helm) = helm() else { return };
    let docs = render_with(&helm, "custom-model-values.yaml");
    let (spec, resource) = policy_documents("custom-model", &docs);
    let resource = resource.expect("a MemguardPolicy");
    let from_resource: PolicySpec =
        serde_json::from_value(resource["spec"].clone()).expect("a PolicySpec");
    for (what, spec) in [("ConfigMap", spec), ("MemguardPolicy", from_resource)] {
        let policy = spec.resolved().expect("valid");
        for name in ["acme-coder-7b", "Qwen/Qwen2.5-Coder-7B-Instruct"] {
            let found = policy
                .models
                .lookup(name)
                .unwrap_or_else(|| panic!("{what}: {name} unknown"));
            assert_eq!(found.source, memguard_api::models::Source::Policy, "{what}");
            assert_eq!(found.shape.name.as_deref(), Some("acme-coder-7b"), "{what}");
            assert_eq!(found.shape.params, Some(7_615_616_512), "{what}");
            assert_eq!(
                (found.shape.hidden_size, found.shape.num_layers),
                (3584, 28),
                "{what}"
            );
        }
    }
    // The chart's values schema refuses a misspelt entry before anything renders.
    expect_failure(
        &helm,
        &[r#"json:policy.models=[{"name":"x","confg":{}}]"#],
        "confg",
    );
}

/// `helm install --set policy.safetyRatio=0.8` (and the thresholds): helm hands a float from
/// `--set` over as a string, which the schema refused ("got string, want number"). Accepted
/// now, written into the policy as numbers; a string out of range is still refused.
#[test]
fn numbers_are_settable_with_set() {
    let Some(helm) = memguard_e2e::helm() else {
        return;
    };
    let text = helm_template(
        &helm,
        &[
            "--set",
            "policy.safetyRatio=0.8",
            "--set",
            "policy.thresholds.warn=0.6",
            "--set",
            "policy.thresholds.psiSomeAvg10=12.5",
        ],
    )
    .expect("renders");
    assert!(text.contains("safetyRatio: 0.8\n"), "{text}");
    assert!(text.contains("warn: 0.6\n"), "{text}");
    assert!(text.contains("psiSomeAvg10: 12.5\n"), "{text}");
    let err = helm_template(&helm, &["--set", "policy.safetyRatio=1.5"]).expect_err("refused");
    assert!(err.contains("safetyRatio"), "{err}");
}

// === The chart refuses what the webhook refuses (issue 38) ===

/// The model of `ci/custom-model-values.yaml`, a config the webhook accepts.
fn custom_model_config() -> Value {
    let values = read_yaml(&chart_dir().join("ci/custom-model-values.yaml"));
    values["policy"]["models"][0]["config"].clone()
}

/// One policy value both ways: through `helm template --set-json` (the schema and the
/// templates), and as the webhook reads it (`PolicySpec::resolved`). The two must agree.
fn chart_and_webhook_agree(helm: &Path, key: &str, value: Value) -> (bool, bool) {
    let set = format!("policy.{key}={value}");
    let chart = helm_template(helm, &["--set-json", &set]);
    // The chart writes a level given as a string (`--set` keeps floats as strings) as a number.
    let read = match (key, &value) {
        ("estimateLevel", Value::String(s)) => s.parse::<f64>().map_or(value.clone(), |n| json!(n)),
        _ => value,
    };
    let document: serde_json::Map<String, Value> = [(key.to_string(), read)].into_iter().collect();
    let webhook = serde_json::from_value::<PolicySpec>(Value::Object(document))
        .map_err(|e| vec![e.to_string()])
        .and_then(|spec| spec.resolved());
    if let Ok(text) = &chart {
        // What rendered is what the webhook then reads from the ConfigMap.
        let (spec, _) = policy_documents(&set, &parse_documents(text));
        assert_eq!(
            spec.resolved().is_ok(),
            webhook.is_ok(),
            "{set}: the rendered policy and the value disagree"
        );
    }
    (chart.is_ok(), webhook.is_ok())
}

/// Issue 38: `--set-string policy.defaultGpuMemory=24` rendered, and the webhook read 24 bytes.
/// Every size, level and model entry here is accepted by the chart exactly when the webhook
/// accepts it. (Only the webhook can derive a model's parameter count from its config: a
/// `params` that disagrees renders, and stops the webhook at start, loudly; see
/// `webhook/tests/e2e.rs`.)
#[test]
fn the_values_schema_refuses_what_the_webhook_refuses() {
    let Some(helm) = helm() else { return };
    let config = custom_model_config();
    let model = |name: &str, config: Value| json!([{"name": name, "config": config}]);
    let cases: Vec<(&str, Value, bool)> = vec![
        ("defaultGpuMemory", json!("24"), false),
        ("defaultGpuMemory", json!(24), false),
        ("defaultGpuMemory", json!("22.5"), false),
        ("defaultGpuMemory", json!("1e9"), false),
        ("defaultGpuMemory", json!("0Gi"), false),
        ("defaultGpuMemory", json!("-1Gi"), false),
        ("defaultGpuMemory", json!("24 parsecs"), false),
        ("defaultGpuMemory", json!("24P"), false),
        ("defaultGpuMemory", json!("24Gi"), true),
        ("defaultGpuMemory", json!("24GiB"), true),
        ("defaultGpuMemory", json!("80G"), true),
        ("defaultGpuMemory", json!("0.5Ti"), true),
        ("defaultGpuMemory", json!("23028mi"), true),
        ("gpuMemory", json!({"NVIDIA-A10G": "22"}), false),
        ("gpuMemory", json!({"NVIDIA-A10G": "22Gi"}), true),
        ("estimateLevel", json!(0.4), false),
        ("estimateLevel", json!("0.4"), false),
        ("estimateLevel", json!(1), false),
        ("estimateLevel", json!("0.995"), false),
        ("estimateLevel", json!(0.5), true),
        ("estimateLevel", json!("0.9"), true),
        ("estimateLevel", json!("0.99"), true),
        ("models", model("acme-coder-7b", config.clone()), true),
        ("models", model("shape-7b", config.clone()), false),
        ("models", model("Shape_7b", config.clone()), false),
        ("models", model("acme 7b", config.clone()), false),
        ("models", model("a", json!({"num_hidden_layers": 2})), false),
        ("models", model("a", json!({"hidden_size": "big"})), false),
        ("models", model("a", json!("config.json")), false),
        (
            "models",
            json!([{"name": "a", "config": config.clone(), "params": "lots"}]),
            false,
        ),
        (
            "models",
            json!([{"name": "a", "config": config.clone(), "params": "7.6B"}]),
            true,
        ),
        (
            "models",
            json!([{"name": "Acme.7b", "config": config.clone()},
                   {"name": "b", "aliases": ["acme_7B"], "config": config.clone()}]),
            false,
        ),
    ];
    let mut disagree = Vec::new();
    for (key, value, valid) in cases {
        let (chart, webhook) = chart_and_webhook_agree(&helm, key, value.clone());
        if (chart, webhook) != (valid, valid) {
            disagree.push(format!(
                "policy.{key}={value}: chart {chart}, webhook {webhook}, expected {valid}"
            ));
        }
    }
    assert!(disagree.is_empty(), "{disagree:#?}");
}

/// `--set-string`, as issue 38 found it: the string `24` is refused by the schema, naming the
/// field; with a unit it renders, and the webhook reads the size as written.
#[test]
fn set_string_sizes_without_a_unit_are_refused() {
    let Some(helm) = helm() else { return };
    for set in [
        "policy.defaultGpuMemory=24",
        "policy.gpuMemory.NVIDIA-A10G=22",
    ] {
        let err = helm_template(&helm, &["--set-string", set]).expect_err(set);
        let field = set.split('=').next().expect("key").replace('.', "/");
        assert!(
            err.contains(&format!("/{field}'")) && err.contains("does not match pattern"),
            "{set}: {err}"
        );
    }
    let text = helm_template(&helm, &["--set-string", "policy.defaultGpuMemory=24GiB"])
        .expect("a size with a unit renders");
    let (spec, _) = policy_documents("24GiB", &parse_documents(&text));
    let policy = spec.resolved().expect("valid");
    assert_eq!(
        policy.default_gpu_memory,
        memguard_estimator::Bytes::gib(24)
    );
    assert_eq!(policy.default_gpu_memory_written.to_string(), "24GiB");
}

/// The chart's size pattern is the parser's own (`SIZE_PATTERN`), written once in Rust.
#[test]
fn the_size_pattern_is_the_parsers() {
    let schema = read_json(&chart_dir().join("values.schema.json"));
    let policy = &schema["properties"]["policy"]["properties"];
    assert_eq!(
        policy["defaultGpuMemory"]["pattern"],
        memguard_api::quantity::SIZE_PATTERN
    );
    assert_eq!(
        policy["gpuMemory"]["additionalProperties"]["pattern"],
        memguard_api::quantity::SIZE_PATTERN
    );
}

/// Issue 38, item 6: the policy's `estimateLevel` is a chart value, rendered as a number (also
/// from `--set`, which gives a string) into the ConfigMap and the `MemguardPolicy`.
#[test]
fn estimate_level_is_a_value_rendered_into_the_policy() {
    let Some(helm) = helm() else { return };
    assert_eq!(values_yaml()["policy"]["estimateLevel"], json!(0.95));
    let defaults = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    let (spec, _) = policy_documents("defaults", &defaults);
    assert_eq!(spec.estimate_level, Some(0.95));
    let text = helm_template(&helm, &["--set", "policy.estimateLevel=0.8"]).expect("renders");
    let docs = parse_documents(&text);
    let (spec, resource) = policy_documents("0.8", &docs);
    assert_eq!(spec.resolved().expect("valid").estimate_level, 0.8);
    assert_eq!(
        resource.expect("MemguardPolicy")["spec"]["estimateLevel"],
        json!(0.8)
    );
}
