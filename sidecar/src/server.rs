//! HTTP: the trainer API (pod-local) and the metrics listener (only `/metrics`, `/healthz`).

use crate::config::parse_duration;
use crate::metrics;
use crate::sample::reported::Reported;
use crate::state::Shared;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use memguard_api::Report;
use memguard_api::oom::MAX_MESSAGE_CHARS;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;

/// Largest accepted `POST /v1/report` body.
pub const MAX_REPORT_BYTES: usize = 16 * 1024;
/// Longest long-poll wait; longer requests are cut to this.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// Long-poll wait when `after` is given without `wait`.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
/// How long the report carrying the trainer's config waits for the train-start decision.
pub const TRAIN_START_WAIT: Duration = Duration::from_secs(2);
/// Longest accepted `framework` name in a report.
const MAX_FRAMEWORK_LEN: usize = 64;

/// The trainer API: `/v1/signal`, `/v1/report`, `/v1/trace`, `/metrics`, `/healthz`.
pub fn trainer_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/signal", get(get_signal))
        .route("/v1/report", axum::routing::post(post_report))
        .route("/v1/trace", get(get_trace))
        .route("/metrics", get(get_metrics))
        .route("/healthz", get(healthz))
        .layer(DefaultBodyLimit::max(MAX_REPORT_BYTES))
        .with_state(shared)
}

/// The metrics listener: `/metrics` and `/healthz` only, so nothing outside the pod can report.
pub fn metrics_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/metrics", get(get_metrics))
        .route("/healthz", get(healthz))
        .with_state(shared)
}

/// `?after=SEQ&wait=30s`.
#[derive(Debug, Deserialize)]
pub struct SignalQuery {
    after: Option<u64>,
    wait: Option<String>,
}

fn bad_request(msg: String) -> Response {
    (StatusCode::BAD_REQUEST, msg).into_response()
}

