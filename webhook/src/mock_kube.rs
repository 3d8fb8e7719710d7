//! A mocked API server for the watch caches' tests (tower-test): the kube-apiserver cannot
//! run in these tests.
use hyper::{Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use serde_json::Value;
use std::time::Duration;
use tower_test::mock;

/// The server side: each request the client makes, and where to send its answer.
pub type Handle = mock::Handle<Request<Body>, Response<Body>>;

/// A client talking to the mock, and the mock.
pub fn client() -> (Client, Handle) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), handle)
}

/// A JSON answer with `status`.
pub fn answer(status: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Body::from(serde_json::to_vec(body).expect("json")))
        .expect("response")
}

/// Polls until `f` holds, for at most 10 s.
pub async fn eventually(f: impl Fn() -> bool) -> bool {
    for _ in 0..200 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}
