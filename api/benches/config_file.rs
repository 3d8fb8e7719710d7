//! What reading a trainer's config file adds to resolving a pod: a label-only axolotl pod whose
//! config (axolotl's `examples/llama-3/lora-8b.yml`, 1.2 KB) is read from a ConfigMap, against
//! the same pod annotated (no file read), and the config-file reader alone on the parsed file.
//! `cargo bench -p memguard-api --bench config_file`; numbers in docs/perf-webhook.md.

use criterion::{Criterion, criterion_group, criterion_main};
use k8s_openapi::api::core::v1::Pod;
use memguard_api::cluster::{Cluster, ConfigMapList};
use memguard_api::launch::{config_file, find};
use memguard_api::{Policy, TrainingPod};
use std::collections::BTreeMap;
use std::hint::black_box;

const CONFIG: &str = include_str!("../../webhook/tests/fixtures/config-files/axolotl-lora-8b.yml");

fn pod(annotations: serde_json::Value) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "train", "namespace": "ml",
                     "labels": {"memguard.io/enabled": "true"}, "annotations": annotations},
        "spec": {
            "containers": [{"name": "trainer", "image": "x",
                            "command": ["axolotl", "train", "/config/lora-8b.yml"],
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                            "volumeMounts": [{"name": "config", "mountPath": "/config"}]}],
            "volumes": [{"name": "config", "configMap": {"name": "axolotl"}}]
        }
    }))
    .expect("a pod")
}

fn bench(c: &mut Criterion) {
    let policy = Policy::default();
    let maps = ConfigMapList(BTreeMap::from([(
        ("ml".to_string(), "axolotl".to_string()),
        BTreeMap::from([("lora-8b.yml".to_string(), CONFIG.to_string())]),
    )]));
    let cluster = Cluster {
        config_maps: Some(&maps),
        ..Cluster::default()
    };
    let label_only = pod(serde_json::json!({}));
    let annotated = pod(serde_json::json!({"memguard.io/model": "llama-3-8b",
        "memguard.io/method": "lora", "memguard.io/batch-size": "2"}));
    assert!(TrainingPod::resolve(&label_only, &policy, cluster).is_ok());
    c.bench_function(
        "resolve: label-only axolotl pod, config from a ConfigMap",
        |b| b.iter(|| TrainingPod::resolve(black_box(&label_only), &policy, cluster)),
    );
    c.bench_function("resolve: the same pod annotated, no ConfigMaps", |b| {
        b.iter(|| TrainingPod::resolve(black_box(&annotated), &policy, Cluster::default()))
    });
    let items: Vec<String> = [
        "axolotl",
        "train",
        "/config/lora-8b.yml",
        "--micro-batch-size=4",
    ]
    .map(String::from)
    .to_vec();
    let doc: serde_json::Value = serde_saphyr::from_str(CONFIG).expect("YAML");
    c.bench_function("config_file: find + read (parsed file)", |b| {
        b.iter(|| {
            let launch = find(black_box(&items)).expect("a launch");
            config_file::find(&launch).map(|c| c.read(&doc))
        })
    });
    c.bench_function("config_file: parse the YAML (1.2 KB)", |b| {
        b.iter(|| serde_saphyr::from_str::<serde_json::Value>(black_box(CONFIG)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
