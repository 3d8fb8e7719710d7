//! Criterion benchmark: one estimate and one full downgrade plan (filled in by the estimator work).
use criterion::{Criterion, criterion_group, criterion_main};

fn benches(_c: &mut Criterion) {}

criterion_group!(estimator, benches);
criterion_main!(estimator);
