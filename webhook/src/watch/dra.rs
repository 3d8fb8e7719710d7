//! The webhook's DRA watch caches: kube reflector stores of ResourceClaim,
//! ResourceClaimTemplate, DeviceClass and ResourceSlice (`resource.k8s.io/v1`) behind
//! [`DraCatalog`]. Started beside the MemoryProfile store ([`crate::profiles`]); admission
//! reads the stores, never the API.
//!
//! A cluster that does not serve `resource.k8s.io/v1` (Kubernetes < 1.34, or DRA turned off)
//! is told once in the log and the catalog says so in each DRA pod's warning; the webhook runs
//! on. A watch that fails (no RBAC) keeps the catalog "not synced", naming the last error.

use crate::dra::{
    API_VERSION, DeviceClass, DraCatalog, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use futures::StreamExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use serde::de::DeserializeOwned;
use std::sync::{Arc, OnceLock, RwLock};
use tokio::task::JoinHandle;

/// The four kinds read, with their plurals.
const KINDS: [(&str, &str); 4] = [
    ("ResourceClaim", "resourceclaims"),
    ("ResourceClaimTemplate", "resourceclaimtemplates"),
    ("DeviceClass", "deviceclasses"),
    ("ResourceSlice", "resourceslices"),
];

/// The stores, in [`KINDS`] order.
struct Stores([(ApiResource, Store<DynamicObject>); 4]);

/// DRA objects from watch caches.
pub struct WatchCatalog {
    stores: OnceLock<Stores>,
    /// Why it cannot answer; `None` once every store synced.
    missing: RwLock<Option<String>>,
}

impl std::fmt::Debug for WatchCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchCatalog")
            .field("missing", &self.unavailable())
            .finish()
    }
}

impl WatchCatalog {
    fn new(missing: &str) -> Self {
        WatchCatalog {
            stores: OnceLock::new(),
            missing: RwLock::new(Some(missing.to_string())),
        }
    }

    fn set_missing(&self, why: Option<String>) {
        // A poisoned lock only means a writer panicked mid-assignment of an Option: the
        // value is still whole.
        let mut m = self.missing.write().unwrap_or_else(|e| e.into_inner());
        *m = why;
    }

    fn typed<T: DeserializeOwned>(object: &DynamicObject) -> Option<T> {
        // The store holds what the API server sent; a shape that does not read is no object.
        serde_json::to_value(object)
            .ok()
            .and_then(|v| serde_json::from_value(v).ok())
    }

    fn get<T: DeserializeOwned>(
        &self,
        kind: usize,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<T> {
        let (ar, store) = &self.stores.get()?.0[kind];
        let key = ObjectRef::<DynamicObject>::new_with(name, ar.clone());
        let key = match namespace {
            Some(ns) => key.within(ns),
            None => key,
        };
        store.get(&key).and_then(|o| Self::typed(&o))
    }
}

impl DraCatalog for WatchCatalog {
    fn unavailable(&self) -> Option<String> {
        self.missing
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    fn claim(&self, namespace: &str, name: &str) -> Option<ResourceClaim> {
        self.get(0, Some(namespace), name)
    }
    fn claim_template(&self, namespace: &str, name: &str) -> Option<ResourceClaimTemplate> {
        self.get(1, Some(namespace), name)
    }
    fn device_class(&self, name: &str) -> Option<DeviceClass> {
        self.get(2, None, name)
    }
    fn slices(&self, driver: &str) -> Vec<ResourceSlice> {
        let Some(stores) = self.stores.get() else {
            return Vec::new();
        };
        stores.0[3]
            .1
            .state()
            .iter()
            .filter_map(|o| Self::typed::<ResourceSlice>(o))
            .filter(|s| s.spec.driver == driver)
            .collect()
    }
}

/// Whether the API server serves `resource.k8s.io/v1`: `Ok(false)` on 404, the error else.
async fn served(client: &Client) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(API_VERSION).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Starts the DRA watches. The catalog answers "not synced" until all four stores have
/// listed once; the task logs each watch error and keeps retrying (with backoff).
pub fn start(client: Client) -> (Arc<WatchCatalog>, JoinHandle<()>) {
    let catalog = Arc::new(WatchCatalog::new("DRA watch caches not synced yet"));
    let shared = catalog.clone();
    let task = tokio::spawn(async move {
        match served(&client).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(
                    api = API_VERSION,
                    "DRA API not served (Kubernetes < 1.34?): DRA claims are admitted with a warning"
                );
                shared.set_missing(Some(format!("{API_VERSION} not served by this cluster")));
                return;
            }
            Err(error) => {
                // Discovery failing is not proof of absence: watch anyway, errors will say.
                tracing::warn!(%error, api = API_VERSION, "DRA API discovery failed; watching anyway");
            }
        }
        let mut built = Vec::new();
        let mut streams = Vec::new();
        for (kind, plural) in KINDS {
            let gvk = GroupVersionKind::gvk("resource.k8s.io", "v1", kind);
            let ar = ApiResource::from_gvk_with_plural(&gvk, plural);
            let writer = reflector::store::Writer::<DynamicObject>::new(ar.clone());
            let reader = writer.as_reader();
            let api = Api::<DynamicObject>::all_with(client.clone(), &ar);
            let watch = reflector::reflector(writer, watcher(api, watcher::Config::default()))
                .default_backoff()
                .touched_objects()
                .map(move |r| r.map(|_| ()).map_err(|e| (kind, e)));
            streams.push(watch.boxed());
            built.push((ar, reader));
        }
        let readers: Vec<Store<DynamicObject>> = built.iter().map(|(_, s)| s.clone()).collect();
        let Ok(stores) = <[(ApiResource, Store<DynamicObject>); 4]>::try_from(built) else {
            return;
        };
        let _ = shared.stores.set(Stores(stores));
        let ready = {
            let shared = shared.clone();
            async move {
                for r in &readers {
                    if r.wait_until_ready().await.is_err() {
                        return;
                    }
                }
                shared.set_missing(None);
                tracing::info!("DRA watch caches synced");
            }
        };
        let events = async {
            let mut all = futures::stream::select_all(streams);
            while let Some(item) = all.next().await {
                if let Err((kind, error)) = item {
                    tracing::warn!(%error, kind, "DRA watch error");
                    if shared.unavailable().is_some() {
                        shared.set_missing(Some(format!(
                            "DRA watch caches not synced: {kind}: {}",
                            short(&error.to_string())
                        )));
                    }
                }
            }
        };
        tokio::join!(ready, events);
    });
    (catalog, task)
}

/// An error short enough for an admission warning.
fn short(s: &str) -> String {
    s.chars().take(60).collect()
}

#[cfg(test)]
mod tests;
