//! One AdmissionReview in, one out: parse, decide, patch, answer. Pure and synchronous; the
//! server only adds HTTP, logs and metrics around it.
//!
//! The answer is `allowed: true`, always. What went wrong travels as warnings and, when the pod
//! can still be annotated, as `memguard.io/error`.

use crate::mutate::{self, ClusterView, Outcome};
use crate::patch;
use base64::Engine;
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview, Operation};
use memguard_api::Policy;
use serde::Serialize;
use std::panic::AssertUnwindSafe;

/// The warning of a review that hit a bug in memguard (a panic).
pub const INTERNAL_ERROR: &str =
    "memguard: internal error; pod admitted unchanged (see the webhook's logs)";

/// How one review ended, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// A non-empty patch was returned.
    Mutated,
    /// Nothing to change (not opted in, not a CREATE, or already mutated).
    Unchanged,
    /// Opted in but unusable: admitted with `memguard.io/error`.
    Skipped,
    /// Opted in, its config not read: the sidecar and client injected, nothing planned.
    Guarded,
    /// memguard's own failure (an object that is not a Pod, …): admitted as is.
    Error,
}

impl Disposition {
    /// The `outcome` label value of the requests metric.
    pub const fn label(self) -> &'static str {
        match self {
            Disposition::Mutated => "mutated",
            Disposition::Unchanged => "unchanged",
            Disposition::Skipped => "skipped",
            Disposition::Guarded => "guarded",
            Disposition::Error => "error",
        }
    }
}

/// The AdmissionReview sent back. Requests are parsed with kube's types; the answer is written
/// here so that the patch is base64, as the API documents (`[]byte`), rather than the array of
/// numbers kube's `Vec<u8>` serializes to: a third of the size, and the canonical form.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReviewResponse {
    /// Echoes the request's (`admission.k8s.io/v1`).
    pub api_version: String,
    /// `AdmissionReview`.
    pub kind: String,
    /// The response.
    pub response: Response,
}

/// `AdmissionReview.response`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Response {
    /// The request's uid.
    pub uid: String,
    /// Always true: memguard never refuses a pod.
    pub allowed: bool,
    /// Base64 of the JSON patch, when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// `JSONPatch` when there is a patch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<&'static str>,
    /// Warnings shown to the client (each ≤ 120 characters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warnings: Option<Vec<String>>,
}

/// The answer to one AdmissionReview.
#[derive(Debug)]
pub struct Reviewed {
    /// The AdmissionReview to send back.
    pub review: ReviewResponse,
    /// How it ended.
    pub disposition: Disposition,
    /// Downgrade steps applied by the plan (0 unless mutated).
    pub steps: usize,
    /// `namespace/name` (or `generateName`) of the pod, for logs.
    pub pod: String,
    /// Warnings returned.
    pub warnings: Vec<String>,
}

/// The body is not an AdmissionReview with a request (HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON, or not shaped like an AdmissionReview.
    #[error("not an AdmissionReview: {0}")]
    Malformed(#[from] serde_json::Error),
    /// An AdmissionReview without `request`.
    #[error("AdmissionReview has no request")]
    NoRequest,
}

/// Answers one AdmissionReview body.
///
/// The fast path parses the request with its object as a typed `Pod` in one pass. Only when
/// that fails is the body parsed again generically, to tell "not an AdmissionReview" (an error,
/// HTTP 400) from "an AdmissionReview whose object is not a valid Pod" (allowed, with a warning).
pub fn review(
    body: &[u8],
    policy: &Policy,
    profiles: &ClusterView,
) -> Result<Reviewed, ReviewError> {
    if let Ok(review) = serde_json::from_slice::<AdmissionReview<Pod>>(body) {
        let request: AdmissionRequest<Pod> =
            review.try_into().map_err(|_| ReviewError::NoRequest)?;
        return Ok(answer(
            &request,
            Ok(request.object.as_ref()),
            policy,
            profiles,
        ));
    }
    let review: AdmissionReview<DynamicObject> = serde_json::from_slice(body)?;
    let request: AdmissionRequest<DynamicObject> =
        review.try_into().map_err(|_| ReviewError::NoRequest)?;
    let pod: Result<Option<Pod>, String> = match &request.object {
        None => Ok(None),
        Some(object) => serde_json::to_value(object)
            .and_then(serde_json::from_value::<Pod>)
            .map(Some)
            .map_err(|e| e.to_string()),
    };
    let pod = pod.as_ref().map(Option::as_ref).map_err(Clone::clone);
    Ok(answer(&request, pod, policy, profiles))
}

/// The warning of a review answered while the webhook is not ready (its policy is invalid):
/// the pod is admitted as it is, unguarded.
pub const NOT_READY: &str =
    "memguard: webhook not ready (invalid policy); pod admitted unchanged, unguarded";

