//! End to end: the real `memguard-webhook` binary, a certificate made at test time, real TLS.

mod common;

use base64::Engine;
use common::{
    Ca, Conn, Server, admission_review, fixture_pod, promtool_check, scrape, write_secret,
};
use k8s_openapi::api::core::v1::Pod;
use std::time::{Duration, Instant};

fn apply(pod: &serde_json::Value, review: &serde_json::Value) -> serde_json::Value {
    let encoded = review["response"]["patch"].as_str().expect("a patch");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .expect("base64");
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("JSON patch");
    let mut out = pod.clone();
    json_patch::patch(&mut out, &patch).expect("the patch applies to the pod");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_admission_reviews_over_tls_and_drains_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new();
    let (cert, key, _) = ca.leaf("memguard-webhook.memguard.svc");
    write_secret(dir.path(), 1, &cert, &key);
    let server = Server::start(dir.path(), &[]);

    let mut conn = Conn::open(server.https, ca.client_config())
        .await
        .expect("TLS handshake with the generated CA");
    let (status, body) = conn
        .request("GET", "/healthz", Vec::new())
        .await
        .expect("healthz");
    assert_eq!((status, body.as_slice()), (200, b"ok".as_slice()));

    // A training pod: mutated, and the result is still a pod with a native sidecar.
    let pod = fixture_pod("single-gpu-lora");
    let (status, body) = conn
        .request("POST", "/mutate", admission_review(&pod, "uid-1"))
        .await
        .expect("mutate");
    assert_eq!(status, 200);
    let review: serde_json::Value = serde_json::from_slice(&body).expect("AdmissionReview");
    assert_eq!(review["response"]["uid"], "uid-1");
    assert_eq!(review["response"]["allowed"], true);
    let mutated = apply(&pod, &review);
    let typed: Pod = serde_json::from_value(mutated.clone()).expect("still a Pod");
    let spec = typed.spec.expect("spec");
    let init = spec.init_containers.expect("initContainers");
    // The Python client's init container, then the native sidecar.
    assert_eq!(init[0].name, "memguard-client");
    let sidecar = &init[1];
    assert_eq!(sidecar.name, "memguard-sidecar");
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    assert_eq!(spec.share_process_namespace, Some(true));

    // Reinvocation on the mutated pod: allowed, no patch (same keep-alive connection).
    let (_, body) = conn
        .request("POST", "/mutate", admission_review(&mutated, "uid-2"))
        .await
        .expect("reinvocation");
    let again: serde_json::Value = serde_json::from_slice(&body).expect("AdmissionReview");
    assert_eq!(again["response"]["allowed"], true);
    assert!(again["response"].get("patch").is_none(), "{again}");

    // Bad annotations: still allowed, with a warning and the error annotation.
    let bad = fixture_pod("bad-annotations");
    let (_, body) = conn
        .request("POST", "/mutate", admission_review(&bad, "uid-3"))
        .await
        .expect("bad pod");
    let skipped: serde_json::Value = serde_json::from_slice(&body).expect("AdmissionReview");
    assert_eq!(skipped["response"]["allowed"], true);
    assert!(apply(&bad, &skipped)["metadata"]["annotations"]["memguard.io/error"].is_string());

    // Does not fit even with every knob at its floor: still allowed, at the smallest config
    // tried, with "cannot fit" as the error, the warning and MEMGUARD_CANNOT_FIT (exit 87).
    let mut tiny = fixture_pod("single-gpu-lora");
    tiny["metadata"]["annotations"]["memguard.io/gpu-memory"] = serde_json::json!("1Gi");
    let (_, body) = conn
        .request("POST", "/mutate", admission_review(&tiny, "uid-4"))
        .await
        .expect("a pod that cannot fit");
    let review: serde_json::Value = serde_json::from_slice(&body).expect("AdmissionReview");
    assert_eq!(review["response"]["allowed"], true);
    let warned = review["response"]["warnings"].as_array().is_some_and(|w| {
        w.iter().any(|w| {
            w.as_str().is_some_and(|w| {
                w.starts_with("memguard: cannot fit; smallest config tried: batch 1 × ")
            })
        })
    });
    assert!(warned, "{review}");
    let admitted = apply(&tiny, &review);
    let error = admitted["metadata"]["annotations"]["memguard.io/error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains("with every knob at its floor; smallest config tried: batch 1 × "),
        "{error}"
    );
    let trainer_env = admitted["spec"]["containers"][0]["env"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let env = |name: &str| {
        trainer_env
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .map(str::to_string)
    };
    assert_eq!(env("MEMGUARD_CANNOT_FIT").as_deref(), Some("true"));
    assert_eq!(env("MEMGUARD_BATCH_SIZE").as_deref(), Some("1"));

    // Not an AdmissionReview: 400.
    let (status, _) = conn
        .request("POST", "/mutate", b"{\"hello\": 1}".to_vec())
        .await
        .expect("bad body");
    assert_eq!(status, 400);

    let metrics = scrape(server.metrics).await;
    for line in [
        // The training pod and the one that cannot fit.
        "memguard_webhook_admission_requests_total{outcome=\"mutated\"} 2",
        "memguard_webhook_admission_requests_total{outcome=\"unchanged\"} 1",
        "memguard_webhook_admission_requests_total{outcome=\"skipped\"} 1",
        "memguard_webhook_admission_requests_total{outcome=\"error\"} 1",
        "memguard_webhook_certificate_expiry_timestamp_seconds ",
        // No MemguardPolicy here: the file policy (here the defaults) is in force.
        "memguard_webhook_policy_generation 0",
    ] {
        assert!(metrics.contains(line), "missing `{line}` in\n{metrics}");
    }
    promtool_check(&metrics);
    drop(conn);

    let status = server.terminate();
    assert!(status.success(), "graceful exit, got {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificates_are_served_without_a_failed_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new();
    let (cert1, key1, der1) = ca.leaf("generation-1");
    write_secret(dir.path(), 1, &cert1, &key1);
    let server = Server::start(dir.path(), &[]);
    let config = ca.client_config();
    let pod = fixture_pod("multi-gpu-fsdp");

    // One long-lived keep-alive connection, plus a new connection per request.
    let mut kept = Conn::open(server.https, config.clone())
        .await
        .expect("connect");
    assert_eq!(kept.peer_cert, der1);
    let mut served = Vec::new();
    let mut failures = Vec::new();
    let request = async |conn: &mut Conn, n: usize| -> bool {
        match conn
            .request(
                "POST",
                "/mutate",
                admission_review(&pod, &format!("uid-{n}")),
            )
            .await
        {
            Ok((200, body)) => serde_json::from_slice::<serde_json::Value>(&body)
                .is_ok_and(|r| r["response"]["allowed"] == true),
            _ => false,
        }
    };

    let (cert2, key2, der2) = ca.leaf("generation-2");
    let mut n = 0;
    let mut rotated_at = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        n += 1;
        let mut fresh = match Conn::open(server.https, config.clone()).await {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("connect {n}: {e}"));
                continue;
            }
        };
        served.push(fresh.peer_cert.clone());
        if !request(&mut fresh, n).await {
            failures.push(format!("request {n} on a new connection"));
        }
        if !request(&mut kept, n).await {
            failures.push(format!("request {n} on the kept connection"));
        }
        if n == 20 {
            write_secret(dir.path(), 2, &cert2, &key2);
            rotated_at = Some(served.len());
        }
        let seen_new = served.iter().filter(|c| **c == der2).count();
        if seen_new >= 20 || Instant::now() > deadline {
            break;
        }
    }
    assert!(failures.is_empty(), "failed: {failures:?}");
    let rotated_at = rotated_at.expect("rotated");
    assert!(served[..rotated_at].iter().all(|c| *c == der1));
    let first_new = served
        .iter()
        .position(|c| *c == der2)
        .expect("the new certificate is served without a restart");
    assert!(
        served[first_new..].iter().all(|c| *c == der2),
        "once reloaded, only the new certificate is served"
    );

    // A broken update keeps the current certificate.
    write_secret(dir.path(), 3, "not a certificate", &key2);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = scrape(server.metrics).await;
        if metrics.contains("memguard_webhook_certificate_reloads_total{result=\"error\"} 1") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the bad certificate was never noticed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut after = Conn::open(server.https, config.clone())
        .await
        .expect("still serving");
    assert_eq!(
        after.peer_cert, der2,
        "the previous certificate stays in service"
    );
    assert!(request(&mut after, 0).await);
}

