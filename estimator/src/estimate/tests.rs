use super::*;
use crate::catalog;

fn llama8b() -> TrainingConfig {
    TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"))
}

#[test]
fn components_sum_to_the_totals() {
    let e = estimate(&llama8b()).expect("valid");
    let sum: Bytes = e.components.iter().map(|(_, b)| *b).sum();
    assert_eq!(sum, e.total);
    assert!(e.tensor_peak < e.total);
}
