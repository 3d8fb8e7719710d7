//! The DRA objects memguard reads (`resource.k8s.io/v1`), through their own narrow types: only
//! the fields read, so memguard does not depend on a k8s-openapi version that ships
//! `resource.k8s.io/v1`, and an object with fields this version does not know still reads.

use serde::Deserialize;
use std::collections::BTreeMap;

/// Object name and namespace.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    /// `metadata.name`.
    #[serde(default)]
    pub name: String,
    /// `metadata.namespace` (claims and templates).
    #[serde(default)]
    pub namespace: Option<String>,
}

/// A CEL selector (`{cel: {expression}}`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Selector {
    /// The CEL expression, when the selector is one.
    #[serde(default)]
    pub cel: Option<Cel>,
}

/// `selectors[].cel`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Cel {
    /// The expression.
    #[serde(default)]
    pub expression: String,
}

/// One way to satisfy a request: `exactly`, or one of `firstAvailable`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Alternative {
    /// The subrequest's name (`firstAvailable`).
    #[serde(default)]
    pub name: Option<String>,
    /// The DeviceClass.
    #[serde(default)]
    pub device_class_name: String,
    /// The request's own selectors.
    #[serde(default)]
    pub selectors: Vec<Selector>,
}

/// `spec.devices.requests[]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceRequest {
    /// The request's name.
    #[serde(default)]
    pub name: String,
    /// One kind of device.
    #[serde(default)]
    pub exactly: Option<Alternative>,
    /// Alternatives in order of preference: the scheduler takes the first it can allocate.
    #[serde(default)]
    pub first_available: Vec<Alternative>,
}

/// `spec.devices`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct DeviceClaim {
    /// The requests.
    #[serde(default)]
    pub requests: Vec<DeviceRequest>,
}

/// A ResourceClaim's (or its template's) spec.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ClaimSpec {
    /// The devices asked for.
    #[serde(default)]
    pub devices: Option<DeviceClaim>,
}

/// `status.allocation.devices.results[]`: one allocated device.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct AllocationResult {
    /// The request it satisfies.
    #[serde(default)]
    pub request: String,
    /// Its driver.
    #[serde(default)]
    pub driver: String,
    /// Its pool (usually the node).
    #[serde(default)]
    pub pool: String,
    /// Its name in the pool's ResourceSlices.
    #[serde(default)]
    pub device: String,
}

/// `status.allocation.devices`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct AllocatedDevices {
    /// The devices.
    #[serde(default)]
    pub results: Vec<AllocationResult>,
}

/// `status.allocation`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Allocation {
    /// The devices.
    #[serde(default)]
    pub devices: Option<AllocatedDevices>,
}

/// `status` of a ResourceClaim.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ClaimStatus {
    /// Set once the scheduler allocated the claim.
    #[serde(default)]
    pub allocation: Option<Allocation>,
}

/// A ResourceClaim (the fields read).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ResourceClaim {
    /// Name and namespace.
    #[serde(default)]
    pub metadata: Meta,
    /// The requests.
    #[serde(default)]
    pub spec: ClaimSpec,
    /// The allocation, when made.
    #[serde(default)]
    pub status: Option<ClaimStatus>,
}

/// `spec` of a ResourceClaimTemplate: the claim to create.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct TemplateSpec {
    /// The claim's spec.
    #[serde(default)]
    pub spec: ClaimSpec,
}

/// A ResourceClaimTemplate (the fields read).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ResourceClaimTemplate {
    /// Name and namespace.
    #[serde(default)]
    pub metadata: Meta,
    /// The claim it creates.
    #[serde(default)]
    pub spec: TemplateSpec,
}

/// `spec` of a DeviceClass.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct DeviceClassSpec {
    /// Which devices are in the class.
    #[serde(default)]
    pub selectors: Vec<Selector>,
}

/// A DeviceClass (the fields read).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct DeviceClass {
    /// Name.
    #[serde(default)]
    pub metadata: Meta,
    /// Selectors.
    #[serde(default)]
    pub spec: DeviceClassSpec,
}

/// A typed attribute value; only strings are read.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Attribute {
    /// `string`.
    #[serde(default)]
    pub string: Option<String>,
}

/// A capacity (`{value: <quantity>}`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Capacity {
    /// The quantity, as written.
    #[serde(default)]
    pub value: String,
}

/// One device in a ResourceSlice.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct SliceDevice {
    /// Its name in the pool.
    #[serde(default)]
    pub name: String,
    /// Attributes (`productName`, …).
    #[serde(default)]
    pub attributes: BTreeMap<String, Attribute>,
    /// Capacities (`memory`, …).
    #[serde(default)]
    pub capacity: BTreeMap<String, Capacity>,
}

/// `spec.pool`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Pool {
    /// The pool's name.
    #[serde(default)]
    pub name: String,
}

/// `spec` of a ResourceSlice.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceSpec {
    /// The driver publishing it.
    #[serde(default)]
    pub driver: String,
    /// Its pool.
    #[serde(default)]
    pub pool: Pool,
    /// The node, for node-local pools.
    #[serde(default)]
    pub node_name: Option<String>,
    /// The devices.
    #[serde(default)]
    pub devices: Vec<SliceDevice>,
}

/// A ResourceSlice (the fields read).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ResourceSlice {
    /// Name.
    #[serde(default)]
    pub metadata: Meta,
    /// Driver, pool, devices.
    #[serde(default)]
    pub spec: SliceSpec,
}
