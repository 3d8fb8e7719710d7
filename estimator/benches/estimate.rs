//! Criterion benchmark: one estimate, one full downgrade plan, one inference-server fit.
//!
//! `cargo bench -p memguard-estimator --bench estimate -- --warm-up-time 1 --measurement-time 3`
use criterion::{Criterion, criterion_group, criterion_main};
use memguard_estimator::{
    Bound, Bytes, Calibration, Floors, Method, TrainingConfig, catalog, estimate, plan,
    plan_against,
};
use std::hint::black_box;

/// LoRA on Llama 3 8B at batch 8, sequence 4096, rank 64, no checkpointing.
fn heavy() -> TrainingConfig {
    let mut cfg = TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"));
    cfg.method = Method::Lora;
    cfg.batch_size = 8;
    cfg.grad_accumulation = 2;
    cfg.seq_length = 4096;
    cfg.lora_rank = 64;
    cfg
}

fn benches(c: &mut Criterion) {
    let cfg = heavy();
    c.bench_function("estimate/llama-3-8b-lora", |b| {
        b.iter(|| estimate(black_box(&cfg)))
    });

    // 20 GiB with a 1.1 calibration: checkpointing, three batch halvings and three sequence
    // halvings (seven rungs, eight estimates).
    let runs = vec![(Bytes(100), Bytes(110)); 3];
    let calibration = Calibration::from_runs(&runs);
    let budget = Bytes::gib(20);
    let steps = plan(&cfg, budget, &calibration).map(|p| p.steps.len());
    assert!(
        matches!(steps, Ok(n) if n >= 4),
        "the plan needs several rungs: {steps:?}"
    );
    c.bench_function("plan/llama-3-8b-lora-to-20GiB", |b| {
        b.iter(|| plan(black_box(&cfg), black_box(budget), &calibration))
    });

    // The same plan checked against the upper bound at 0.95, as the webhook plans: each rung's
    // factor is a quantile over the committed residuals.
    let bound = Bound::at(0.95, &[]);
    let floors = Floors::default();
    c.bench_function("plan-against-bound/llama-3-8b-lora-to-20GiB", |b| {
        b.iter(|| {
            plan_against(
                black_box(&cfg),
                black_box(budget),
                &calibration,
                &floors,
                &bound,
            )
        })
    });
}

/// vLLM serving Llama 3 8B on half an H100 through KAI: the fraction lowered to the half, one
/// 8192-token sequence checked against the cache (what admission computes for a server pod).
fn serving(c: &mut Criterion) {
    use memguard_estimator::serving_fit::{DeviceShare, Engine, FitRules, ServerSettings, fit};
    let mut s = ServerSettings::new(
        Engine::Vllm,
        catalog::lookup("llama-3-8b").expect("catalog"),
    );
    s.serving.max_seq_length = 8192;
    s.max_length_given = true;
    let device = DeviceShare {
        seen: Bytes::gib(80),
        share: Bytes::gib(40),
    };
    let rules = FitRules {
        may_shorten: true,
        shortest: 256,
    };
    assert!(!fit(&s, device, Bytes::mib(512), rules).as_written());
    c.bench_function("serving-fit/vllm-llama-3-8b-kai-half", |b| {
        b.iter(|| fit(black_box(&s), black_box(device), Bytes::mib(512), rules))
    });
}

criterion_group!(estimator, benches, serving);
criterion_main!(estimator);
