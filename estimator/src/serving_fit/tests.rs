use super::*;
use crate::catalog;

const CONTEXT: Bytes = Bytes(512 * 1024 * 1024);

fn gib(x: f64) -> Bytes {
    Bytes::from_f64(x * (1u64 << 30) as f64)
}

/// Llama 3 8B in 16 bits (~15 GiB of weights, 128 KiB of cache per token).
fn server(engine: Engine, max_length: Option<u64>, fraction: Option<f64>) -> ServerSettings {
    let mut s = ServerSettings::new(engine, catalog::lookup("llama-3-8b").expect("catalog"));
    if let Some(n) = max_length {
        s.serving.max_seq_length = n;
        s.max_length_given = true;
    }
    s.fraction = fraction;
    s
}

const STRICT: FitRules = FitRules {
    may_shorten: false,
    shortest: 256,
};
const LENIENT: FitRules = FitRules {
    may_shorten: true,
    shortest: 256,
};

/// What a row expects.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// Left as written.
    AsWritten,
    /// Only the fraction changes, down.
    SmallerFraction,
    /// The fraction goes up (the share allows it) and that is enough.
    LargerFraction,
    /// The length is lowered to what fits.
    Shortened,
    /// Cannot hold one sequence: an error with the numbers.
    CannotHoldOne,
}

struct Row {
    name: &'static str,
    engine: Engine,
    seen: f64,
    share: f64,
    fraction: Option<f64>,
    max_length: Option<u64>,
    rules: FitRules,
    expect: Expect,
}

#[rustfmt::skip]
fn rows() -> Vec<Row> {
    use Engine::{Sglang, Vllm};
    use Expect::*;
    let row = |name, engine, seen, share, fraction, max_length, rules, expect| Row {
        name,
        engine,
        seen,
        share,
        fraction,
        max_length,
        rules,
        expect,
    };
    vec![
        // Whole H100: the defaults fit.
        row("vllm whole", Vllm, 80.0, 80.0, None, Some(8192), STRICT, AsWritten),
        row("sglang whole", Sglang, 80.0, 80.0, None, Some(8192), STRICT, AsWritten),
        // KAI gpu-fraction 0.5: the process sees the whole card, the pod has half.
        row("vllm kai half", Vllm, 80.0, 40.0, None, Some(8192), STRICT, SmallerFraction),
        row("sglang kai half", Sglang, 80.0, 40.0, None, Some(8192), STRICT, SmallerFraction),
        row("vllm kai half given", Vllm, 80.0, 40.0, Some(0.45), Some(8192), STRICT, AsWritten),
        // KAI 0.25 of an H100 cannot hold 15 GiB of weights and SGLang's 10 GiB reserve.
        row("sglang kai quarter", Sglang, 80.0, 20.0, None, Some(8192), STRICT, CannotHoldOne),
        // HAMi caps what the process sees: the defaults are already fractions of the cap.
        row("vllm hami 24g", Vllm, 24.0, 24.0, None, Some(8192), STRICT, AsWritten),
        row("sglang hami 24g", Sglang, 24.0, 24.0, None, Some(8192), STRICT, AsWritten),
        row("vllm hami 24g 0.97", Vllm, 24.0, 24.0, Some(0.97), Some(8192), STRICT, SmallerFraction),
        // MIG 2g.20gb (19.5 GiB): 32k tokens need 4 GiB of cache, the slice leaves ~2.
        row("vllm mig too long", Vllm, 19.5, 19.5, None, Some(32768), STRICT, CannotHoldOne),
        row("vllm mig shortened", Vllm, 19.5, 19.5, None, Some(32768), LENIENT, Shortened),
        row("sglang mig too long", Sglang, 19.5, 19.5, None, Some(32768), STRICT, CannotHoldOne),
        row("sglang mig shortened", Sglang, 19.5, 19.5, None, Some(32768), LENIENT, Shortened),
        // A low fraction the slice can raise: 12k tokens fit at the limit, not at 0.85.
        row("vllm mig raised", Vllm, 19.5, 19.5, Some(0.85), Some(12288), STRICT, LargerFraction),
        // A floor the fit may not go below.
        row(
            "vllm mig floor",
            Vllm,
            19.5,
            19.5,
            None,
            Some(32768),
            FitRules {
                may_shorten: true,
                shortest: 30000,
            },
            CannotHoldOne,
        ),
    ]
}

#[test]
fn every_rule_by_engine_and_sharing() {
    for r in rows() {
        let mut s = server(r.engine, r.max_length, r.fraction);
        if r.engine == Engine::Sglang {
            s.batched_tokens = None;
        }
        let device = DeviceShare {
            seen: gib(r.seen),
            share: gib(r.share),
        };
        let f = fit(&s, device, CONTEXT, r.rules);
        let name = r.name;
        let got = match (&f.error, f.changes.as_slice()) {
            (Some(_), _) => Expect::CannotHoldOne,
            (None, []) => Expect::AsWritten,
            (None, changes)
                if changes
                    .iter()
                    .any(|c| matches!(c, Change::MaxLength { .. })) =>
            {
                Expect::Shortened
            }
            (None, [Change::Fraction { from, to }]) if to < from => Expect::SmallerFraction,
            (None, [Change::Fraction { .. }]) => Expect::LargerFraction,
            (None, other) => panic!("{name}: unexpected changes {other:?}"),
        };
        assert_eq!(got, r.expect, "{name}: {f:?}");
        if f.error.is_none() {
            // Whatever changed, the server now stays within the pod's share and holds one
            // sequence of its maximum length.
            assert!(
                f.peak <= device.share,
                "{name}: peak {} > {}",
                f.peak,
                device.share
            );
            if let Some(n) = f.max_length {
                assert!(f.tokens_fit >= n, "{name}: {} < {n}", f.tokens_fit);
            }
            let concurrency = f.concurrency.expect("a length is known");
            assert!(concurrency >= 1.0, "{name}: {concurrency}");
        } else {
            let error = f.error.as_deref().unwrap_or_default();
            assert!(error.starts_with("cannot fit: "), "{name}: {error}");
            assert!(error.contains(s.engine.name()), "{name}: {error}");
        }
    }
}

