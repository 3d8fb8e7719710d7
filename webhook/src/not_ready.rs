//! Saying loudly that the webhook started with an invalid policy: a Kubernetes Event on its own
//! Pod, beside the failing readiness probe and the log line (`server::run`).
//!
//! The Event is the part a platform engineer sees without reading logs (`kubectl describe pod`,
//! `kubectl get events`). It is best effort: no cluster, no Pod name in the environment, or no
//! permission only costs the Event, never the start.

use crate::server::INVALID_POLICY_REASON;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use std::sync::Arc;

/// The `reportingController` of memguard's Events.
pub const REPORTER: &str = "memguard-webhook";

/// Longest `note` the API server takes (1 kB).
const MAX_NOTE: usize = 1024;

/// The webhook's own Pod, from the downward API variables the chart sets (`POD_NAME`,
/// `POD_NAMESPACE`, `POD_UID`); `None` without a name and a namespace.
pub fn own_pod(env: impl Fn(&str) -> Option<String>) -> Option<ObjectReference> {
    let name = env("POD_NAME").filter(|v| !v.is_empty())?;
    let namespace = env("POD_NAMESPACE").filter(|v| !v.is_empty())?;
    Some(ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(name),
        namespace: Some(namespace),
        // `kubectl describe pod` finds Events by the Pod's uid too.
        uid: env("POD_UID").filter(|v| !v.is_empty()),
        ..ObjectReference::default()
    })
}

/// The Warning Event for `why` (the problems, as `/readyz` says them), cut to what the API
/// server takes.
pub fn event(why: &str) -> Event {
    let mut note = format!("not ready, no pod is guarded: {why}");
    if note.len() > MAX_NOTE {
        let mut cut = MAX_NOTE - 3;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
        note.push_str("...");
    }
    Event {
        type_: EventType::Warning,
        reason: INVALID_POLICY_REASON.into(),
        note: Some(note),
        action: "LoadPolicy".into(),
        secondary: None,
    }
}

/// Posts [`event`] on `pod`.
pub async fn publish(client: Client, pod: &ObjectReference, why: &str) -> Result<(), kube::Error> {
    let reporter = Reporter {
        controller: REPORTER.into(),
        instance: pod.name.clone(),
    };
    Recorder::new(client, reporter)
        .publish(&event(why), pod)
        .await
}

/// Posts the Event from the cluster config and the environment, logging what stops it.
pub async fn publish_event(why: Arc<str>) {
    let Some(pod) = own_pod(|name| std::env::var(name).ok()) else {
        tracing::warn!("no POD_NAME/POD_NAMESPACE: the invalid policy is not posted as an Event");
        return;
    };
    let client = match Client::try_default().await {
        Ok(client) => client,
        Err(error) => {
            tracing::warn!(%error, "no Kubernetes client: the invalid policy is not posted as an Event");
            return;
        }
    };
    match publish(client, &pod, &why).await {
        Ok(()) => tracing::info!(
            reason = INVALID_POLICY_REASON,
            "Event posted on the webhook's Pod"
        ),
        Err(error) => tracing::warn!(%error, "could not post the invalid policy as an Event"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock_kube;
    use http_body_util::BodyExt;
    use hyper::StatusCode;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn the_pod_comes_from_the_downward_api_variables() {
        let pod = own_pod(env(&[
            ("POD_NAME", "memguard-webhook-abc"),
            ("POD_NAMESPACE", "memguard"),
            ("POD_UID", "u-1"),
        ]))
        .expect("named");
        assert_eq!(pod.name.as_deref(), Some("memguard-webhook-abc"));
        assert_eq!(pod.namespace.as_deref(), Some("memguard"));
        assert_eq!(pod.uid.as_deref(), Some("u-1"));
        assert_eq!(pod.kind.as_deref(), Some("Pod"));
        assert_eq!(own_pod(env(&[("POD_NAME", "x")])), None);
        assert_eq!(
            own_pod(env(&[("POD_NAME", ""), ("POD_NAMESPACE", "m")])),
            None
        );
    }

    #[test]
    fn a_long_reason_is_cut_to_what_the_api_server_takes() {
        let why = "é".repeat(2000);
        let note = event(&why).note.expect("a note");
        assert!(note.len() <= MAX_NOTE, "{}", note.len());
        assert!(note.ends_with("..."));
    }

    /// Issue 38: a bad policy at first start is posted as a Warning Event on the webhook's own
    /// Pod, with the problems, where `kubectl describe pod` shows it.
    #[tokio::test]
    async fn the_invalid_policy_is_posted_as_a_warning_event_on_the_pod() {
        let (client, mut handle) = mock_kube::client();
        let pod = own_pod(env(&[
            ("POD_NAME", "memguard-webhook-abc"),
            ("POD_NAMESPACE", "memguard"),
        ]))
        .expect("named");
        let why = "invalid policy in /etc/memguard/policy.yaml: defaultGpuMemory: `24` has no unit";
        let post = tokio::spawn(async move { publish(client, &pod, why).await });
        let (request, send) = handle.next_request().await.expect("a request");
        assert_eq!(request.method(), "POST");
        assert_eq!(
            request.uri().path(),
            "/apis/events.k8s.io/v1/namespaces/memguard/events"
        );
        let body = request
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let event: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(event["type"], "Warning");
        assert_eq!(event["reason"], INVALID_POLICY_REASON);
        assert_eq!(event["reportingController"], REPORTER);
        assert_eq!(event["regarding"]["name"], "memguard-webhook-abc");
        assert_eq!(event["regarding"]["kind"], "Pod");
        assert!(
            event["note"].as_str().is_some_and(|n| n
                .starts_with("not ready, no pod is guarded: invalid policy in")
                && n.contains("`24` has no unit")),
            "{event}"
        );
        send.send_response(mock_kube::answer(StatusCode::CREATED, &event));
        post.await.expect("joins").expect("posted");
    }
}
