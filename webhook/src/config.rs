//! The policy document from a file (YAML or JSON `PolicySpec`) and flags, shared by the server
//! and `memguard mutate`. Pure: callers read the file.

use memguard_api::policy::SidecarMode;
use memguard_api::{Knob, Policy, PolicySpec};

/// Flag overrides applied on top of the policy file.
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

/// Parses a policy document (YAML, of which JSON is a subset), applies `overrides`, fills the
/// defaults and checks every field. Returns every problem found.
pub fn policy_from_str(text: Option<&str>, overrides: &Overrides) -> Result<Policy, Vec<String>> {
    let mut spec: PolicySpec = match text {
        Some(t) if !t.trim().is_empty() => {
            serde_saphyr::from_str(t).map_err(|e| vec![format!("policy document: {e}")])?
        }
        _ => PolicySpec::default(),
    };
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
    let mut errors = check_env_names(&spec);
    match spec.resolved() {
        Ok(policy) if errors.is_empty() => Ok(policy),
        Ok(_) => Err(errors),
        Err(more) => {
            errors.extend(more);
            Err(errors)
        }
    }
}

/// `envNames` keys must be knobs, and values plain variable names outside `MEMGUARD_*`.
fn check_env_names(spec: &PolicySpec) -> Vec<String> {
    let mut errors = Vec::new();
    for (knob, var) in &spec.env_names {
        if !Knob::ALL.iter().any(|k| k.name() == knob) {
            let known: Vec<&str> = Knob::ALL.iter().map(|k| k.name()).collect();
            errors.push(format!(
                "envNames[{knob}]: unknown knob (expected one of: {})",
                known.join(", ")
            ));
        }
        let valid = var
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid || var.starts_with("MEMGUARD_") {
            errors.push(format!(
                "envNames[{knob}]: `{var}` is not a usable variable name"
            ));
        }
    }
    errors
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
}