#[test]
fn vllm_on_half_an_h100_through_kai_stays_within_its_half() {
    let s = server(Engine::Vllm, Some(8192), None);
    let device = DeviceShare {
        seen: Bytes::gib(80),
        share: Bytes::gib(40),
    };
    let f = fit(&s, device, CONTEXT, STRICT);
    // 0.9 of the whole card is 72 GiB: the neighbour's half. Within 40 GiB, graphs included.
    assert_eq!(
        f.changes,
        vec![Change::Fraction {
            from: 0.9,
            to: 0.48
        }]
    );
    assert!(0.48 * 80.0 + VLLM_CUDA_GRAPHS.as_gib() <= 40.0);
    assert!(f.tokens_fit > 100_000, "{}", f.tokens_fit);
    assert!(f.error.is_none());
}

#[test]
fn a_cannot_fit_error_carries_the_numbers() {
    let s = server(Engine::Vllm, Some(32768), None);
    let device = DeviceShare {
        seen: gib(19.5),
        share: gib(19.5),
    };
    let f = fit(&s, device, CONTEXT, STRICT);
    let error = f.error.expect("does not fit");
    // 32768 tokens × 128 KiB = 4 GiB.
    assert!(
        error.contains("--max-model-len 32768 needs 4.00 GiB"),
        "{error}"
    );
    assert!(
        error.contains(&format!("{} tokens fit", f.tokens_fit)),
        "{error}"
    );
    assert!(error.contains("--gpu-memory-utilization 0.92"), "{error}");
    assert!(error.contains("does not allow shorter"), "{error}");
}

#[test]
fn the_shortened_length_is_what_the_cache_holds_in_whole_blocks() {
    let s = server(Engine::Vllm, Some(32768), None);
    let device = DeviceShare {
        seen: gib(19.5),
        share: gib(19.5),
    };
    let f = fit(&s, device, CONTEXT, LENIENT);
    let Some(Change::MaxLength { from, to }) = f.changes.last().cloned() else {
        panic!("{f:?}");
    };
    assert_eq!(from, 32768);
    assert_eq!(to, f.tokens_fit);
    assert_eq!(to % VLLM_BLOCK_TOKENS, 0);
    // One more block would not fit the cache.
    let per_token = 2 * 32 * 8 * 128 * 2;
    assert!((to + VLLM_BLOCK_TOKENS) * per_token > f.kv_cache.0);
    assert!(to * per_token <= f.kv_cache.0);
}

#[test]
fn sglang_default_fraction_follows_its_reserve_table() {
    // H100 80 GB, tp 1: 10 GiB reserved, (80 − 10) / 80.
    assert_eq!(Engine::Sglang.default_fraction(Bytes::gib(80), 1), 0.875);
    // A 24 GiB card: 2.9 GiB.
    assert_eq!(Engine::Sglang.default_fraction(Bytes::gib(24), 1), 0.879);
    // H200: 12 GiB + 8/2 at tp 8.
    assert_eq!(sglang_reserve(Bytes::gib(141), 8), Bytes::gib(16));
    assert_eq!(Engine::Vllm.default_fraction(Bytes::gib(24), 1), 0.9);
}

#[test]
fn tensor_parallel_splits_weights_and_cache() {
    let device = DeviceShare {
        seen: Bytes::gib(80),
        share: Bytes::gib(80),
    };
    let one = fit(
        &server(Engine::Vllm, Some(8192), None),
        device,
        CONTEXT,
        STRICT,
    );
    let mut s = server(Engine::Vllm, Some(8192), None);
    s.tensor_parallel = 2;
    let two = fit(&s, device, CONTEXT, STRICT);
    assert_eq!(two.weights.0, one.weights.0 / 2);
    // Per device, half the weights and half of each token: more than twice the tokens.
    assert!(two.tokens_fit > 2 * one.tokens_fit);
}

#[test]
fn a_fixed_vllm_cache_is_checked_not_rewritten() {
    let mut s = server(Engine::Vllm, Some(8192), Some(0.9));
    s.kv_cache_memory = Some(Bytes::gib(30));
    let half = DeviceShare {
        seen: Bytes::gib(80),
        share: Bytes::gib(40),
    };
    let f = fit(&s, half, CONTEXT, LENIENT);
    assert!(f.changes.is_empty());
    assert!(f.error.expect("over").contains("--kv-cache-memory-bytes"));
    s.kv_cache_memory = Some(Bytes::gib(10));
    let f = fit(&s, half, CONTEXT, LENIENT);
    assert!(f.error.is_none(), "{f:?}");
    assert_eq!(f.tokens_fit, 10 * (1 << 30) / (128 * 1024));
}

#[test]
fn enforce_eager_frees_the_graphs_for_the_fraction() {
    let device = DeviceShare {
        seen: Bytes::gib(80),
        share: Bytes::gib(40),
    };
    let mut s = server(Engine::Vllm, Some(8192), None);
    s.enforce_eager = true;
    let f = fit(&s, device, CONTEXT, STRICT);
    assert_eq!(f.fraction, 0.5);
}
