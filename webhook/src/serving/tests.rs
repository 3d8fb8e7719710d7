use super::*;

#[test]
fn fractions_are_written_in_the_engines_precision() {
    assert_eq!(fraction_text(Engine::Vllm, 0.48), "0.48");
    assert_eq!(fraction_text(Engine::Vllm, 0.5), "0.5");
    assert_eq!(fraction_text(Engine::Sglang, 0.375), "0.375");
    assert_eq!(fraction_text(Engine::Sglang, 0.9), "0.9");
}