async fn get_signal(State(shared): State<Arc<Shared>>, Query(q): Query<SignalQuery>) -> Response {
    let mut rx = shared.signal.subscribe();
    if let Some(after) = q.after {
        let wait = match q.wait.as_deref().map(parse_duration) {
            None => DEFAULT_WAIT,
            Some(Ok(d)) => d.min(MAX_WAIT),
            Some(Err(e)) => return bad_request(format!("wait: {e}")),
        };
        // Until a newer signal or the timeout; on timeout the current signal is returned (its
        // seq tells the caller nothing changed).
        let newer = async {
            loop {
                if rx.borrow_and_update().seq > after {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(wait, newer).await;
    }
    let signal = rx.borrow().clone();
    axum::Json(signal).into_response()
}

/// A refused report: counted, logged (the first few and then at powers of two, so that a trainer
/// flooding nonsense cannot flood the logs), answered 400.
fn refuse_report(shared: &Shared, msg: String) -> Response {
    let rejected = {
        let mut st = shared.status();
        st.reports_rejected += 1;
        st.reports_rejected
    };
    if rejected <= 5 || rejected.is_power_of_two() {
        tracing::warn!(error = %msg, rejected, "report refused");
    }
    bad_request(format!("report: {msg}"))
}

async fn post_report(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    // serde also reads a struct from a JSON array (field by position): `[]` would be an empty
    // report. A report is an object.
    if !body.trim_ascii_start().starts_with(b"{") {
        return refuse_report(&shared, "not a JSON object".into());
    }
    let report: Report = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return refuse_report(&shared, e.to_string()),
    };
    if report
        .framework
        .as_ref()
        .is_some_and(|f| f.len() > MAX_FRAMEWORK_LEN)
    {
        return refuse_report(
            &shared,
            format!("framework longer than {MAX_FRAMEWORK_LEN} bytes"),
        );
    }
    if let Err(e) = report.check() {
        return refuse_report(&shared, e);
    }
    let carries_config = report.config.is_some();
    {
        let mut st = shared.status();
        let gpu = report.reserved_bytes.or(report.allocated_bytes);
        if let Some(g) = gpu.max(report.peak_bytes).max(report.reserved_peak_bytes) {
            st.gpu_peak = Some(st.gpu_peak.map_or(g, |p| p.max(g)));
        }
        if let Some(oom) = &report.oom {
            *st.oom_records.entry((oom.kind, oom.outcome)).or_default() += 1;
            let mut kept = oom.clone();
            kept.message = kept.message.chars().take(MAX_MESSAGE_CHARS).collect();
            // The phase as `oom_kill_phase` takes it: the trainer's last report (this one's
            // first), never guessed.
            kept.phase = kept.phase.or(report.phase).or(st.phase);
            if let (memguard_api::OomOutcome::Fatal, Some(phase)) = (kept.outcome, kept.phase) {
                *st.fatal_oom_phases.entry(phase).or_default() += 1;
            }
            st.pending_oom = Some(kept.clone());
            st.last_oom = Some(kept);
        }
        if let Some(phase) = report.phase {
            st.phase = Some(phase);
        }
        if report.step.is_some() {
            st.step_reported = true;
        }
        if let Some(n) = report.saves_deferred {
            st.saves_deferred = Some(n);
        }
        if let Some(config) = &report.config {
            st.trainer_config = config.clone();
        }
        if let Some(memory) = &report.container_memory {
            st.container_memory = Some(Reported {
                memory: memory.clone(),
                received: std::time::Instant::now(),
            });
        }
        st.report = Some(report);
        st.reports_total += 1;
    }
    if carries_config {
        return train_start_reply(&shared).await;
    }
    StatusCode::NO_CONTENT.into_response()
}

/// The answer to the report that carried the trainer's config: the train-start decision and
/// the signal after it, once the sampling loop (woken now) made it; 204 when it takes longer
/// than [`TRAIN_START_WAIT`] (the trainer then goes on and follows the signal as usual).
async fn train_start_reply(shared: &Shared) -> Response {
    let mut rx = shared.train_start.subscribe();
    shared.wake.notify_one();
    let decided = async {
        loop {
            if let Some(reply) = rx.borrow_and_update().clone() {
                return Some(reply);
            }
            if rx.changed().await.is_err() {
                return None;
            }
        }
    };
    match tokio::time::timeout(TRAIN_START_WAIT, decided).await {
        Ok(Some(mut reply)) => {
            // The signal in force now: a trainer restarted after the decision (an OOM kill, a
            // sticky downgrade since) gets the current one, never an older one.
            reply.signal = shared.signal.borrow().clone();
            axum::Json(reply).into_response()
        }
        _ => StatusCode::NO_CONTENT.into_response(),
    }
}

async fn get_trace(State(shared): State<Arc<Shared>>) -> Response {
    let doc = shared.trace().to_json();
    axum::Json(doc).into_response()
}

async fn get_metrics(State(shared): State<Arc<Shared>>) -> Response {
    let signal = shared.signal.borrow().clone();
    let text = metrics::render(&shared.status(), &signal);
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use memguard_api::{Level, Signal};
    use tower::ServiceExt;

    fn shared() -> Arc<Shared> {
        Arc::new(Shared::new(Signal::initial(8, 2, false)))
    }

    async fn call(router: Router, req: Request<Body>) -> (StatusCode, String) {
        let resp = router.oneshot(req).await.expect("infallible");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    fn get_req(uri: &str) -> Request<Body> {
        Request::get(uri).body(Body::empty()).expect("request")
    }

    #[tokio::test]
    async fn signal_returns_the_current_signal() {
        let (status, body) = call(trainer_router(shared()), get_req("/v1/signal")).await;
        assert_eq!(status, StatusCode::OK);
        let s: Signal = serde_json::from_str(&body).expect("signal json");
        assert_eq!((s.seq, s.batch_size, s.level), (0, 8, Level::Ok));
    }

    #[tokio::test]
    async fn long_poll_returns_when_a_newer_signal_is_published() {
        let sh = shared();
        let router = trainer_router(sh.clone());
        let pending = tokio::spawn(call(router, get_req("/v1/signal?after=0&wait=60s")));
        tokio::task::yield_now().await;
        sh.signal.send_modify(|s| {
            s.seq = 1;
            s.level = Level::Downgrade;
            s.batch_size = 4;
        });
        let (status, body) = pending.await.expect("joined");
        assert_eq!(status, StatusCode::OK);
        let s: Signal = serde_json::from_str(&body).expect("json");
        assert_eq!((s.seq, s.batch_size), (1, 4));
    }

    #[tokio::test(start_paused = true)]
    async fn long_poll_times_out_with_the_current_signal_and_caps_the_wait() {
        let sh = shared();
        let started = tokio::time::Instant::now();
        let (status, body) = call(
            trainer_router(sh.clone()),
            get_req("/v1/signal?after=0&wait=1h"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(started.elapsed(), MAX_WAIT, "paused clock: exactly the cap");
        assert!(body.contains("\"seq\":0"));
        let (status, _) = call(
            trainer_router(sh.clone()),
            get_req("/v1/signal?after=5&wait=soon"),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (status, _) = call(trainer_router(sh), get_req("/v1/signal?after=x")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn a_train_start_config_is_exported_beside_what_admission_believed() {
        let sh = shared();
        sh.status().admitted_config = memguard_api::signal::parse_admitted_config(
            "batch-size=2,grad-accumulation=8,seq-length=2048",
        )
        .0;
        let body = r#"{"config":{"batch-size":16,"grad-accumulation":1,"seq-length":2048,"world-size":2}}"#;
        let req = Request::post("/v1/report")
            .body(Body::from(body))
            .expect("req");
        let (status, _) = call(trainer_router(sh.clone()), req).await;
        assert_eq!(status, StatusCode::NO_CONTENT);
        let (_, text) = call(metrics_router(sh.clone()), get_req("/metrics")).await;
        assert!(
            text.contains("memguard_sidecar_trainer_config{knob=\"batch-size\"} 16"),
            "{text}"
        );
        assert!(text.contains("memguard_sidecar_trainer_config{knob=\"world-size\"} 2"));
        assert!(text.contains("memguard_sidecar_config_mismatch{knob=\"batch-size\"} 1"));
        assert!(text.contains("memguard_sidecar_config_mismatch{knob=\"seq-length\"} 0"));
        // Admission did not say the world size: no mismatch is claimed for it.
        assert!(!text.contains("config_mismatch{knob=\"world-size\"}"));
        let summary = crate::summary::build(&sh.status(), &Signal::initial(2, 8, false), None, "x");
        assert_eq!(summary.config_mismatch, ["batch-size", "grad-accumulation"]);
        assert_eq!(summary.trainer_config.get("batch-size"), Some(&16.0));
        // An unknown knob is refused, with the known ones named.
        let req = Request::post("/v1/report")
            .body(Body::from(r#"{"config":{"batch_size":16}}"#))
            .expect("req");
        let (status, body) = call(trainer_router(sh.clone()), req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(body.contains("unknown knob"), "{body}");
    }

    /// The report that carries the config is answered with the decision once the sampling
    /// loop made it, and with the signal in force now (never an older one).
    #[tokio::test]
    async fn a_config_report_is_answered_with_the_decision_and_the_current_signal() {
        let sh = shared();
        let decided = sh.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let old = decided.signal.borrow().clone();
            let mut now = old.clone();
            now.seq = 3;
            decided.signal.send_replace(now);
            decided
                .train_start
                .send_replace(Some(memguard_api::train_start::TrainStartReply {
                    train_start: memguard_api::train_start::TrainStartPlan {
                        planned: true,
                        reason: "train-start plan: test".into(),
                        batch_size: Some(4),
                        ..Default::default()
                    },
                    signal: old,
                }));
        });
        let req = Request::post("/v1/report")
            .body(Body::from(r#"{"config":{"batch-size":16}}"#))
            .expect("req");
        let (status, body) = call(trainer_router(sh.clone()), req).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let reply: memguard_api::train_start::TrainStartReply =
            serde_json::from_str(&body).expect("a reply");
        assert_eq!(reply.train_start.batch_size, Some(4));
        assert_eq!(reply.signal.seq, 3);
    }

    #[tokio::test]
    async fn report_is_stored_and_bounded() {
        let sh = shared();
        let body = r#"{"framework":"torch","allocated_bytes":100,"reserved_bytes":200,"peak_bytes":150,"step":7,"batch_size":8}"#;
        let req = Request::post("/v1/report")
            .body(Body::from(body))
            .expect("req");
        let (status, _) = call(trainer_router(sh.clone()), req).await;
        assert_eq!(status, StatusCode::NO_CONTENT);
        {
            let st = sh.status();
            assert_eq!(st.report.as_ref().and_then(|r| r.step), Some(7));
            assert_eq!(st.gpu_peak, Some(200));
        }
        let big = format!(r#"{{"framework":"{}"}}"#, "x".repeat(MAX_REPORT_BYTES));
        let req = Request::post("/v1/report")
            .body(Body::from(big))
            .expect("req");
        let (status, _) = call(trainer_router(sh.clone()), req).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        let req = Request::post("/v1/report")
            .body(Body::from(r#"{"allocated":1}"#))
            .expect("r");
        let (status, body) = call(trainer_router(sh.clone()), req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let long = format!(r#"{{"framework":"{}"}}"#, "x".repeat(65));
        let req = Request::post("/v1/report")
            .body(Body::from(long))
            .expect("req");
        assert_eq!(
            call(trainer_router(sh), req).await.0,
            StatusCode::BAD_REQUEST
        );
    }

    #[tokio::test]
    async fn a_reported_phase_is_kept_until_the_next_and_an_unknown_one_is_refused() {
        let sh = shared();
        for (body, want) in [
            (r#"{"phase":"load"}"#, StatusCode::NO_CONTENT),
            (
                r#"{"step":3,"phase":"save","saves_deferred":2}"#,
                StatusCode::NO_CONTENT,
            ),
            (r#"{"step":4}"#, StatusCode::NO_CONTENT),
            (r#"{"phase":"eval"}"#, StatusCode::BAD_REQUEST),
        ] {
            let req = Request::post("/v1/report")
                .body(Body::from(body))
                .expect("req");
            assert_eq!(
                call(trainer_router(sh.clone()), req).await.0,
                want,
                "{body}"
            );
        }
        let st = sh.status();
        assert_eq!(
            st.phase,
            Some(memguard_api::TrainerPhase::Save),
            "a report without a phase keeps the last one; a refused one changes nothing"
        );
        assert_eq!(st.reports_rejected, 1);
        assert_eq!(st.saves_deferred, Some(2));
    }

    #[tokio::test]
    async fn an_oom_record_is_counted_by_kind_and_outcome_and_carried_in_the_summary() {
        let sh = shared();
        let mut fixture: serde_json::Value =
            serde_json::from_str(include_str!("../../api/fixtures/oom-record-v1.json"))
                .expect("fixture");
        // Records of a client that reported no phase.
        fixture.as_object_mut().expect("an object").remove("phase");
        let mut recovered = fixture.clone();
        recovered["outcome"] = "recovered".into();
        recovered["new_batch_size"] = 4.into();
        for oom in [&recovered, &recovered, &fixture] {
            let body = serde_json::json!({"step": 412, "batch_size": 8, "oom": oom});
            let req = Request::post("/v1/report")
                .body(Body::from(body.to_string()))
                .expect("req");
            assert_eq!(
                call(trainer_router(sh.clone()), req).await.0,
                StatusCode::NO_CONTENT
            );
        }
        let (_, metrics) = call(trainer_router(sh.clone()), get_req("/metrics")).await;
        for line in [
            "memguard_sidecar_oom_records_total{kind=\"cuda_oom\",outcome=\"recovered\"} 2\n",
            "memguard_sidecar_oom_records_total{kind=\"cuda_oom\",outcome=\"fatal\"} 1\n",
            "memguard_sidecar_oom_records_total{kind=\"cpu_oom\",outcome=\"fatal\"} 0\n",
        ] {
            assert!(metrics.contains(line), "{line} in {metrics}");
        }
        let summary = crate::summary::build(&sh.status(), &sh.signal.borrow(), None, "sigterm");
        assert_eq!(summary.oom_reports, 3);
        let last = summary.last_oom.expect("carried");
        assert_eq!(
            (last.kind, last.outcome),
            (
                memguard_api::OomKind::CudaOom,
                memguard_api::OomOutcome::Fatal
            )
        );
        assert_eq!(last.requested_bytes, Some(2 << 30));
        assert_eq!(last.phase, None, "no phase reported: none guessed");
        assert!(
            !metrics.contains("oom_records_fatal_by_phase_total{"),
            "{metrics}"
        );
        // A fatal record after the trainer said it saves: named `save`, as a kill would be;
        // one that names its own phase keeps it.
        let save = serde_json::json!({"phase": "save"});
        let req = Request::post("/v1/report")
            .body(Body::from(save.to_string()))
            .expect("req");
        call(trainer_router(sh.clone()), req).await;
        let mut at_load = fixture.clone();
        at_load["phase"] = "load".into();
        for oom in [&fixture, &at_load] {
            let body = serde_json::json!({"oom": oom});
            let req = Request::post("/v1/report")
                .body(Body::from(body.to_string()))
                .expect("req");
            assert_eq!(
                call(trainer_router(sh.clone()), req).await.0,
                StatusCode::NO_CONTENT
            );
        }
        let (_, metrics) = call(trainer_router(sh.clone()), get_req("/metrics")).await;
        for line in [
            "memguard_sidecar_oom_records_fatal_by_phase_total{phase=\"save\"} 1\n",
            "memguard_sidecar_oom_records_fatal_by_phase_total{phase=\"load\"} 1\n",
            "memguard_sidecar_oom_records_fatal_by_phase_total{phase=\"step\"} 0\n",
        ] {
            assert!(metrics.contains(line), "{line} in {metrics}");
        }
        let summary = crate::summary::build(&sh.status(), &sh.signal.borrow(), None, "sigterm");
        assert_eq!(
            summary.last_oom.and_then(|o| o.phase),
            Some(memguard_api::TrainerPhase::Load)
        );
        assert!(
            crate::summary::to_line(&crate::summary::build(
                &sh.status(),
                &sh.signal.borrow(),
                None,
                "x"
            ))
            .contains(r#""phase":"load""#)
        );
        let req = Request::post("/v1/report")
            .body(Body::from(r#"{"oom":{"version":1,"kind":"disk_oom"}}"#))
            .expect("req");
        assert_eq!(
            call(trainer_router(sh.clone()), req).await.0,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(sh.status().oom_reports(), 5);
    }

    #[tokio::test]
    async fn metrics_healthz_and_trace_answer() {
        let sh = shared();
        let (status, body) = call(trainer_router(sh.clone()), get_req("/metrics")).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("memguard_sidecar_batch_size 8"));
        let (status, body) = call(trainer_router(sh.clone()), get_req("/healthz")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok\n"));
        let (status, body) = call(trainer_router(sh.clone()), get_req("/v1/trace")).await;
        assert_eq!(status, StatusCode::OK);
        let doc: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert!(doc["traceEvents"].is_array());
    }

    #[tokio::test]
    async fn the_metrics_listener_serves_only_metrics_and_health() {
        let sh = shared();
        assert_eq!(
            call(metrics_router(sh.clone()), get_req("/metrics"))
                .await
                .0,
            StatusCode::OK
        );
        assert_eq!(
            call(metrics_router(sh.clone()), get_req("/healthz"))
                .await
                .0,
            StatusCode::OK
        );
        assert_eq!(
            call(metrics_router(sh.clone()), get_req("/v1/signal"))
                .await
                .0,
            StatusCode::NOT_FOUND
        );
        let req = Request::post("/v1/report")
            .body(Body::from("{}"))
            .expect("req");
        assert_eq!(call(metrics_router(sh), req).await.0, StatusCode::NOT_FOUND);
    }
}
