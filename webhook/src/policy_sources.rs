//! The policy in force, from its sources: a document (YAML or JSON `PolicySpec`, or a whole
//! `MemguardPolicy` manifest), the watched `MemguardPolicy` and flags. Shared by the server and
//! `memguard mutate`. Pure: callers read the file and watch the cluster.
//!
//! Precedence: flags > the `MemguardPolicy` > the policy file > built-in defaults. The resource
//! replaces the file's spec as a whole; flags apply on top of whichever is in force.

use kube::Resource;
use memguard_api::crd::MemguardPolicy;
use memguard_api::policy::SidecarMode;
use memguard_api::{Policy, PolicySpec};

/// Flag overrides applied on top of the policy file or resource.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    /// `--safety-ratio`.
    pub safety_ratio: Option<f64>,
    /// `--default-gpu-memory`.
    pub default_gpu_memory: Option<String>,
    /// `--sidecar-image`.
    pub sidecar_image: Option<String>,
    /// `--sidecar-mode`.
    pub sidecar_mode: Option<SidecarMode>,
}

/// Just enough of a manifest to tell a `MemguardPolicy` from a bare `PolicySpec`.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    api_version: Option<String>,
    kind: Option<String>,
}

/// Parses a policy document (YAML, of which JSON is a subset; see [`spec_from_str`]), applies
/// `overrides`, fills the defaults and checks every field. Returns every problem found.
pub fn policy_from_str(text: Option<&str>, overrides: &Overrides) -> Result<Policy, Vec<String>> {
    let spec = spec_from_str(text)?;
    effective_policy(spec.as_ref(), None, overrides)
}

/// Parses a policy document: a `PolicySpec`, or a `MemguardPolicy` manifest (what users
/// `kubectl apply`), whose `spec` is taken. `None` when there is no document or it is blank.
pub fn spec_from_str(text: Option<&str>) -> Result<Option<PolicySpec>, Vec<String>> {
    let Some(text) = text.filter(|t| !t.trim().is_empty()) else {
        return Ok(None);
    };
    // Not a mapping at all: the PolicySpec parse below says why.
    let meta = serde_saphyr::from_str::<TypeMeta>(text).ok();
    let expected = MemguardPolicy::api_version(&());
    match meta.and_then(|m| m.kind.map(|kind| (kind, m.api_version))) {
        None => parse_spec(text, "policy document").map(Some),
        Some((kind, api_version)) if kind == MemguardPolicy::kind(&()) => {
            if api_version.as_deref() != Some(&*expected) {
                return Err(vec![format!(
                    "policy document: apiVersion `{}` of MemguardPolicy is not `{expected}`",
                    api_version.unwrap_or_default()
                )]);
            }
            let resource =
                serde_saphyr::from_str::<serde_json::Map<String, serde_json::Value>>(text)
                    .map_err(|e| vec![format!("MemguardPolicy: {}", without_snippet(&e))])?;
            let spec = resource.get("spec").cloned().unwrap_or_default();
            parse_spec(&spec.to_string(), "MemguardPolicy spec").map(Some)
        }
        Some((kind, _)) => Err(vec![format!(
            "policy document: `kind: {kind}` is not a policy; expected a PolicySpec or a \
             MemguardPolicy ({expected})"
        )]),
    }
}

/// Parses `text` as a `PolicySpec`. The parser stops at its first problem; then every
/// top-level field is parsed alone, so that each one that is wrong is listed, and the fields
/// that parse are checked too: a user fixes the file in one go.
fn parse_spec(text: &str, what: &str) -> Result<PolicySpec, Vec<String>> {
    let first = match serde_saphyr::from_str::<PolicySpec>(text) {
        Ok(spec) => return Ok(spec),
        Err(e) => format!("{what}: {}", without_snippet(&e)),
    };
    let Ok(fields) = serde_saphyr::from_str::<serde_json::Map<String, serde_json::Value>>(text)
    else {
        return Err(vec![first]);
    };
    let mut problems = Vec::new();
    let mut good = serde_json::Map::new();
    for (key, value) in fields {
        let alone = serde_json::Value::Object([(key.clone(), value.clone())].into_iter().collect());
        match serde_json::from_value::<PolicySpec>(alone) {
            Ok(_) => {
                good.insert(key, value);
            }
            Err(e) => problems.push(format!("{what}: {key}: {e}")),
        }
    }
    if problems.is_empty() {
        return Err(vec![first]);
    }
    if let Ok(spec) = serde_json::from_value::<PolicySpec>(serde_json::Value::Object(good))
        && let Err(more) = spec.resolved()
    {
        problems.extend(more);
    }
    Err(problems)
}

