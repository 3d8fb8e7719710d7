//! The accuracy targets, asserted on every measured run (`bench/accuracy/data/`, the ground
//! truth, and `bench/accuracy/collected/`), **cross-validated**: each source group is scored with
//! every fitted constant refitted without it (leave one source out), so a figure says how the
//! estimator does on a source it has never seen. Targets: median |error| ≤ 10 % overall and
//! ≤ 15 % per source, at most 5 % of rows under −10 % (an under-estimate is an OOM), every OOM
//! row predicted not to fit, and no source's median more than 2 points worse than the figures
//! committed in `docs/accuracy.md`. The upper bound at 0.95 must cover at least 95 % of the
//! rows, itself cross-validated.

// Shared with the `accuracy` example, which uses every item.
#[allow(dead_code)]
#[path = "../examples/accuracy/harness.rs"]
mod harness;

use memguard_estimator::bound::RESIDUALS;
use std::sync::OnceLock;

const MEDIAN_APE: f64 = 0.10;
const SOURCE_MEDIAN_APE: f64 = 0.15;
const SHARE_UNDER_TEN: f64 = 0.05;
const REGRESSION_POINTS: f64 = 2.0;
/// Sources whose cross-validated median is over [`SOURCE_MEDIAN_APE`], said so in
/// `docs/accuracy.md`. None at present; the regression guard holds every source to its
/// committed figure.
const KNOWN_OVER_TARGET: [&str; 0] = [];

fn rows() -> &'static [harness::Scored] {
    static ROWS: OnceLock<Vec<harness::Scored>> = OnceLock::new();
    ROWS.get_or_init(|| {
        harness::score_all().expect("every ground-truth and collected row parses and validates")
    })
}

fn cv() -> &'static [harness::Scored] {
    static CV: OnceLock<Vec<harness::Scored>> = OnceLock::new();
    CV.get_or_init(|| harness::cross_validate(rows()))
}

#[test]
fn every_row_is_scored() {
    // Ground truth 68 GPU + 25 CPU, sets 1 (55) and 2 (101); collected: 33 LitGPT config hub,
    // 5 PEFT method comparison, 23 LitGPT resource tables, 5 torchtune README,
    // 16 gpjt/fine-tune-2024-04.
    assert_eq!(rows().len(), 68 + 25 + 55 + 101 + 33 + 5 + 23 + 5 + 16);
    assert_eq!(harness::sources(rows()).len(), 10 + 8);
}

#[test]
fn the_shipped_constants_reproduce_the_estimate() {
    for r in rows() {
        assert_eq!(
            r.estimated_with(&memguard_estimator::Fitted::SHIPPED),
            r.estimated,
            "{}",
            r.id
        );
    }
}

#[test]
fn a_fold_never_sees_its_own_source() {
    // Refitting without the only source of the CPU constants falls back to the priors; with
    // it, they move: the held-out source is really left out.
    let without = harness::fold(rows(), "M-cpu-measured");
    assert_eq!(without.cpu_process_baseline, harness::CPU_BASELINE_PRIOR);
    let all: Vec<&harness::Scored> = rows().iter().collect();
    assert_ne!(
        harness::fit(&all).cpu_process_baseline,
        harness::CPU_BASELINE_PRIOR
    );
}

#[test]
fn the_cpu_constants_rest_on_one_source_and_are_named_so() {
    let docs = std::fs::read_to_string(harness::docs_path()).expect("docs/accuracy.md");
    for (constant, sources) in harness::support(rows()) {
        if sources.len() == 1 {
            let line = format!("`{constant}` rests on one source only");
            assert!(docs.contains(&line), "docs/accuracy.md must say: {line}");
        }
    }
}

#[test]
fn the_shipped_fragmentation_is_the_fit_on_the_rows_whose_batches_vary() {
    // Fitted with the shipped steady constants, on the reserved figures of varying batches
    // (set 2's ms-swift rows); a fold without such rows keeps the prior, not the shipped fit.
    let shipped = memguard_estimator::Fitted::SHIPPED;
    let varying = harness::varying(rows());
    assert!(!varying.is_empty());
    let fitted = harness::fit_fragmentation(&varying, shipped);
    assert!(
        (fitted.cuda_fragmentation_per_spread - shipped.cuda_fragmentation_per_spread).abs() < 1e-9,
        "refit gives {}",
        fitted.cuda_fragmentation_per_spread
    );
    let without = harness::fold(rows(), "S-ms-swift-benchmark");
    assert_eq!(
        without.cuda_fragmentation_per_spread,
        harness::FRAGMENTATION_PRIOR
    );
    let docs = std::fs::read_to_string(harness::docs_path()).expect("docs/accuracy.md");
    assert!(docs.contains("`CUDA_FRAGMENTATION_PER_SPREAD` rests on one source only"));
}

