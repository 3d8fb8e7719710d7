//! Reading the trainer's claims: the memory of the device each one gets, and the device its
//! driver runs.

use super::catalog::DraCatalog;
use super::objects::{AllocationResult, Alternative, DeviceClass, ResourceSlice, SliceDevice};
use super::{AMD_DRIVER, MEMORY_CAPACITY, NVIDIA_DRIVER, PRODUCT_ATTRIBUTE};
use crate::Policy;
use crate::pod::parse_quantity;
use memguard_estimator::{Bytes, Device};

/// The memory of the trainer's DRA devices: the smallest of them.
#[derive(Debug, Clone, PartialEq)]
pub struct DraMemory {
    /// Memory of one device.
    pub bytes: Bytes,
    /// The device kind its driver runs (`cuda` for NVIDIA's, `rocm` for AMD's).
    pub device: Device,
    /// What it rests on, for `budgetSource` (`dra`).
    pub detail: String,
}

/// What the claims give: the memory when every claim the trainer uses was sized, and the
/// warnings on the way (each names what is missing).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraReading {
    /// `None` when the trainer uses no claim, or when one of them could not be sized (then
    /// the smallest known device would overstate what the unsized one has).
    pub memory: Option<DraMemory>,
    /// Warnings, unprefixed and untruncated.
    pub warnings: Vec<String>,
}

impl DraReading {
    /// The device the trainer runs on, and the DRA memory that counts for it: the claims'
    /// driver names the device when nothing else does (`device` is `cpu` and was not given),
    /// and their memory counts only for a pod on that device (a pod made `cpu` by annotation
    /// keeps its memory limit). Admission and `memguard estimate` both decide with this.
    pub fn on(&self, device: Device, device_given: bool) -> (Device, Option<&DraMemory>) {
        let Some(m) = &self.memory else {
            return (device, None);
        };
        let device = if !device_given && device == Device::Cpu {
            m.device
        } else {
            device
        };
        (device, (m.device == device).then_some(m))
    }
}

/// One pod claim the trainer uses: its name, and where its spec comes from.
struct PodClaim<'a> {
    name: &'a str,
    template: Option<&'a str>,
    claim: Option<&'a str>,
}

fn pod_claims<'a>(
    pod: &'a k8s_openapi::api::core::v1::Pod,
    trainer: &'a k8s_openapi::api::core::v1::Container,
) -> Vec<PodClaim<'a>> {
    crate::pod::trainer_claims(pod, trainer)
        .map(|c| PodClaim {
            name: &c.name,
            template: c.resource_claim_template_name.as_deref(),
            claim: c.resource_claim_name.as_deref(),
        })
        .collect()
}

/// The memory of the devices the trainer's claims get, from `catalog`; `None` without a
/// catalog (then every claim is a warning).
pub fn read(
    pod: &k8s_openapi::api::core::v1::Pod,
    trainer: &k8s_openapi::api::core::v1::Container,
    catalog: Option<&dyn DraCatalog>,
    policy: &Policy,
) -> DraReading {
    let claims = pod_claims(pod, trainer);
    let mut out = DraReading::default();
    if claims.is_empty() {
        return out;
    }
    let label = |c: &PodClaim| match (c.template, c.claim) {
        (Some(t), _) => format!("DRA claim {} (template {t})", c.name),
        (None, Some(n)) => format!("DRA claim {} (claim {n})", c.name),
        (None, None) => format!("DRA claim {} (no source)", c.name),
    };
    let why_not = match catalog {
        None => Some("no DRA catalog: cluster link off".to_string()),
        Some(c) => c.unavailable(),
    };
    let catalog = match (catalog, why_not) {
        (Some(c), None) => c,
        (_, why) => {
            let names: Vec<String> = claims.iter().map(label).collect();
            out.warnings.push(format!(
                "{}: device memory unknown ({})",
                names.join(", "),
                why.unwrap_or_default()
            ));
            return out;
        }
    };
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut sized: Vec<DraMemory> = Vec::new();
    let mut all = true;
    for claim in &claims {
        let name = label(claim);
        match claim_memory(claim, namespace, catalog, policy, &mut out.warnings) {
            Ok(m) => sized.push(m),
            Err(missing) => {
                all = false;
                out.warnings
                    .push(format!("{name}: device memory unknown ({missing})"));
            }
        }
    }
    if all {
        out.memory = sized.into_iter().min_by_key(|m| m.bytes);
    }
    out
}