/// Issue 38: an invalid policy file at start used to stop the process (CrashLoopBackOff), and
/// with `failurePolicy: Ignore` every pod went unguarded without a word where people look. Now
/// the webhook serves but is not ready: `/readyz` answers 503 with every problem, the log says
/// NOT READY with them, `/healthz` stays 200 (a restart would not fix the file), a pod sent
/// anyway is admitted unchanged with a warning, and the rejection is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_policy_file_at_start_serves_not_ready_and_says_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new();
    let (cert, key, _) = ca.leaf("memguard-webhook.memguard.svc");
    write_secret(dir.path(), 1, &cert, &key);
    let cases = [
        (
            "apiVersion: v1\nkind: ConfigMap\ndata: {}\n",
            "`kind: ConfigMap` is not a policy",
        ),
        (
            "defaultGpuMemory: 24\ngpuMemory:\n  NVIDIA-A10G: 22\n",
            "defaultGpuMemory: `24` has no unit: did you mean `24Gi`?",
        ),
    ];
    for (text, problem) in cases {
        let file = dir.path().join("policy.yaml");
        std::fs::write(&file, text).expect("write");
        let server = Server::start(
            dir.path(),
            &["--no-kube", "--policy-file", file.to_str().expect("utf-8")],
        );
        let said = format!("invalid policy in {}: ", file.display());
        let logged = server.log.iter().find(|l| l["level"] == "ERROR");
        assert!(
            logged.is_some_and(|l| {
                l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("NOT READY"))
                    && l["problems"]
                        .as_str()
                        .is_some_and(|p| p.starts_with(&said) && p.contains(problem))
                    && l["reason"] == "InvalidPolicy"
            }),
            "{:#?}",
            server.log
        );
        let serving = server.log.last().expect("the serving line");
        assert_eq!(serving["ready"], false);

        let mut conn = Conn::open(server.https, ca.client_config())
            .await
            .expect("TLS handshake");
        let (status, body) = conn
            .request("GET", "/readyz", Vec::new())
            .await
            .expect("readyz");
        let body = String::from_utf8_lossy(&body);
        assert_eq!(status, 503, "{body}");
        assert!(
            body.starts_with(&format!("not ready: {said}")) && body.contains(problem),
            "{body}"
        );
        let (status, _) = conn
            .request("GET", "/healthz", Vec::new())
            .await
            .expect("healthz");
        assert_eq!(status, 200, "live: no restart loop");

        let pod = fixture_pod("single-gpu-lora");
        let (status, body) = conn
            .request("POST", "/mutate", admission_review(&pod, "uid-9"))
            .await
            .expect("mutate");
        assert_eq!(status, 200);
        let review: serde_json::Value = serde_json::from_slice(&body).expect("AdmissionReview");
        assert_eq!(review["response"]["allowed"], true);
        assert!(
            review["response"].get("patch").is_none(),
            "unguarded: {review}"
        );
        assert!(
            review["response"]["warnings"][0]
                .as_str()
                .is_some_and(|w| w.contains("not ready (invalid policy)")),
            "{review}"
        );
        let metrics = scrape(server.metrics).await;
        assert!(
            metrics.contains("memguard_webhook_policy_reloads_total{result=\"error\"} 1"),
            "{metrics}"
        );
        assert!(server.terminate().success(), "stops cleanly on SIGTERM");
    }
}

