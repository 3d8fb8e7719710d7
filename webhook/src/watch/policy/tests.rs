use super::*;
use futures::stream;
use memguard_api::crd::MemguardPolicySpec;

const NAME: &str = "default";

/// The policy file in force before any resource shows: safety ratio 0.8.
fn file() -> PolicySpec {
    spec(serde_json::json!({"safetyRatio": 0.8}))
}

fn spec(json: serde_json::Value) -> PolicySpec {
    serde_json::from_value(json).expect("a PolicySpec the CRD schema would accept")
}

fn resource(name: &str, generation: i64, json: serde_json::Value) -> MemguardPolicy {
    let mut r = MemguardPolicy::new(name, MemguardPolicySpec(spec(json)));
    r.metadata.generation = Some(generation);
    r
}

struct Fixture {
    watch: PolicyWatch,
    live: LivePolicy,
    metrics: Arc<Metrics>,
}

fn fixture(overrides: Overrides) -> Fixture {
    let fallback =
        Arc::new(effective_policy(Some(&file()), None, &overrides).expect("a valid file"));
    let live = Arc::new(ArcSwap::new(fallback.clone()));
    let metrics = Arc::new(Metrics::new());
    let watch = PolicyWatch::new(
        NAME,
        Some(file()),
        overrides,
        fallback,
        live.clone(),
        metrics.clone(),
    );
    Fixture {
        watch,
        live,
        metrics,
    }
}

impl Fixture {
    async fn feed(&mut self, events: Vec<Result<Event<MemguardPolicy>, watcher::Error>>) {
        self.watch.run(stream::iter(events)).await;
    }

    fn safety_ratio(&self) -> f64 {
        self.live.load().safety_ratio
    }

    /// The value of one sample, e.g. `memguard_webhook_policy_generation`.
    fn sample(&self, series: &str) -> Option<f64> {
        let text = self.metrics.encode();
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    fn generation(&self) -> Option<f64> {
        self.sample("memguard_webhook_policy_generation")
    }

    fn reloads(&self, result: &str) -> Option<f64> {
        self.sample(&format!(
            "memguard_webhook_policy_reloads_total{{result=\"{result}\"}}"
        ))
    }
}

#[tokio::test]
async fn the_listed_resource_goes_into_force_with_its_generation() {
    let mut f = fixture(Overrides::default());
    assert_eq!((f.safety_ratio(), f.generation()), (0.8, Some(0.0)));
    f.feed(vec![
        Ok(Event::Init),
        Ok(Event::InitApply(resource(
            NAME,
            4,
            serde_json::json!({"safetyRatio": 0.6, "defaultGpuMemory": "40Gi"}),
        ))),
        Ok(Event::InitDone),
    ])
    .await;
    assert_eq!(f.safety_ratio(), 0.6);
    assert_eq!(
        f.live.load().default_gpu_memory,
        memguard_estimator::Bytes::gib(40)
    );
    assert_eq!(f.generation(), Some(4.0));
    assert_eq!((f.reloads("ok"), f.reloads("error")), (Some(1.0), None));
}

#[tokio::test]
async fn an_invalid_edit_keeps_the_policy_in_force_and_names_every_problem() {
    let mut f = fixture(Overrides::default());
    f.feed(vec![Ok(Event::InitApply(resource(
        NAME,
        2,
        serde_json::json!({"safetyRatio": 0.6}),
    )))])
    .await;
    // What a schema cannot refuse (thresholds out of order, a bad quantity, an env name
    // memguard owns), and a ratio above 1 (a policy stored before the schema bounded it, or a
    // file).
    let invalid = resource(
        NAME,
        3,
        serde_json::json!({
            "safetyRatio": 1.5,
            "thresholds": {"warn": 0.9, "downgrade": 0.8, "critical": 0.95},
            "gpuMemory": {"NVIDIA-A10G": "lots"},
            "envNames": {"batch-size": "MEMGUARD_BATCH_SIZE"},
        }),
    );
    let change = f.watch.handle(Event::Apply(invalid));
    let Some(Change::Rejected {
        generation: 3,
        problems,
    }) = change
    else {
        panic!("expected a rejection of generation 3, got {change:?}");
    };
    for field in [
        "safetyRatio",
        "thresholds",
        "gpuMemory[NVIDIA-A10G]",
        "envNames[batch-size]",
    ] {
        assert!(
            problems.iter().any(|p| p.starts_with(field)),
            "no problem about {field} in {problems:?}"
        );
    }
    assert_eq!(f.safety_ratio(), 0.6, "generation 2 stays in force");
    assert_eq!(f.generation(), Some(2.0));
    assert_eq!(
        (f.reloads("ok"), f.reloads("error")),
        (Some(1.0), Some(1.0))
    );
}

/// Issue 11: one typo in the live policy's sidecar settings used to reach every new pod, whose
/// sidecar then refused to start. It is an invalid policy like any other now.
#[tokio::test]
async fn a_sidecar_interval_that_is_not_a_duration_is_rejected_and_counted() {
    let mut f = fixture(Overrides::default());
    f.feed(vec![Ok(Event::InitApply(resource(
        NAME,
        2,
        serde_json::json!({"sidecar": {"interval": "250ms"}}),
    )))])
    .await;
    let typo = resource(
        NAME,
        3,
        serde_json::json!({"sidecar": {"interval": "10 parsecs"}}),
    );
    let change = f.watch.handle(Event::Apply(typo));
    let Some(Change::Rejected {
        generation: 3,
        problems,
    }) = change
    else {
        panic!("expected a rejection of generation 3, got {change:?}");
    };
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].starts_with("sidecar.interval: \"10 parsecs\" is not a duration"),
        "{problems:?}"
    );
    assert_eq!(
        f.live.load().sidecar_interval,
        std::time::Duration::from_millis(250),
        "generation 2 stays in force"
    );
    assert_eq!(f.generation(), Some(2.0));
    assert_eq!(
        (f.reloads("ok"), f.reloads("error")),
        (Some(1.0), Some(1.0))
    );
}

