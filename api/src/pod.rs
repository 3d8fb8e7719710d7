//! Reading a pod spec the way every part of memguard must agree on: which container is the
//! trainer, how many GPUs it asks for, which GPU products the pod is pinned to, and Kubernetes
//! resource quantities. The webhook (at admission) and the profile controller (after the run)
//! both key on these answers, so they live here once.

use crate::annotations;
use crate::labels;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::collections::BTreeMap;

/// The trainer: the container `memguard.io/container` names, else the first requesting a GPU,
/// else the first. memguard's own sidecar (classic mode) is never the trainer. Returns its
/// index among `containers`.
pub fn pick_trainer<'a>(
    containers: &'a [Container],
    named: Option<&str>,
) -> Result<(usize, &'a Container), String> {
    let candidates = || {
        containers
            .iter()
            .enumerate()
            .filter(|(_, c)| c.name != labels::SIDECAR_CONTAINER)
    };
    if let Some(name) = named {
        let key = annotations::CONTAINER.trim_start_matches(annotations::PREFIX);
        return candidates()
            .find(|(_, c)| c.name == name)
            .ok_or_else(|| format!("{key}: no container named `{name}`"));
    }
    candidates()
        .find(|(_, c)| gpu_count(c) > 0)
        .or_else(|| candidates().next())
        .ok_or_else(|| "the pod has no container".to_string())
}

/// GPUs the container asks for (`limits`, else `requests`, of `nvidia.com/gpu`).
pub fn gpu_count(c: &Container) -> u64 {
    let resources = c.resources.as_ref();
    let from = |m: Option<&BTreeMap<String, Quantity>>| {
        m.and_then(|m| m.get(labels::NVIDIA_GPU_RESOURCE))
            .and_then(|q| parse_quantity(&q.0))
    };
    from(resources.and_then(|r| r.limits.as_ref()))
        .or_else(|| from(resources.and_then(|r| r.requests.as_ref())))
        .unwrap_or(0)
}

/// The `nvidia.com/gpu.product` values the pod is pinned to: the node selector's, else the
/// union of the required node-affinity terms' `In` values when every term constrains it (terms
/// are ORed: one unconstrained term means any product). Empty when unknown.
pub fn gpu_products(pod: &Pod) -> Vec<String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    if let Some(p) = spec
        .node_selector
        .as_ref()
        .and_then(|s| s.get(labels::NVIDIA_GPU_PRODUCT_LABEL))
    {
        return vec![p.clone()];
    }
    let terms = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .map(|r| r.node_selector_terms.as_slice())
        .unwrap_or_default();
    let mut products = Vec::new();
    for term in terms {
        let values: Vec<&String> = term
            .match_expressions
            .iter()
            .flatten()
            .filter(|e| e.key == labels::NVIDIA_GPU_PRODUCT_LABEL && e.operator == "In")
            .flat_map(|e| e.values.iter().flatten())
            .collect();
        if values.is_empty() {
            return Vec::new();
        }
        products.extend(values.into_iter().cloned());
    }
    products.sort();
    products.dedup();
    products
}

/// Parses a Kubernetes quantity (`64Gi`, `500M`, `1e9`, `128974848`, `2`) into base units
/// (bytes for memory, devices for GPUs), rounding milli-units up. Case matters, unlike the
/// estimator's human spellings: `m` is milli, `M` mega. `None` for anything that is not a
/// valid, non-negative quantity.
pub fn parse_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    if number.is_empty() {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    let multiplier: f64 = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        exp if exp.starts_with(['e', 'E']) => {
            let e: i32 = exp[1..].parse().ok()?;
            10f64.powi(e)
        }
        _ => return None,
    };
    let n = value * multiplier;
    if !n.is_finite() || n < 0.0 || n >= u64::MAX as f64 {
        return None;
    }
    Some(n.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_quantity_spellings_the_api_server_writes() {
        let table = [
            ("64Gi", Some(64 << 30)),
            ("500M", Some(500_000_000)),
            ("1e9", Some(1_000_000_000)),
            ("128974848", Some(128_974_848)),
            ("1.5Gi", Some(3 << 29)),
            ("2", Some(2)),
            ("1500m", Some(2)),
            ("0", Some(0)),
        ];
        for (input, expected) in table {
            assert_eq!(parse_quantity(input), expected, "{input}");
        }
    }

    #[test]
    fn rejects_what_is_not_a_quantity() {
        for bad in ["", "Gi", "64GiB", "sixty", "1e", "-1Gi", "1e400"] {
            assert_eq!(parse_quantity(bad), None, "{bad}");
        }
    }

    fn container(name: &str, gpus: Option<&str>) -> Container {
        let mut c = Container {
            name: name.into(),
            ..Default::default()
        };
        if let Some(g) = gpus {
            c.resources = Some(k8s_openapi::api::core::v1::ResourceRequirements {
                limits: Some(BTreeMap::from([(
                    labels::NVIDIA_GPU_RESOURCE.to_string(),
                    Quantity(g.into()),
                )])),
                ..Default::default()
            });
        }
        c
    }

    #[test]
    fn the_trainer_is_the_named_container_else_the_gpu_one_else_the_first_never_the_sidecar() {
        let pod = [
            container(labels::SIDECAR_CONTAINER, None),
            container("loader", None),
            container("trainer", Some("2")),
        ];
        assert_eq!(pick_trainer(&pod, None).map(|(i, _)| i), Ok(2));
        assert_eq!(pick_trainer(&pod, Some("loader")).map(|(i, _)| i), Ok(1));
        assert_eq!(pick_trainer(&pod[..2], None).map(|(i, _)| i), Ok(1));
        let missing = pick_trainer(&pod, Some("nope")).expect_err("no such container");
        assert!(missing.starts_with("container: "), "{missing}");
        assert!(pick_trainer(&pod[..1], None).is_err());
        assert_eq!(gpu_count(&pod[2]), 2);
    }
}
