//! A mocked apiserver for tests (controller-rs' scenario verifier): each expected request is
//! checked for method, path and body, and answered in turn. Shared by the controller's and the
//! lease's tests.

use http::{Method, Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock;

/// The test's end of the mocked apiserver.
pub(crate) type Handle = mock::Handle<Request<Body>, Response<Body>>;

/// One expected request and the answer to give.
pub(crate) struct Step {
    method: Method,
    /// Path without the query.
    path: String,
    /// Checks the JSON body (requests without one get `Value::Null`).
    check: Box<dyn Fn(&Value) + Send>,
    status: StatusCode,
    answer: Value,
}

/// Expects `method path` and answers `status` with `answer` as JSON.
pub(crate) fn step(method: Method, path: &str, status: StatusCode, answer: Value) -> Step {
    Step {
        method,
        path: path.to_string(),
        check: Box::new(|_| {}),
        status,
        answer,
    }
}

impl Step {
    /// Also checks the request's JSON body.
    pub(crate) fn body(mut self, check: impl Fn(&Value) + Send + 'static) -> Self {
        self.check = Box::new(check);
        self
    }
}

/// Serves `steps` in order, asserting each request; panics on anything unexpected. Dropping
/// the handle at the end makes any further request fail.
pub(crate) async fn verify(mut handle: Handle, steps: Vec<Step>) {
    for (i, step) in steps.into_iter().enumerate() {
        let (request, send) = handle.next_request().await.unwrap_or_else(|| {
            panic!(
                "step {i}: no request, expected {} {}",
                step.method, step.path
            )
        });
        assert_eq!(request.method(), step.method, "step {i}");
        assert_eq!(request.uri().path(), step.path, "step {i}");
        let bytes = request
            .into_body()
            .collect_bytes()
            .await
            .expect("request body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("JSON body")
        };
        (step.check)(&body);
        let response = Response::builder()
            .status(step.status)
            .body(Body::from(serde_json::to_vec(&step.answer).expect("json")))
            .expect("response");
        send.send_response(response);
    }
}

/// A client talking to the mock, and the mock's handle.
pub(crate) fn client() -> (Client, Handle) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), handle)
}

/// A `Status` failure body, as the apiserver answers errors.
pub(crate) fn status_error(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": reason, "reason": reason, "code": code})
}