#[tokio::test]
async fn deleting_the_resource_brings_the_policy_file_back() {
    let mut f = fixture(Overrides::default());
    let r = resource(NAME, 5, serde_json::json!({"safetyRatio": 0.6}));
    f.feed(vec![
        Ok(Event::InitApply(r.clone())),
        Ok(Event::InitDone),
        Ok(Event::Delete(r)),
    ])
    .await;
    assert_eq!(f.safety_ratio(), 0.8);
    assert_eq!(f.generation(), Some(0.0));
    assert_eq!(f.reloads("ok"), Some(2.0), "applied, then fell back");
}

#[tokio::test]
async fn a_relist_without_the_resource_means_it_was_deleted_meanwhile() {
    let mut f = fixture(Overrides::default());
    let r = resource(NAME, 5, serde_json::json!({"safetyRatio": 0.6}));
    f.feed(vec![Ok(Event::Apply(r))]).await;
    assert_eq!(f.safety_ratio(), 0.6);
    f.feed(vec![Ok(Event::Init), Ok(Event::InitDone)]).await;
    assert_eq!(f.safety_ratio(), 0.8);
    assert_eq!(f.generation(), Some(0.0));
}

#[tokio::test]
async fn other_names_are_ignored_and_watch_errors_keep_the_policy() {
    let mut f = fixture(Overrides::default());
    let other = resource("team-a", 9, serde_json::json!({"safetyRatio": 0.3}));
    assert_eq!(f.watch.handle(Event::Apply(other.clone())), None);
    f.feed(vec![
        Ok(Event::Init),
        Ok(Event::InitApply(other.clone())),
        Ok(Event::InitDone),
        Err(watcher::Error::NoResourceVersion),
        Ok(Event::Delete(other)),
    ])
    .await;
    assert_eq!(f.safety_ratio(), 0.8);
    assert_eq!(f.generation(), Some(0.0));
    assert_eq!((f.reloads("ok"), f.reloads("error")), (None, None));

    let ours = resource(NAME, 1, serde_json::json!({"safetyRatio": 0.6}));
    f.feed(vec![
        Ok(Event::Apply(ours)),
        Err(watcher::Error::NoResourceVersion),
    ])
    .await;
    assert_eq!(f.safety_ratio(), 0.6, "an error is not a deletion");
}

#[tokio::test]
async fn flags_still_win_over_the_resource() {
    let mut f = fixture(Overrides {
        safety_ratio: Some(0.5),
        ..Overrides::default()
    });
    assert_eq!(f.safety_ratio(), 0.5);
    f.feed(vec![Ok(Event::InitApply(resource(
        NAME,
        2,
        serde_json::json!({"safetyRatio": 0.6, "defaultGpuMemory": "40Gi"}),
    )))])
    .await;
    let policy = f.live.load();
    assert_eq!(policy.safety_ratio, 0.5);
    assert_eq!(
        policy.default_gpu_memory,
        memguard_estimator::Bytes::gib(40),
        "the resource's other fields apply"
    );
    // A flag can also make an otherwise invalid resource usable: the flags are part of it.
    let change = f.watch.handle(Event::Apply(resource(
        NAME,
        3,
        serde_json::json!({"safetyRatio": 7}),
    )));
    assert_eq!(change, Some(Change::Applied { generation: 3 }));
}

