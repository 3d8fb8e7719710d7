//! Helpers for memguard's cross-crate tests: the workspace layout, the external tools the chart
//! tests drive (helm, kubernetes-validate, python's jsonschema, promtool), multi-document YAML,
//! and the metric names the binaries export.
//!
//! A missing tool fails the test in CI (`CI=true`) or with `MEMGUARD_REQUIRE_TOOLS=1`, and prints
//! a loud SKIP elsewhere: a test never passes silently without having run.
#![forbid(unsafe_code)]

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The workspace root (the parent of this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root")
        .to_path_buf()
}

/// The chart directory.
pub fn chart_dir() -> PathBuf {
    workspace_root().join("charts/memguard")
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Whether we run in CI (`CI=true`).
pub fn in_ci() -> bool {
    env_flag("CI")
}

/// Whether a missing tool is a failure rather than a skip: in CI, or with
/// `MEMGUARD_REQUIRE_TOOLS=1` (to prove locally that nothing was skipped).
pub fn tools_required() -> bool {
    in_ci() || env_flag("MEMGUARD_REQUIRE_TOOLS")
}

/// How to install the tools, for messages.
pub const INSTALL_HINT: &str = "install them with `scripts/install-helm.sh` (helm, kubectl; \
     put its output folder on PATH, in MEMGUARD_TOOLS=<dir>/.. or HELM=<dir>/helm) and \
     `pip install kubernetes-validate jsonschema`; promtool: `apt-get install prometheus` (or \
     `scripts/install-deps.sh`, which installs all of them)";

/// Reports a missing tool: panics when [`tools_required`], prints a loud SKIP otherwise. Returns
/// `None` so a test can `let Some(helm) = … else { return };`.
pub fn missing<T>(what: &str) -> Option<T> {
    if tools_required() {
        panic!(
            "{what} is required (CI=true or MEMGUARD_REQUIRE_TOOLS set) but was not found; \
             {INSTALL_HINT}"
        );
    }
    eprintln!(
        "\n==================== SKIP ====================\n\
         {what} not found: this test did NOT run.\n{INSTALL_HINT}\n\
         ==============================================\n"
    );
    None
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Finds `name`: `$ENV_VAR`, then `$MEMGUARD_TOOLS/bin`, then `~/.cache/memguard-tools/bin`
/// (where install-helm.sh puts it), then PATH.
pub fn find_tool(name: &str, env_var: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var) {
        return Some(PathBuf::from(p));
    }
    let mut dirs = Vec::new();
    if let Some(tools) = std::env::var_os("MEMGUARD_TOOLS") {
        dirs.push(PathBuf::from(tools).join("bin"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cache/memguard-tools/bin"));
    }
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .or_else(|| on_path(name))
}

/// The helm binary, or a SKIP (locally) / panic (CI).
pub fn helm() -> Option<PathBuf> {
    find_tool("helm", "HELM").or_else(|| missing("helm"))
}

/// The `kubernetes-validate` command, or a SKIP / panic.
pub fn kubernetes_validate() -> Option<PathBuf> {
    find_tool("kubernetes-validate", "KUBERNETES_VALIDATE")
        .or_else(|| missing("kubernetes-validate"))
}

/// Prometheus' `promtool` (Debian's `prometheus` package), or a SKIP / panic.
pub fn promtool() -> Option<PathBuf> {
    find_tool("promtool", "PROMTOOL").or_else(|| missing("promtool"))
}

/// `promtool check metrics` on an exposition in the classic Prometheus text format: names,
/// HELP/TYPE lines and suffixes as Prometheus lints them. Shared by the webhook's and the
/// sidecar's metrics tests; a missing promtool fails in CI and skips loudly elsewhere.
pub fn promtool_check_metrics(text: &str) {
    let Some(promtool) = promtool() else {
        return;
    };
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e}", promtool.display()));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool runs");
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- metrics ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A python interpreter that can `import jsonschema`, or a SKIP / panic.
pub fn python_with_jsonschema() -> Option<PathBuf> {
    let python = find_tool("python3", "PYTHON")?;
    let ok = Command::new(&python)
        .args(["-c", "import jsonschema"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Some(python)
    } else {
        missing("python3 with the jsonschema module")
    }
}

/// The Kubernetes version the chart targets and manifests are validated against.
pub const KUBE_VERSION: &str = "1.33.0";
/// Release name used by the chart tests.
pub const RELEASE: &str = "mg";
/// Release namespace used by the chart tests.
pub const NAMESPACE: &str = "memguard";

/// Runs a command and returns its output (spawn failures panic: the tool was found).
pub fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// `helm template` of the chart with extra arguments (e.g. `-f ci/x.yaml`, `--set a=b`).
/// Returns stdout, or stderr when helm fails.
pub fn helm_template(helm: &Path, extra: &[&str]) -> Result<String, String> {
    let chart = chart_dir();
    let out = run(Command::new(helm)
        .args(["template", RELEASE])
        .arg(&chart)
        .args(["--namespace", NAMESPACE, "--kube-version", KUBE_VERSION])
        .args(extra));
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).expect("helm writes UTF-8"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The chart's CI values files (`charts/memguard/ci/*.yaml`), sorted.
pub fn ci_values_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(chart_dir().join("ci"))
        .expect("charts/memguard/ci exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// Parses a multi-document YAML stream into JSON values, dropping empty documents.
pub fn parse_documents(yaml: &str) -> Vec<Value> {
    serde_saphyr::from_str_multiple::<Value, Vec<Value>>(yaml)
        .unwrap_or_else(|e| panic!("rendered YAML does not parse: {e}\n{yaml}"))
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

/// `kind/name` of a manifest, for messages.
pub fn describe(doc: &Value) -> String {
    format!(
        "{}/{}",
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// The first document of `kind`, panicking with the kinds present when there is none.
pub fn find_kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter().find(|d| d["kind"] == kind).unwrap_or_else(|| {
        let kinds: Vec<String> = docs.iter().map(describe).collect();
        panic!("no {kind} among {kinds:?}")
    })
}

/// Every document of `kind`.
pub fn all_of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// Validates manifest files with `kubernetes-validate --strict` against [`KUBE_VERSION`].
/// Returns the tool's output on failure. Unknown kinds make it warn, not fail: callers only pass
/// built-in kinds.
pub fn validate_manifests(tool: &Path, files: &[PathBuf]) -> Result<String, String> {
    let out = run(Command::new(tool)
        .args(["--kubernetes-version", KUBE_VERSION, "--strict"])
        .args(files));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // kubernetes-validate exits 0 when it merely could not find a schema; treat that as an error
    // too, since callers only pass kinds it must know.
    if out.status.success() && !text.contains("Couldn't find schema") && !text.contains("ERROR") {
        Ok(text)
    } else {
        Err(text)
    }
}

/// Validates `instance` against a CRD's `openAPIV3Schema` with python's jsonschema, after
/// closing every object schema with `additionalProperties: false` (what the API server's strict
/// field validation does with unknown fields).
pub fn validate_against_crd(python: &Path, schema: &Value, instance: &Value) -> Result<(), String> {
    const SCRIPT: &str = r#"
import json, sys, jsonschema
# By key: serde_json (without preserve_order) writes the keys sorted, instance first.
data = json.load(sys.stdin)
schema, instance = data["schema"], data["instance"]
# The API server always accepts apiVersion, kind and metadata at the root, listed or not.
props = schema.setdefault("properties", {})
props.setdefault("apiVersion", {"type": "string"})
props.setdefault("kind", {"type": "string"})
props.setdefault("metadata", {"type": "object"})
def close(s):
    if isinstance(s, dict):
        if s.get("type") == "object" and "properties" in s and "additionalProperties" not in s:
            s["additionalProperties"] = False
        for v in s.values():
            close(v)
    elif isinstance(s, list):
        for v in s:
            close(v)
close(schema)
# Kubernetes' `nullable: true` is OpenAPI, not JSON Schema: allow null where it is set.
def nullable(s):
    if isinstance(s, dict):
        if s.get("nullable") and isinstance(s.get("type"), str):
            s["type"] = [s["type"], "null"]
        for v in s.values():
            nullable(v)
    elif isinstance(s, list):
        for v in s:
            nullable(v)
nullable(schema)
errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(instance), key=str)
for e in errors:
    print("/".join(map(str, e.absolute_path)) or "<root>", ":", e.message)
sys.exit(1 if errors else 0)
"#;
    use std::io::Write;
    let mut child = Command::new(python)
        .args(["-c", SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python runs");
    let input = serde_json::json!({"schema": schema, "instance": instance});
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(input.to_string().as_bytes())
        .expect("write to python");
    let out = child.wait_with_output().expect("python finishes");
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Where the exported metric families are registered: (exposed name prefix, source file, the
/// prefix as the source registers it, whether it is prometheus-client in OpenMetrics format,
/// which appends `_total` to a counter's registered name). Longest prefix first: the profile
/// controller's metrics are registered by memguard-learn under `profile` inside the webhook's
/// `memguard_webhook` registry.
pub const METRIC_SOURCES: &[(&str, &str, &str, bool)] = &[
    (
        "memguard_webhook_profile_",
        "learn/src/metrics.rs",
        "profile",
        true,
    ),
    (
        "memguard_webhook_",
        "webhook/src/metrics.rs",
        "memguard_webhook",
        true,
    ),
    (
        "memguard_sidecar_",
        "sidecar/src/metrics.rs",
        "memguard_sidecar",
        false,
    ),
];

/// The `memguard_*` metric names in a PromQL expression (or any text), with a histogram's
/// `_bucket`/`_sum`/`_count` suffix removed. Recording-rule names (`memguard:…`) are not metrics
/// the binaries export and are not returned.
pub fn metric_names_in(text: &str) -> std::collections::BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with("memguard_") && !t.contains(':'))
        .map(|t| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| t.strip_suffix(s))
                .unwrap_or(t)
                .to_string()
        })
        .collect()
}

/// Whether `source` registers a family `name`: the quoted name is the first argument of a
/// `register(` (prometheus-client) or of the sidecar's `gauge(`, `counter(` or `family(`. A mere
/// mention (a label value such as `"oom_kill"`, a comment) does not count.
fn registers(source: &str, name: &str) -> bool {
    let quoted = format!("\"{name}\"");
    source.match_indices(&quoted).any(|(i, _)| {
        source[..i]
            .trim_end()
            .strip_suffix('(')
            .is_some_and(|before| {
                ["register", "gauge", "counter", "family"]
                    .iter()
                    .any(|f| before.ends_with(f))
            })
    })
}

/// Panics unless every name in `metrics` is registered by the code that exports it (a source
/// check of `webhook/src/metrics.rs`, `learn/src/metrics.rs` and `sidecar/src/metrics.rs`: the
/// binaries are not run). A counter registered as `foo` is exposed as `foo_total` (OpenMetrics,
/// prometheus-client); the sidecar writes its names whole. `user` names the reader, for messages.
pub fn assert_metrics_registered<'a>(metrics: impl IntoIterator<Item = &'a str>, user: &str) {
    let mut unknown = Vec::new();
    for metric in metrics {
        let Some((prefix, file, registered_prefix, openmetrics)) = METRIC_SOURCES
            .iter()
            .find(|(prefix, ..)| metric.starts_with(prefix))
        else {
            unknown.push(format!("{metric} (no memguard binary exports this prefix)"));
            continue;
        };
        let source = std::fs::read_to_string(workspace_root().join(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(
            source.contains(&format!("\"{registered_prefix}\"")),
            "{file} does not register the {prefix} prefix"
        );
        let name = &metric[prefix.len()..];
        let counter = name.strip_suffix("_total").filter(|_| *openmetrics);
        if !registers(&source, name) && !counter.is_some_and(|base| registers(&source, base)) {
            unknown.push(format!("{metric} (not registered in {file})"));
        }
    }
    assert!(
        unknown.is_empty(),
        "{user} reads metrics no memguard binary exports: {unknown:?}"
    );
}

/// Validates a rendered `monitoring.coreos.com/v1` `PrometheusRule` with python's jsonschema:
/// no schema for the Prometheus Operator's CRDs is available offline, so this is the v1 API's
/// shape as its reference documents it (`spec.groups[]`: `name`, `interval`, `limit`,
/// `partial_response_strategy`, `query_offset`, `labels`, `rules[]`: `alert` or `record`, `expr`,
/// `for`, `keep_firing_for`, `labels`, `annotations`), closed against unknown fields like the
/// API server's strict field validation, plus the object metadata the chart sets.
pub fn validate_prometheus_rule(python: &Path, doc: &Value) -> Result<(), String> {
    use serde_json::json;
    let duration = json!({
        "type": "string",
        "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
    });
    let strings = json!({"type": "object", "additionalProperties": {"type": "string"}});
    let dns_subdomain = json!({
        "type": "string",
        "maxLength": 253,
        "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
    });
    let rule = json!({
        "type": "object",
        "required": ["expr"],
        "oneOf": [
            {"required": ["alert"], "not": {"required": ["record"]}},
            {"required": ["record"], "not": {"anyOf": [
                {"required": ["alert"]}, {"required": ["annotations"]}, {"required": ["for"]}
            ]}}
        ],
        "properties": {
            "alert": {"type": "string", "minLength": 1},
            "record": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
            "expr": {"type": ["string", "integer"]},
            "for": duration,
            "keep_firing_for": duration,
            "labels": strings,
            "annotations": strings
        }
    });
    let schema = json!({
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": {
                "type": "object",
                "required": ["name", "namespace"],
                "properties": {
                    "name": dns_subdomain,
                    "namespace": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                    "labels": strings,
                    "annotations": strings
                }
            },
            "spec": {
                "type": "object",
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "interval": duration,
                                "query_offset": duration,
                                "limit": {"type": "integer"},
                                "partial_response_strategy": {"type": "string"},
                                "labels": strings,
                                "rules": {"type": "array", "items": rule}
                            }
                        }
                    }
                }
            }
        }
    });
    validate_against_crd(python, &schema, doc)?;
    // `groups` is a list map keyed by `name`: the API server rejects duplicates.
    let mut names = std::collections::BTreeSet::new();
    for group in doc["spec"]["groups"].as_array().into_iter().flatten() {
        let name = group["name"].as_str().unwrap_or_default();
        if !names.insert(name) {
            return Err(format!("spec/groups: duplicate group name {name:?}"));
        }
    }
    Ok(())
}
