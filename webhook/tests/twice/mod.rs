//! Admission as the API server runs it, twice: `mutate`, the patch applied, and the patched
//! pod admitted again, which must change nothing (a reinvocation or a retry sees its own
//! output).
#![allow(dead_code)]

use k8s_openapi::api::core::v1::Pod;
use memguard_api::Policy;
use memguard_webhook::{ClusterView, Mutation, Outcome, mutate, patch};
use serde_json::Value;

/// Admits `pod` under the default policy and `view`, applies the patch, admits the result
/// again and asserts no second patch; returns the outcome and the patched pod.
pub fn admit_twice(pod: &Value, view: &ClusterView) -> (Outcome, Value) {
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let outcome = mutate(&typed, &Policy::default(), view);
    let mut applied = pod.clone();
    json_patch::patch(&mut applied, &patch::build(&typed, &outcome)).expect("applies");
    let again: Pod = serde_json::from_value(applied.clone()).expect("still a Pod");
    let second = patch::build(&again, &mutate(&again, &Policy::default(), view));
    assert!(second.0.is_empty(), "not idempotent: {second:?}");
    (outcome, applied)
}

/// [`admit_twice`] of a pod that must be mutated: its mutation and the patched pod.
pub fn admit_mutated(pod: &Value, view: &ClusterView) -> (Mutation, Value) {
    let (outcome, applied) = admit_twice(pod, view);
    let Outcome::Mutated(m) = outcome else {
        panic!("mutated: {outcome:?}")
    };
    (*m, applied)
}