/// A YAML error without the parser's source snippet, which names the document `<input>`: the
/// caller names the file.
fn without_snippet(e: &impl std::fmt::Display) -> String {
    let text = e.to_string();
    let line = text.split("\n -->").next().unwrap_or_default().trim();
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

/// The policy in force: `resource` (the watched `MemguardPolicy`'s spec) when present, else
/// `file`, else the defaults; then `overrides`, then validation. Returns every problem found.
pub fn effective_policy(
    file: Option<&PolicySpec>,
    resource: Option<&PolicySpec>,
    overrides: &Overrides,
) -> Result<Policy, Vec<String>> {
    let mut spec = resource.or(file).cloned().unwrap_or_default();
    if let Some(r) = overrides.safety_ratio {
        spec.safety_ratio = Some(r);
    }
    if let Some(m) = &overrides.default_gpu_memory {
        spec.default_gpu_memory = Some(m.clone());
    }
    if overrides.sidecar_image.is_some() || overrides.sidecar_mode.is_some() {
        let mut sidecar = spec.sidecar.take().unwrap_or_default();
        if let Some(image) = &overrides.sidecar_image {
            sidecar.image = Some(image.clone());
        }
        if let Some(mode) = overrides.sidecar_mode {
            sidecar.mode = Some(mode);
        }
        spec.sidecar = Some(sidecar);
    }
    spec.resolved()
}

#[cfg(test)]
mod tests {
    use super::*;
    use memguard_estimator::Bytes;

    #[test]
    fn reads_yaml_and_applies_flag_overrides() {
        let yaml = "safetyRatio: 0.8\ngpuMemory:\n  NVIDIA-A10G: 24Gi\nsidecar:\n  image: a:1\n";
        let p = policy_from_str(Some(yaml), &Overrides::default()).expect("valid");
        assert_eq!(p.safety_ratio, 0.8);
        assert_eq!(p.gpu_memory.get("NVIDIA-A10G"), Some(&Bytes::gib(24)));
        let o = Overrides {
            safety_ratio: Some(0.7),
            sidecar_mode: Some(SidecarMode::Classic),
            ..Overrides::default()
        };
        let p = policy_from_str(Some(yaml), &o).expect("valid");
        assert_eq!(p.safety_ratio, 0.7);
        assert_eq!(p.sidecar_mode, SidecarMode::Classic);
        assert_eq!(p.sidecar_image, "a:1", "the file's image is kept");
    }

    #[test]
    fn json_is_accepted_and_nothing_means_defaults() {
        let p = policy_from_str(
            Some(r#"{"defaultGpuMemory": "40Gi"}"#),
            &Overrides::default(),
        )
        .expect("valid");
        assert_eq!(p.default_gpu_memory, Bytes::gib(40));
        assert_eq!(
            policy_from_str(None, &Overrides::default()),
            Ok(Policy::default())
        );
    }

    #[test]
    fn reports_every_problem() {
        let yaml = "safetyRatio: 2\nenvNames:\n  batch: BS\n  seq-length: MEMGUARD_X\n";
        let errors = policy_from_str(Some(yaml), &Overrides::default()).expect_err("invalid");
        assert_eq!(errors.len(), 3, "{errors:?}");
        let typo = policy_from_str(Some("safetyRatoi: 0.5"), &Overrides::default());
        assert!(typo.is_err(), "unknown fields are refused");
    }

    /// Issue 38: a policy file written by hand with `defaultGpuMemory: 24` (a YAML number) is
    /// refused with its field and the unit it most likely meant, never read as 24 bytes.
    #[test]
    fn a_yaml_size_without_a_unit_is_refused_with_the_unit_it_most_likely_meant() {
        for yaml in [
            "defaultGpuMemory: 24\n",
            "defaultGpuMemory: \"24\"\n",
            "gpuMemory:\n  NVIDIA-A10G: 22\n",
        ] {
            let errors = policy_from_str(Some(yaml), &Overrides::default()).expect_err(yaml);
            assert!(
                errors
                    .iter()
                    .any(|e| e.contains("has no unit: did you mean `2")),
                "{yaml}: {errors:?}"
            );
        }
    }

    /// What `kubectl get memguardpolicy default -o yaml` prints.
    const MANIFEST: &str = r#"
apiVersion: training.memguard.io/v1alpha1
kind: MemguardPolicy
metadata:
  name: default
  generation: 3
  creationTimestamp: "2025-01-02T03:04:05Z"
  labels: {app.kubernetes.io/name: memguard}
  managedFields:
    - manager: kubectl
      operation: Update
      apiVersion: training.memguard.io/v1alpha1
spec:
  safetyRatio: 0.75
  gpuMemory:
    NVIDIA-A10G: 22Gi
"#;

    #[test]
    fn a_memguard_policy_manifest_is_read_for_its_spec() {
        let p = policy_from_str(Some(MANIFEST), &Overrides::default()).expect("valid");
        assert_eq!(p.safety_ratio, 0.75);
        assert_eq!(p.gpu_memory.get("NVIDIA-A10G"), Some(&Bytes::gib(22)));
        let as_json = serde_json::to_string(
            &serde_saphyr::from_str::<serde_json::Value>(MANIFEST).expect("YAML"),
        )
        .expect("JSON");
        assert_eq!(
            policy_from_str(Some(&as_json), &Overrides::default()),
            Ok(p)
        );
        // The spec is still checked like a file's.
        let bad = MANIFEST.replace("0.75", "1.5");
        let errors = policy_from_str(Some(&bad), &Overrides::default()).expect_err("invalid");
        assert!(errors[0].contains("safetyRatio"), "{errors:?}");
        let typo = MANIFEST.replace("safetyRatio", "safetyRatoi");
        let errors = policy_from_str(Some(&typo), &Overrides::default()).expect_err("invalid");
        assert!(errors[0].contains("safetyRatoi"), "{errors:?}");
    }

    #[test]
    fn other_kinds_and_versions_are_refused_by_name() {
        let configmap = "apiVersion: v1\nkind: ConfigMap\ndata: {policy.yaml: ''}\n";
        let errors = policy_from_str(Some(configmap), &Overrides::default()).expect_err("no");
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].contains("`kind: ConfigMap` is not a policy"),
            "{errors:?}"
        );
        let v2 = MANIFEST.replace(
            "training.memguard.io/v1alpha1\nkind",
            "memguard.io/v2\nkind",
        );
        let errors = policy_from_str(Some(&v2), &Overrides::default()).expect_err("no");
        assert!(
            errors[0].contains("apiVersion `memguard.io/v2`"),
            "{errors:?}"
        );
        // Issue 38: the group before training.memguard.io is refused by name.
        let old_group = MANIFEST.replace(
            "training.memguard.io/v1alpha1\nkind",
            "memguard.io/v1alpha1\nkind",
        );
        let errors = policy_from_str(Some(&old_group), &Overrides::default()).expect_err("no");
        assert!(
            errors[0].contains(
                "apiVersion `memguard.io/v1alpha1` of MemguardPolicy is not \
                 `training.memguard.io/v1alpha1`"
            ),
            "{errors:?}"
        );
        assert_eq!(
            spec_from_str(Some("  \n")),
            Ok(None),
            "blank means defaults"
        );
    }

    #[test]
    fn every_problem_of_a_policy_document_is_listed_without_the_parsers_snippet() {
        let text = "safetyRatio: 2\ndefaultGpuMemry: 40Gi\nmaxOomRecoveries: many\n";
        let errors = policy_from_str(Some(text), &Overrides::default()).expect_err("invalid");
        let all = errors.join("\n");
        assert_eq!(errors.len(), 3, "{all}");
        assert!(all.contains("unknown field `defaultGpuMemry`"), "{all}");
        assert!(all.contains("maxOomRecoveries: invalid type"), "{all}");
        assert!(all.contains("safetyRatio: 2 is not in (0, 1]"), "{all}");
        assert!(!all.contains("<input>"), "{all}");
        // The same inside a MemguardPolicy.
        let manifest = format!(
            "apiVersion: training.memguard.io/v1alpha1\nkind: MemguardPolicy\nmetadata: {{name: default}}\nspec:\n{}",
            text.lines().map(|l| format!("  {l}\n")).collect::<String>()
        );
        let errors = policy_from_str(Some(&manifest), &Overrides::default()).expect_err("bad");
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[0].starts_with("MemguardPolicy spec: "), "{errors:?}");
    }

    #[test]
    fn the_resource_replaces_the_file_as_a_whole_and_flags_win_over_both() {
        let file: PolicySpec = serde_saphyr::from_str(
            "safetyRatio: 0.8\ndefaultGpuMemory: 40Gi\nsidecar: {image: file:1}\n",
        )
        .expect("spec");
        let resource: PolicySpec = serde_saphyr::from_str("safetyRatio: 0.6\n").expect("spec");
        let none = Overrides::default();
        let p = effective_policy(Some(&file), Some(&resource), &none).expect("valid");
        assert_eq!(p.safety_ratio, 0.6);
        assert_eq!(
            (p.default_gpu_memory, p.sidecar_image.as_str()),
            (Bytes::gib(80), memguard_api::policy::DEFAULT_SIDECAR_IMAGE),
            "not merged with the file: the resource's omissions take the defaults"
        );
        assert_eq!(
            effective_policy(Some(&file), None, &none).map(|p| p.safety_ratio),
            Ok(0.8)
        );
        assert_eq!(effective_policy(None, None, &none), Ok(Policy::default()));
        let flags = Overrides {
            safety_ratio: Some(0.5),
            sidecar_image: Some("flag:1".into()),
            ..Overrides::default()
        };
        let p = effective_policy(Some(&file), Some(&resource), &flags).expect("valid");
        assert_eq!((p.safety_ratio, p.sidecar_image.as_str()), (0.5, "flag:1"));
    }
}