fn claim_memory(
    claim: &PodClaim,
    namespace: &str,
    catalog: &dyn DraCatalog,
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> Result<DraMemory, String> {
    let spec = match (claim.template, claim.claim) {
        (Some(t), _) => {
            catalog
                .claim_template(namespace, t)
                .ok_or_else(|| format!("ResourceClaimTemplate {namespace}/{t} not found"))?
                .spec
                .spec
        }
        (None, Some(n)) => {
            let found = catalog
                .claim(namespace, n)
                .ok_or_else(|| format!("ResourceClaim {namespace}/{n} not found"))?;
            let allocated = found
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .map(|d| d.results.as_slice())
                .unwrap_or_default();
            if !allocated.is_empty() {
                return allocated_memory(allocated, catalog, policy);
            }
            found.spec
        }
        (None, None) => return Err("the pod claim names no template and no claim".into()),
    };
    let requests = spec.devices.map(|d| d.requests).unwrap_or_default();
    if requests.is_empty() {
        return Err("the claim requests no device".into());
    }
    let mut smallest: Option<DraMemory> = None;
    for request in &requests {
        // Any alternative may be the one allocated: the smallest of them is what is sure.
        let alternatives: Vec<&Alternative> = request
            .exactly
            .iter()
            .chain(request.first_available.iter())
            .collect();
        if alternatives.is_empty() {
            return Err(format!("request {} has no device class", request.name));
        }
        for alt in alternatives {
            let m = class_memory(alt, catalog, policy, warnings)?;
            if smallest.as_ref().is_none_or(|s| m.bytes < s.bytes) {
                smallest = Some(m);
            }
        }
    }
    smallest.ok_or_else(|| "no request sized".into())
}

/// The driver a DeviceClass selects: its `device.driver == "<name>"` selector.
pub fn class_driver(class: &DeviceClass) -> Option<String> {
    class.spec.selectors.iter().find_map(|s| {
        let e = s.cel.as_ref()?.expression.as_str();
        driver_equality(e)
    })
}

/// The driver an expression requires: a `device.driver == "x"` conjunct.
fn driver_equality(expression: &str) -> Option<String> {
    terms(expression).0.into_iter().find_map(|t| match t {
        Term::Driver(d) => Some(d),
        Term::Attribute { .. } => None,
    })
}

/// One condition of a selector memguard evaluates: `device.driver == "x"` or a string
/// attribute's equality, `device.attributes["<domain>"].<name> == "v"`.
#[derive(Debug, Clone, PartialEq)]
enum Term {
    Driver(String),
    Attribute {
        domain: String,
        name: String,
        value: String,
    },
}

fn unquote(v: &str) -> Option<&str> {
    let v = v.trim();
    v.strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .or_else(|| v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
}

fn term(conjunct: &str) -> Option<Term> {
    let (l, r) = conjunct.split_once("==")?;
    let (l, value) = (l.trim(), unquote(r)?.to_string());
    if l == "device.driver" {
        return Some(Term::Driver(value));
    }
    let rest = l.strip_prefix("device.attributes[")?;
    let (domain, name) = rest.split_once("].")?;
    let name = name.trim();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return None;
    }
    Some(Term::Attribute {
        domain: unquote(domain)?.to_string(),
        name: name.to_string(),
        value,
    })
}

/// The conditions memguard evaluates in `expression`, and whether any part was left out: a
/// conjunction of equalities is read; anything else (`||`, negation, capacity comparisons,
/// functions) is not guessed at.
fn terms(expression: &str) -> (Vec<Term>, bool) {
    if expression.contains("||") {
        return (Vec::new(), true);
    }
    let mut out = Vec::new();
    let mut skipped = false;
    for conjunct in expression.split("&&") {
        match term(conjunct) {
            Some(t) => out.push(t),
            None => skipped = true,
        }
    }
    (out, skipped)
}

/// Whether `device` of `driver` meets `t`. An attribute is named unqualified (its driver's
/// domain) or `<domain>/<name>` in the slice.
fn meets(t: &Term, driver: &str, device: &SliceDevice) -> bool {
    match t {
        Term::Driver(d) => d == driver,
        Term::Attribute {
            domain,
            name,
            value,
        } => {
            let qualified = device.attributes.get(&format!("{domain}/{name}"));
            let local = (domain == driver)
                .then(|| device.attributes.get(name))
                .flatten();
            qualified
                .or(local)
                .and_then(|a| a.string.as_deref())
                .is_some_and(|v| v == value)
        }
    }
}

fn class_memory(
    alt: &Alternative,
    catalog: &dyn DraCatalog,
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> Result<DraMemory, String> {
    let class_name = &alt.device_class_name;
    let class = catalog
        .device_class(class_name)
        .ok_or_else(|| format!("DeviceClass {class_name} not found"))?;
    let driver = class_driver(&class).ok_or_else(|| {
        format!("DeviceClass {class_name} names no driver (device.driver == \"…\")")
    })?;
    let device = driver_device(&driver)
        .ok_or_else(|| format!("driver {driver} is no GPU driver memguard knows"))?;
    let mut conditions = Vec::new();
    let mut unevaluated = 0;
    for s in class.spec.selectors.iter().chain(alt.selectors.iter()) {
        let Some(cel) = &s.cel else { continue };
        let (t, skipped) = terms(&cel.expression);
        conditions.extend(t);
        unevaluated += usize::from(skipped);
    }
    let slices = catalog.slices(&driver);
    if slices.is_empty() {
        return Err(format!("no ResourceSlice of driver {driver}"));
    }
    let devices: Vec<(&ResourceSlice, &SliceDevice, Bytes)> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().map(move |d| (s, d)))
        .filter(|(_, d)| conditions.iter().all(|t| meets(t, &driver, d)))
        .filter_map(|(s, d)| device_capacity(d, &driver).map(|b| (s, d, b)))
        .collect();
    let Some((slice, dev, bytes)) = devices.iter().min_by_key(|(_, _, b)| *b) else {
        return Err(format!(
            "no {driver} device matching DeviceClass {class_name} publishes `{MEMORY_CAPACITY}`"
        ));
    };
    if unevaluated > 0 {
        warnings.push(format!(
            "{class_name}: {unevaluated} CEL selector(s) not evaluated; smallest {driver} device taken"
        ));
    }
    let (bytes, note) = usable(dev, *bytes, policy);
    Ok(DraMemory {
        bytes,
        device,
        detail: format!(
            "class {class_name}: smallest of {}, {}/{}{note}",
            devices.len(),
            slice.spec.pool.name,
            dev.name
        ),
    })
}

fn allocated_memory(
    results: &[AllocationResult],
    catalog: &dyn DraCatalog,
    policy: &Policy,
) -> Result<DraMemory, String> {
    let mut smallest: Option<DraMemory> = None;
    for r in results {
        let device = driver_device(&r.driver)
            .ok_or_else(|| format!("driver {} is no GPU driver memguard knows", r.driver))?;
        let slices = catalog.slices(&r.driver);
        let found = slices
            .iter()
            .filter(|s| s.spec.pool.name == r.pool)
            .flat_map(|s| s.spec.devices.iter())
            .find(|d| d.name == r.device)
            .ok_or_else(|| {
                format!(
                    "allocated device {}/{} not in the ResourceSlices of {}",
                    r.pool, r.device, r.driver
                )
            })?;
        let capacity = device_capacity(found, &r.driver).ok_or_else(|| {
            format!(
                "allocated device {}/{} publishes no `{MEMORY_CAPACITY}` capacity",
                r.pool, r.device
            )
        })?;
        let (bytes, note) = usable(found, capacity, policy);
        if smallest.as_ref().is_none_or(|s| bytes < s.bytes) {
            smallest = Some(DraMemory {
                bytes,
                device,
                detail: format!("allocated {}/{}{note}", r.pool, r.device),
            });
        }
    }
    smallest.ok_or_else(|| "the allocation lists no device".into())
}

/// `cuda` for NVIDIA's driver, `rocm` for AMD's.
pub fn driver_device(driver: &str) -> Option<Device> {
    match driver {
        NVIDIA_DRIVER => Some(Device::Cuda),
        AMD_DRIVER => Some(Device::Rocm),
        _ => None,
    }
}

/// The device's `memory` capacity (unqualified, or qualified by its driver's domain).
fn device_capacity(d: &SliceDevice, driver: &str) -> Option<Bytes> {
    let qualified = format!("{driver}/{MEMORY_CAPACITY}");
    d.capacity
        .get(MEMORY_CAPACITY)
        .or_else(|| d.capacity.get(&qualified))
        .and_then(|c| parse_quantity(&c.value))
        .filter(|b| *b > 0)
        .map(Bytes)
}

/// The capacity, or the policy's usable figure for the device's product when that is
/// smaller: the table holds what NVML reports as usable, which a driver's capacity need not
/// (a driver may publish the nominal size). Never more than the capacity: the device cannot
/// give more than its driver says it has.
fn usable(d: &SliceDevice, capacity: Bytes, policy: &Policy) -> (Bytes, String) {
    let product = d
        .attributes
        .get(PRODUCT_ATTRIBUTE)
        .or_else(|| {
            d.attributes
                .get(&format!("{NVIDIA_DRIVER}/{PRODUCT_ATTRIBUTE}"))
        })
        .and_then(|a| a.string.as_deref());
    // NVML names products with spaces; GPU feature discovery's labels (the table's keys)
    // replace them with dashes.
    let key = product.map(|p| p.trim().replace(' ', "-"));
    match key
        .as_deref()
        .and_then(|k| policy.gpu_memory.get(k).map(|b| (k, *b)))
    {
        Some((k, table)) if table < capacity => (table, format!(", table {k}")),
        _ => (capacity, String::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_read_equalities_only() {
        assert_eq!(
            driver_equality("device.driver == \"gpu.nvidia.com\""),
            Some("gpu.nvidia.com".into())
        );
        assert_eq!(
            terms("device.driver == 'a' && device.attributes['a'].type == 'gpu'"),
            (
                vec![
                    Term::Driver("a".into()),
                    Term::Attribute {
                        domain: "a".into(),
                        name: "type".into(),
                        value: "gpu".into()
                    }
                ],
                false
            )
        );
        assert!(terms("device.driver == 'a' || device.driver == 'b'").1);
        assert!(terms("device.attributes['a'].count == 2").1, "not a string");
        assert!(terms("!(device.driver == 'a')").1);
    }
}