#[test]
fn a_policy_name_that_is_not_an_object_name_is_a_usage_error() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memguard-webhook"))
        .args(["--no-kube", "--tls-cert-file", "/nonexistent/tls.crt"])
        .args([
            "--tls-key-file",
            "/nonexistent/tls.key",
            "--log-format",
            "text",
        ])
        .args(["--policy-name", "default,metadata.name=other"])
        .output()
        .expect("the webhook binary runs");
    // The name goes into a field selector: only object names are taken.
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a Kubernetes object name"));
}

#[test]
fn start_up_errors_name_their_cause_once() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_memguard-webhook"))
            .args(["--no-kube", "--log-format", "text"])
            .args(args)
            .output()
            .expect("the webhook binary runs");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // A missing certificate: the file and the OS error, once.
    let stderr = run(&[
        "--listen",
        "127.0.0.1:0",
        "--tls-cert-file",
        "/nonexistent/tls.crt",
        "--tls-key-file",
        "/nonexistent/tls.key",
    ]);
    assert!(
        stderr.contains("reading /nonexistent/tls.crt: "),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );

    // The HTTPS port in use: which listener, which address, and why.
    let ca = Ca::new();
    let (cert, key, _) = ca.leaf("memguard-webhook.memguard.svc");
    let dir = tempfile::tempdir().expect("tempdir");
    write_secret(dir.path(), 1, &cert, &key);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let addr = taken.local_addr().expect("addr").to_string();
    let (crt, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let stderr = run(&[
        "--listen",
        &addr,
        "--metrics-listen",
        "127.0.0.1:0",
        "--tls-cert-file",
        crt.to_str().expect("utf-8"),
        "--tls-key-file",
        key.to_str().expect("utf-8"),
    ]);
    assert!(
        stderr.contains(&format!("binding the HTTPS listener {addr}"))
            && stderr.contains("Address already in use"),
        "{stderr}"
    );
}