/// Answers one AdmissionReview body without deciding anything: allowed, unchanged, with
/// `warning` for a pod being created. What the webhook answers while it has no valid policy
/// (the API server should not be calling it then: it is not ready; a request that still comes
/// is never refused, as with `failurePolicy: Ignore`).
pub fn admit_unchanged(body: &[u8], warning: &str) -> Result<Reviewed, ReviewError> {
    let review: AdmissionReview<DynamicObject> = serde_json::from_slice(body)?;
    let request: AdmissionRequest<DynamicObject> =
        review.try_into().map_err(|_| ReviewError::NoRequest)?;
    let pod_name = match &request.namespace {
        Some(ns) => format!("{ns}/{}", request.name),
        None => request.name.clone(),
    };
    let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
    let warnings = if is_pod && request.operation == Operation::Create {
        vec![mutate::truncate(warning)]
    } else {
        Vec::new()
    };
    Ok(Reviewed {
        review: ReviewResponse {
            api_version: if request.types.api_version.is_empty() {
                "admission.k8s.io/v1".into()
            } else {
                request.types.api_version.clone()
            },
            kind: "AdmissionReview".into(),
            response: Response {
                uid: request.uid.clone(),
                allowed: true,
                patch: None,
                patch_type: None,
                warnings: (!warnings.is_empty()).then(|| warnings.clone()),
            },
        },
        disposition: Disposition::Error,
        steps: 0,
        pod: pod_name,
        warnings,
    })
}

fn answer<T: kube::Resource>(
    request: &AdmissionRequest<T>,
    pod: Result<Option<&Pod>, String>,
    policy: &Policy,
    profiles: &ClusterView,
) -> Reviewed {
    let pod_name = match &request.namespace {
        Some(ns) => format!("{ns}/{}", request.name),
        None => request.name.clone(),
    };
    let done = |patch: Option<String>, disposition, steps, warnings: Vec<String>| Reviewed {
        review: ReviewResponse {
            api_version: if request.types.api_version.is_empty() {
                "admission.k8s.io/v1".into()
            } else {
                request.types.api_version.clone()
            },
            kind: "AdmissionReview".into(),
            response: Response {
                uid: request.uid.clone(),
                allowed: true,
                patch_type: patch.as_ref().map(|_| "JSONPatch"),
                patch,
                warnings: (!warnings.is_empty()).then(|| warnings.clone()),
            },
        },
        disposition,
        steps,
        pod: pod_name.clone(),
        warnings,
    };
    let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
    if request.operation != Operation::Create || !is_pod || request.sub_resource.is_some() {
        return done(None, Disposition::Unchanged, 0, Vec::new());
    }
    let pod = match pod {
        Ok(Some(pod)) => pod,
        Ok(None) => return done(None, Disposition::Unchanged, 0, Vec::new()),
        Err(e) => {
            let warning = mutate::truncate(&format!("memguard: object is not a valid Pod: {e}"));
            return done(None, Disposition::Error, 0, vec![warning]);
        }
    };

    // A pod being created often has no namespace yet: the request carries it, and profiles
    // are looked up in it.
    let in_namespace;
    let decided_on = match (&pod.metadata.namespace, &request.namespace) {
        (None, Some(ns)) => {
            let mut p = pod.clone();
            p.metadata.namespace = Some(ns.clone());
            in_namespace = p;
            &in_namespace
        }
        _ => pod,
    };
    // A bug of ours must cost neither the pod its admission nor the replica its other requests:
    // a panic is answered like any other memguard failure (allowed, unchanged, with a warning).
    let decided = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let outcome = mutate::mutate(decided_on, policy, profiles);
        let patch = patch::build(pod, &outcome);
        (outcome, patch)
    }));
    let Ok((outcome, patch)) = decided else {
        tracing::error!(pod = %pod_name, "memguard panicked while deciding; admitted unchanged");
        return done(None, Disposition::Error, 0, vec![INTERNAL_ERROR.into()]);
    };
    let (disposition, steps, warnings) = match &outcome {
        Outcome::Unchanged => (Disposition::Unchanged, 0, Vec::new()),
        Outcome::Skipped { warning, .. } => (Disposition::Skipped, 0, vec![warning.clone()]),
        Outcome::Mutated(m) if patch.0.is_empty() => {
            (Disposition::Unchanged, 0, m.warnings.clone())
        }
        Outcome::Mutated(m) => (Disposition::Mutated, m.steps(), m.warnings.clone()),
        Outcome::Guarded(g) if patch.0.is_empty() => {
            (Disposition::Unchanged, 0, g.warnings.clone())
        }
        Outcome::Guarded(g) => (Disposition::Guarded, 0, g.warnings.clone()),
        Outcome::Served(s) if patch.0.is_empty() => (Disposition::Unchanged, 0, s.warnings.clone()),
        Outcome::Served(s) => (
            Disposition::Mutated,
            s.fit.changes.len(),
            s.warnings.clone(),
        ),
    };
    if patch.0.is_empty() {
        return done(None, disposition, steps, warnings);
    }
    match serde_json::to_vec(&patch) {
        Ok(json) => {
            let encoded = base64::engine::general_purpose::STANDARD.encode(json);
            done(Some(encoded), disposition, steps, warnings)
        }
        Err(e) => {
            let warning = mutate::truncate(&format!("memguard: could not encode the patch: {e}"));
            done(None, Disposition::Error, 0, vec![warning])
        }
    }
}