#[test]
fn no_counted_row_measures_less_than_its_config_holds_at_the_step() {
    // Weights, scales, master weights, optimizer states and gradients are all live at the
    // optimizer step: a figure below them says the row's stated configuration is not the one
    // measured, and such a row must say so (UNMODELLED) rather than be scored.
    use memguard_estimator::Component;
    for r in rows().iter().filter(|r| !r.unmodelled) {
        let Some(measured) = r.measured else { continue };
        let held: memguard_estimator::Bytes = [
            Component::Weights,
            Component::QuantScales,
            Component::MasterWeights,
            Component::OptimizerStates,
            Component::Gradients,
        ]
        .iter()
        .map(|c| r.estimate.component(*c))
        .sum();
        assert!(
            measured >= held,
            "{}: measured {measured} is below the {held} its config holds at the step",
            r.id
        );
    }
}

#[test]
fn cross_validated_overall_targets_hold() {
    // On the rows the steady constants and the bound are made of; sets 1 and 2 are held to
    // their committed figures below (docs/accuracy.md, "Sets 1 and 2").
    let s = harness::cv_summary(cv(), |r| !r.in_new_set());
    assert!(s.rows >= 140, "{} rows", s.rows);
    assert!(
        s.median_ape <= MEDIAN_APE,
        "median {:.1} %",
        s.median_ape * 100.0
    );
    assert!(
        s.under_ten as f64 <= SHARE_UNDER_TEN * s.rows as f64,
        "{} of {} rows under -10 %",
        s.under_ten,
        s.rows
    );
    assert!(s.oom.1 >= 12);
    assert_eq!(s.oom.0, s.oom.1, "OOM rows predicted to fit");
}

#[test]
fn cross_validated_median_per_source_is_at_most_fifteen_percent() {
    for source in harness::sources(cv()) {
        if KNOWN_OVER_TARGET.contains(&source.as_str()) {
            continue;
        }
        let s = harness::cv_summary(cv(), |r| r.source == source);
        assert!(
            s.median_ape <= SOURCE_MEDIAN_APE,
            "{source}: median {:.1} %",
            s.median_ape * 100.0
        );
    }
}

#[test]
fn no_source_is_worse_than_its_committed_figure_by_more_than_two_points() {
    let committed = harness::committed_medians().expect("docs/accuracy.md's cross-validated table");
    let sources = harness::sources(cv());
    assert_eq!(
        committed.len(),
        sources.len(),
        "one committed figure per source"
    );
    for source in sources {
        let was = committed
            .get(&source)
            .unwrap_or_else(|| panic!("{source}: no committed figure"));
        let now = harness::cv_summary(cv(), |r| r.source == source).median_ape * 100.0;
        assert!(
            now <= was + REGRESSION_POINTS,
            "{source}: median {now:.1} %, committed {was:.1} %"
        );
    }
}

#[test]
fn the_bound_covers_its_level_cross_validated() {
    let (covered, n, width) = harness::bound_coverage(cv(), 0.95);
    assert!(
        covered as f64 >= 0.95 * n as f64,
        "0.95 bound covers {covered}/{n}"
    );
    // As narrow as coverage allows: a bound that is a multiple of the estimate is no bound.
    assert!(width < 1.5, "median width {width:.3}");
}

#[test]
fn the_committed_residuals_are_what_the_cross_validation_gives() {
    let now = harness::residuals(cv());
    assert_eq!(
        now.len(),
        RESIDUALS.len(),
        "rerun bench/accuracy/run.sh --write-residuals"
    );
    for (a, b) in now.iter().zip(RESIDUALS) {
        assert!(
            a.class == b.class && a.source == b.source && (a.ratio - b.ratio).abs() < 1e-4,
            "rerun bench/accuracy/run.sh --write-residuals: {a:?} != {b:?}"
        );
    }
}

/// Sets 1 and 2, in-sample with the shipped constants (median |error| %, rows under −10 %),
/// and the shipped 0.95 bound's coverage of them (it is not made of their residuals) with
/// its median bound / measured: committed in docs/accuracy.md, "Sets 1 and 2". Set 1 meets
/// the targets (≤ 10 %, ≤ 5 % of rows under −10 %); set 2 meets the median, not yet
/// the rows under −10 %, nor the coverage (≥ 90 %): a figure may only get better.
const SET1: (f64, usize) = (7.5, 0);
const SET2: (f64, usize) = (8.7, 9);
const SETS_BOUND_COVERAGE: f64 = 0.866;
const SETS_BOUND_WIDTH: f64 = 1.164;

#[test]
fn sets_1_and_2_are_no_worse_than_their_committed_figures() {
    for (file, (median, under)) in harness::NEW_SETS.iter().zip([SET1, SET2]) {
        let s = harness::cv_summary(rows(), |r| r.file == *file);
        assert!(
            s.median_ape * 100.0 <= median + 0.05,
            "{file}: median {:.1} %, committed {median:.1} %",
            s.median_ape * 100.0
        );
        assert!(
            s.under_ten <= under,
            "{file}: {} rows under -10 %, committed {under}",
            s.under_ten
        );
    }
    let (covered, n, width) = harness::bound_coverage_where(cv(), 0.95, |r| r.in_new_set());
    assert!(
        covered as f64 >= SETS_BOUND_COVERAGE * n as f64 - 0.5,
        "0.95 bound covers {covered}/{n} of sets 1 and 2"
    );
    assert!(
        width <= SETS_BOUND_WIDTH + 0.0005,
        "0.95 bound at a median {width:.3} x the measured peak of sets 1 and 2, committed {SETS_BOUND_WIDTH}"
    );
}
