//! Where the DRA objects come from: a [`DraCatalog`] (the webhook's watch caches, or the
//! objects of a file, [`StaticCatalog`]).

use super::API_VERSION;
use super::objects::{DeviceClass, Meta, ResourceClaim, ResourceClaimTemplate, ResourceSlice};

/// A read-only view of the DRA objects: the webhook's watch caches
/// (`watch::dra`, with the `server` feature) or objects read from files ([`StaticCatalog`]). Lookups never call
/// the API.
pub trait DraCatalog: Send + Sync {
    /// Why the catalog cannot answer at all (API group not served, caches not synced, no
    /// permission); `None` when it can.
    fn unavailable(&self) -> Option<String>;
    /// The ResourceClaim `name` in `namespace`.
    fn claim(&self, namespace: &str, name: &str) -> Option<ResourceClaim>;
    /// The ResourceClaimTemplate `name` in `namespace`.
    fn claim_template(&self, namespace: &str, name: &str) -> Option<ResourceClaimTemplate>;
    /// The DeviceClass `name`.
    fn device_class(&self, name: &str) -> Option<DeviceClass>;
    /// The ResourceSlices of `driver`.
    fn slices(&self, driver: &str) -> Vec<ResourceSlice>;
}

/// DRA objects held in memory: `memguard mutate --dra`, and tests. A claim or template
/// without a namespace matches any namespace (a file written for offline use often has none).
#[derive(Debug, Clone, Default)]
pub struct StaticCatalog {
    /// Claims.
    pub claims: Vec<ResourceClaim>,
    /// Templates.
    pub templates: Vec<ResourceClaimTemplate>,
    /// Device classes.
    pub classes: Vec<DeviceClass>,
    /// Slices.
    pub slices: Vec<ResourceSlice>,
}

fn in_namespace(meta: &Meta, namespace: &str, name: &str) -> bool {
    meta.name == name && meta.namespace.as_deref().is_none_or(|n| n == namespace)
}

impl StaticCatalog {
    /// Every DRA object in a multi-document YAML (or JSON) text; an object of another kind or
    /// version is an error naming it.
    pub fn from_yaml(text: &str) -> Result<Self, String> {
        let docs: Vec<serde_json::Value> =
            serde_saphyr::from_multiple(text).map_err(|e| format!("not valid YAML: {e}"))?;
        let mut catalog = StaticCatalog::default();
        for doc in docs.into_iter().filter(|d| !d.is_null()) {
            catalog.add(doc)?;
        }
        Ok(catalog)
    }

    /// Adds one object by its `kind` (`ResourceClaim`, `ResourceClaimTemplate`, `DeviceClass`,
    /// `ResourceSlice` of `resource.k8s.io/v1`); anything else is an error naming it.
    pub fn add(&mut self, object: serde_json::Value) -> Result<(), String> {
        let kind = object["kind"].as_str().unwrap_or_default().to_string();
        let api = object["apiVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if api != API_VERSION {
            return Err(format!(
                "{kind} {name}: apiVersion `{api}`; memguard reads {API_VERSION}"
            ));
        }
        let bad = |e: serde_json::Error| format!("{kind} {name}: {e}");
        match kind.as_str() {
            "ResourceClaim" => self
                .claims
                .push(serde_json::from_value(object).map_err(bad)?),
            "ResourceClaimTemplate" => {
                self.templates
                    .push(serde_json::from_value(object).map_err(bad)?);
            }
            "DeviceClass" => self
                .classes
                .push(serde_json::from_value(object).map_err(bad)?),
            "ResourceSlice" => self
                .slices
                .push(serde_json::from_value(object).map_err(bad)?),
            other => {
                return Err(format!(
                    "`{other}` {name} is no DRA object (ResourceClaim, ResourceClaimTemplate, DeviceClass, ResourceSlice)"
                ));
            }
        }
        Ok(())
    }
}

impl DraCatalog for StaticCatalog {
    fn unavailable(&self) -> Option<String> {
        None
    }
    fn claim(&self, namespace: &str, name: &str) -> Option<ResourceClaim> {
        self.claims
            .iter()
            .find(|c| in_namespace(&c.metadata, namespace, name))
            .cloned()
    }
    fn claim_template(&self, namespace: &str, name: &str) -> Option<ResourceClaimTemplate> {
        self.templates
            .iter()
            .find(|t| in_namespace(&t.metadata, namespace, name))
            .cloned()
    }
    fn device_class(&self, name: &str) -> Option<DeviceClass> {
        self.classes
            .iter()
            .find(|c| c.metadata.name == name)
            .cloned()
    }
    fn slices(&self, driver: &str) -> Vec<ResourceSlice> {
        self.slices
            .iter()
            .filter(|s| s.spec.driver == driver)
            .cloned()
            .collect()
    }
}
