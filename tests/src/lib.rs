//! Helpers for memguard's cross-crate tests: the workspace layout, the external tools the chart
//! tests drive (helm, kubernetes-validate, python's jsonschema), and multi-document YAML.
//!
//! A missing tool fails the test in CI (`CI=true`) and prints a loud SKIP elsewhere: a test never
//! passes silently without having run.
#![forbid(unsafe_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

/// Whether we run in CI, where a missing tool is a failure rather than a skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// How to install the tools, for messages.
pub const INSTALL_HINT: &str = "install them with `../shared/tools/install-helm.sh` (helm, kubectl; \
     put its output folder on PATH, in MEMGUARD_TOOLS=<dir>/.. or HELM=<dir>/helm) and \
     `pip install kubernetes-validate jsonschema`";

/// Reports a missing tool: panics in CI, prints a loud SKIP otherwise. Returns `None` so a test
/// can `let Some(helm) = … else { return };`.
pub fn missing<T>(what: &str) -> Option<T> {
    if in_ci() {
        panic!("{what} is required in CI (CI=true) but was not found; {INSTALL_HINT}");
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
schema, instance = json.load(sys.stdin).values()
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