/// The kube glue against a mocked API server: one object listed and watched by name.
mod glue {
    use super::*;
    use hyper::{Request, Response};
    use kube::client::Body;
    use serde_json::json;
    use std::time::Duration;
    use tower_test::mock;

    type Handle = mock::Handle<Request<Body>, Response<Body>>;

    fn object(generation: i64, safety_ratio: f64) -> serde_json::Value {
        json!({
            "apiVersion": "training.memguard.io/v1alpha1", "kind": "MemguardPolicy",
            "metadata": {"name": NAME, "generation": generation,
                         "resourceVersion": format!("{}", 10 + generation)},
            "spec": {"safetyRatio": safety_ratio}
        })
    }

    /// Answers the next request, which must select our object by name.
    async fn answer(handle: &mut Handle, watch: bool, body: String) {
        let (request, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
            .await
            .expect("a request in time")
            .expect("a request");
        assert_eq!(
            request.uri().path(),
            "/apis/training.memguard.io/v1alpha1/memguardpolicies"
        );
        let query = request.uri().query().unwrap_or_default();
        assert!(
            query.contains("fieldSelector=metadata.name%3Ddefault"),
            "{query}"
        );
        assert_eq!(query.contains("watch=true"), watch, "{query}");
        send.send_response(Response::new(Body::from(body.into_bytes())));
    }

    async fn eventually(live: &LivePolicy, safety_ratio: f64) {
        let reached = tokio::time::timeout(Duration::from_secs(5), async {
            while live.load().safety_ratio != safety_ratio {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(
            reached.is_ok(),
            "safety ratio {} never became {safety_ratio}",
            live.load().safety_ratio
        );
    }

    #[tokio::test]
    async fn lists_then_watches_the_named_object_and_swaps_its_policy_in() {
        let Fixture {
            watch,
            live,
            metrics,
        } = fixture(Overrides::default());
        let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
        let task = spawn(Client::new(service, "default"), watch);

        let list = json!({
            "apiVersion": "training.memguard.io/v1alpha1", "kind": "MemguardPolicyList",
            "metadata": {"resourceVersion": "12"}, "items": [object(2, 0.6)]
        });
        answer(&mut handle, false, list.to_string()).await;
        eventually(&live, 0.6).await;

        let event = json!({"type": "MODIFIED", "object": object(3, 0.5)});
        answer(&mut handle, true, format!("{event}\n")).await;
        eventually(&live, 0.5).await;
        let text = metrics.encode();
        assert!(
            text.contains("memguard_webhook_policy_generation 3\n"),
            "{text}"
        );
        task.abort();
    }
}

/// Fault injection (docs/reliability.md): an operator or a controller flapping the resource
/// between valid and invalid, with watch errors in between, many times over. The policy in force
/// is always the last valid generation, every rejection is counted, and nothing else moves.
#[tokio::test]
async fn a_resource_flapping_between_valid_and_invalid_always_serves_the_last_valid_one() {
    let mut f = fixture(Overrides::default());
    let flaps = 500;
    let mut last_valid = None;
    for i in 0..flaps {
        let generation = i64::from(i) + 1;
        let valid = i % 2 == 0;
        let ratio = 0.5 + f64::from(i % 40) / 100.0;
        let json = if valid {
            serde_json::json!({"safetyRatio": ratio})
        } else {
            // Each invalid generation is broken its own way (what the CRD schema lets through).
            match i % 3 {
                0 => serde_json::json!({"safetyRatio": 1.0 + ratio}),
                1 => serde_json::json!({"gpuMemory": {"NVIDIA-A10G": "lots"}}),
                _ => {
                    serde_json::json!({"thresholds": {"warn": 0.9, "downgrade": 0.8, "critical": 0.95}})
                }
            }
        };
        let mut events = vec![Ok(Event::Apply(resource(NAME, generation, json)))];
        if i % 7 == 0 {
            events.push(Err(watcher::Error::NoResourceVersion));
        }
        f.feed(events).await;
        if valid {
            last_valid = Some((ratio, generation));
        }
        let (ratio, generation) = last_valid.expect("the first event is valid");
        assert_eq!(f.safety_ratio(), ratio, "flap {i}");
        assert_eq!(f.generation(), Some(generation as f64), "flap {i}");
    }
    let half = f64::from(flaps / 2);
    assert_eq!(
        (f.reloads("ok"), f.reloads("error")),
        (Some(half), Some(half))
    );
    // Deleted at the end: the file's policy, as before the flapping.
    f.feed(vec![Ok(Event::Delete(resource(
        NAME,
        0,
        serde_json::json!({}),
    )))])
    .await;
    assert_eq!((f.safety_ratio(), f.generation()), (0.8, Some(0.0)));
}

/// A `spec.models` entry whose `config` is another model's (its published count is 5 % off) is
/// an invalid policy like any other: rejected, counted, named; the models in force stay.
#[tokio::test]
async fn a_models_entry_with_a_wrong_parameter_count_is_rejected_and_the_models_in_force_stay() {
    let config: serde_json::Value = serde_json::from_str(include_str!(
        "../../../../api/fixtures/hf-config/qwen2.5-coder-7b-instruct.json"
    ))
    .expect("fixture");
    let mut f = fixture(Overrides::default());
    let good = serde_json::json!({"models": [
        {"name": "acme-coder-7b", "config": config, "params": 7_615_616_512u64},
    ]});
    f.feed(vec![Ok(Event::InitApply(resource(NAME, 4, good)))])
        .await;
    let found = |f: &Fixture, name: &str| f.live.load().models.lookup(name).map(|m| m.shape);
    let before = found(&f, "acme-coder-7b").expect("generation 4's model");
    let bad = serde_json::json!({"models": [
        {"name": "acme-coder-7b", "config": config, "params": "8.03B"},
        {"name": "acme-coder-7b-v2", "config": config},
    ]});
    let change = f.watch.handle(Event::Apply(resource(NAME, 5, bad)));
    let Some(Change::Rejected {
        generation: 5,
        problems,
    }) = change
    else {
        panic!("expected a rejection of generation 5, got {change:?}");
    };
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].starts_with("models[acme-coder-7b].params: published 8030000000, but the config derives 7615487488 (-5.2 %"),
        "{problems:?}"
    );
    assert_eq!(
        found(&f, "acme-coder-7b"),
        Some(before),
        "generation 4 stays"
    );
    assert_eq!(
        found(&f, "acme-coder-7b-v2"),
        None,
        "nothing of generation 5"
    );
    assert_eq!(f.generation(), Some(4.0));
    assert_eq!(
        (f.reloads("ok"), f.reloads("error")),
        (Some(1.0), Some(1.0))
    );
}

/// Issue 38: a live edit to `defaultGpuMemory: 24` (no unit) used to go into force as 24 bytes,
/// and every unpinned GPU pod became "cannot fit". It is rejected now, with the unit it most
/// likely meant; the last good policy stays in force, sizes and all.
#[tokio::test]
async fn a_size_without_a_unit_is_rejected_and_the_last_good_policy_stays() {
    let mut f = fixture(Overrides::default());
    let good =
        serde_json::json!({"defaultGpuMemory": "40Gi", "gpuMemory": {"NVIDIA-A10G": "22Gi"}});
    f.feed(vec![Ok(Event::InitApply(resource(NAME, 6, good)))])
        .await;
    let bad = serde_json::json!({"defaultGpuMemory": "24", "gpuMemory": {"NVIDIA-A10G": "22"}});
    let change = f.watch.handle(Event::Apply(resource(NAME, 7, bad)));
    let Some(Change::Rejected {
        generation: 7,
        problems,
    }) = change
    else {
        panic!("expected a rejection of generation 7, got {change:?}");
    };
    assert!(
        problems[0].starts_with("defaultGpuMemory: `24` has no unit: did you mean `24Gi`?")
            && problems[1].starts_with("gpuMemory[NVIDIA-A10G]: `22` has no unit"),
        "{problems:?}"
    );
    let live = f.live.load();
    assert_eq!(live.default_gpu_memory, memguard_estimator::Bytes::gib(40));
    assert_eq!(
        live.gpu_memory.get("NVIDIA-A10G"),
        Some(&memguard_estimator::Bytes::gib(22))
    );
    assert_eq!(f.generation(), Some(6.0));
    assert_eq!(
        (f.reloads("ok"), f.reloads("error")),
        (Some(1.0), Some(1.0))
    );
}
