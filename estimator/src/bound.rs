//! An upper bound on the estimate at a stated level, from the estimator's own cross-validated
//! errors: for each measured run the ratio measured / estimate, the estimate made with every
//! fitted constant refitted without the run's source (`docs/accuracy.md`). The bound of a
//! configuration is its estimate times a quantile of those ratios over the runs of its class.
//!
//! The quantile is the split-conformal one: with `n` ratios, the `⌈(n + 1)·level⌉`-th smallest,
//! which covers a new run of the same kind at least `level` of the time. The runs of one source
//! are not independent (one stack, one habit of measuring), so a group's quantile counts only
//! when its runs come from three sources or more; a thinner group counts with its worst ratio.
//! The factor is the largest over the class, its device family and figure, and every run:
//! conservative where the data are thin (see [`upper_factor_from`]).

use crate::calibration::MIN_RUNS;
use crate::config::{Device, Method, Parallelism, TrainingConfig};
use crate::units::Bytes;

mod residuals;
pub use residuals::RESIDUALS;

/// The level the bound is stated at unless a policy says otherwise.
pub const DEFAULT_LEVEL: f64 = 0.95;

/// The levels a bound may be asked at: below one half it is no bound; above 0.99 the runs
/// cannot support it.
pub const LEVEL_RANGE: (f64, f64) = (0.5, 0.99);

/// What a figure counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Figure {
    /// Live tensors (`max_memory_allocated`).
    TensorPeak,
    /// The allocator's reserve (`max_memory_reserved`).
    Reserved,
    /// The device or process (NVML, a cgroup): what a limit is checked against.
    Device,
}

/// The class of configuration a bound is kept per: method, quantization, parallelism, figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Class {
    /// Everything trained (full fine-tuning, GaLore) rather than an adapter.
    pub full: bool,
    /// The frozen base is quantized (QLoRA, a `model_bits` below 16).
    pub quantized: bool,
    /// Sharded or split over devices (ZeRO, FSDP, tensor/pipeline parallelism).
    pub parallel: bool,
    /// A CPU run (the heap, not a GPU allocator).
    pub cpu: bool,
    /// What the figure counts.
    pub figure: Figure,
}

impl Class {
    /// The class of `cfg` for a figure of kind `figure`.
    pub fn of(cfg: &TrainingConfig, figure: Figure) -> Class {
        Class {
            full: !cfg.is_adapter(),
            quantized: cfg.method == Method::Qlora || cfg.model_bits.is_some_and(|b| b < 16),
            parallel: cfg.parallelism != Parallelism::None && cfg.world_size > 1,
            cpu: cfg.device == Device::Cpu,
            figure,
        }
    }

    /// A short name: `lora/4bit/single/device`.
    pub fn name(&self) -> String {
        format!(
            "{}{}/{}/{}/{}",
            if self.cpu { "cpu:" } else { "" },
            if self.full { "full" } else { "adapter" },
            if self.quantized { "4bit" } else { "16bit" },
            if self.parallel { "multi" } else { "single" },
            match self.figure {
                Figure::TensorPeak => "tensor-peak",
                Figure::Reserved => "reserved",
                Figure::Device => "device",
            }
        )
    }

    fn same_family(&self, other: &Class) -> bool {
        self.cpu == other.cpu && self.figure == other.figure
    }
}

/// The `⌈(n + 1)·level⌉`-th smallest ratio, or `None` when `n` is too small for `level`.
fn conformal(mut ratios: Vec<f64>, level: f64) -> Option<f64> {
    let n = ratios.len();
    let k = ((n + 1) as f64 * level).ceil() as usize;
    if k == 0 || k > n {
        return None;
    }
    ratios.sort_by(f64::total_cmp);
    Some(ratios[k - 1])
}

/// A group's own quantile is trusted only when its runs come from this many sources: the runs
/// of one source share its stack and its habits, so they count as one piece of evidence.
pub const MIN_SOURCES: usize = 3;

/// One cross-validated run: its class, its source, measured / cross-validated estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Residual {
    /// The class of its configuration and figure.
    pub class: Class,
    /// The source group it was published in.
    pub source: &'static str,
    /// measured / cross-validated estimate.
    pub ratio: f64,
}

/// The factor on the estimate of a `class` configuration at `level`, from `residuals`: the
/// largest over three groups (the class, its device family and figure, every run) of the
/// group's quantile where it has enough runs from [`MIN_SOURCES`] sources, else the worst
/// ratio it has shown. A class is thus never bounded tighter than all runs together, and a
/// thin one is bounded by its worst. Never below 1: the bound is never under the estimate.
pub fn upper_factor_from(residuals: &[Residual], class: &Class, level: f64) -> f64 {
    let level = level.clamp(LEVEL_RANGE.0, LEVEL_RANGE.1);
    let groups: [&dyn Fn(&Class) -> bool; 3] =
        [&|c| c == class, &|c| c.same_family(class), &|_| true];
    let mut floor = 1.0_f64;
    for keep in groups {
        let kept: Vec<&Residual> = residuals
            .iter()
            .filter(|r| keep(&r.class) && r.ratio.is_finite() && r.ratio > 0.0)
            .collect();
        let mut sources: Vec<&str> = kept.iter().map(|r| r.source).collect();
        sources.sort_unstable();
        sources.dedup();
        let ratios: Vec<f64> = kept.iter().map(|r| r.ratio).collect();
        match conformal(ratios.clone(), level) {
            Some(q) if sources.len() >= MIN_SOURCES => floor = floor.max(q),
            _ => floor = ratios.into_iter().fold(floor, f64::max),
        }
    }
    floor
}

/// [`upper_factor_from`] over the committed cross-validated residuals.
pub fn upper_factor(class: &Class, level: f64) -> f64 {
    upper_factor_from(RESIDUALS, class, level)
}

/// The factor a job's own measured runs give (pairs of raw estimate and measured peak, as
/// [`crate::Calibration::from_runs`] takes them): the largest ratio plus the spread of the
/// ratios, once [`MIN_RUNS`] valid runs exist. The same config run again varies far less than
/// configs the estimator has never seen, so this is usually narrower than the population's
/// factor; where the job has shown more than the population bound allows, it is wider.
pub fn learned_factor(runs: &[(Bytes, Bytes)]) -> Option<f64> {
    let ratios: Vec<f64> = runs
        .iter()
        .filter(|(est, measured)| est.0 > 0 && measured.0 > 0)
        .map(|(est, measured)| measured.as_f64() / est.as_f64())
        .collect();
    if ratios.len() < MIN_RUNS {
        return None;
    }
    let max = ratios.iter().copied().fold(f64::MIN, f64::max);
    let min = ratios.iter().copied().fold(f64::MAX, f64::min);
    Some(max + (max - min))
}

/// How the planner checks a config against the budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    /// The level the bound is stated at; `None` plans against the point estimate.
    pub level: Option<f64>,
    /// The job's own factor from its measured runs ([`learned_factor`]), which replaces the
    /// population's.
    pub learned: Option<f64>,
}

impl Bound {
    /// Plans against the point estimate (the calibrated total).
    pub const POINT: Bound = Bound {
        level: None,
        learned: None,
    };

    /// The bound at `level`, narrowed (or widened) by the job's own runs when it has enough.
    pub fn at(level: f64, runs: &[(Bytes, Bytes)]) -> Bound {
        Bound {
            level: Some(level),
            learned: learned_factor(runs),
        }
    }

    /// The factor on the raw estimate of `cfg`'s device-level figure; `None` plans against the
    /// point estimate.
    pub fn factor(&self, cfg: &TrainingConfig) -> Option<f64> {
        match (self.learned, self.level) {
            (Some(f), _) => Some(f),
            (None, Some(level)) => Some(upper_factor(&Class::of(cfg, Figure::Device), level)),
            (None, None) => None,
        }
    }

    /// The bound on a device-level figure of `cfg` whose raw estimate is `total`, given the
    /// calibrated point estimate `point` (the bound never falls below it).
    pub fn upper(&self, cfg: &TrainingConfig, total: Bytes, point: Bytes) -> Bytes {
        apply(self.factor(cfg), total, point)
    }
}

/// `total · factor`, never below `point`; `point` itself without a factor.
pub fn apply(factor: Option<f64>, total: Bytes, point: Bytes) -> Bytes {
    match factor {
        Some(f) => Bytes::from_f64(total.as_f64() * f).max(point),
        None => point,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;

    const SOURCES: [&str; 3] = ["a", "b", "c"];

    fn residual(class: Class, source: &'static str, ratio: f64) -> Residual {
        Residual {
            class,
            source,
            ratio,
        }
    }

    fn class(full: bool, figure: Figure) -> Class {
        Class {
            full,
            quantized: false,
            parallel: false,
            cpu: false,
            figure,
        }
    }

    #[test]
    fn conformal_quantile_needs_enough_runs() {
        let r: Vec<f64> = (1..=19).map(|i| i as f64).collect();
        // ⌈20·0.95⌉ = 19: the largest of 19.
        assert_eq!(conformal(r.clone(), 0.95), Some(19.0));
        assert_eq!(conformal(r[..18].to_vec(), 0.95), None);
        // ⌈20·0.5⌉ = 10.
        assert_eq!(conformal(r, 0.5), Some(10.0));
    }

    #[test]
    fn a_thin_class_takes_the_wider_group_and_its_own_worst() {
        let full = class(true, Figure::Device);
        let lora = class(false, Figure::Device);
        let mut res: Vec<Residual> = (0..40)
            .map(|i| residual(lora, SOURCES[i % 3], 0.8 + i as f64 * 0.005))
            .collect();
        // Two full-fine-tuning runs, one under-estimated by far.
        res.push(residual(full, "a", 1.0));
        res.push(residual(full, "b", 1.6));
        let f = upper_factor_from(&res, &full, 0.95);
        assert_eq!(f, 1.6, "never below what the class has shown");
        let l = upper_factor_from(&res, &lora, 0.95);
        assert!((0.95..1.6).contains(&l), "{l}");
    }

    #[test]
    fn the_factor_is_never_below_one() {
        let c = class(false, Figure::Device);
        let res: Vec<Residual> = (0..40).map(|i| residual(c, SOURCES[i % 3], 0.7)).collect();
        assert_eq!(upper_factor_from(&res, &c, 0.95), 1.0);
    }

    #[test]
    fn many_runs_of_one_source_are_still_thin() {
        let lora = class(false, Figure::Device);
        let full = class(true, Figure::Device);
        // 40 full-fine-tuning runs over three sources, all estimated well; 30 LoRA runs of one
        // source, also well, and one more that is 30 % over.
        let mut res: Vec<Residual> = (0..40)
            .map(|i| residual(full, SOURCES[i % 3], 1.0 + i as f64 * 0.001))
            .collect();
        res.extend((0..30).map(|_| residual(lora, "a", 1.0)));
        res.push(residual(lora, "a", 1.3));
        // The LoRA class alone would give 1.0 at 0.95 (⌈32·0.95⌉ = 31st of 31 is 1.3: the
        // worst); with one source it is thin, so the wider group's quantile and its own worst.
        assert_eq!(upper_factor_from(&res, &lora, 0.95), 1.3);
        res.pop();
        let f = upper_factor_from(&res, &lora, 0.95);
        assert!(
            f > 1.0,
            "the wider group's quantile, not the one source's: {f}"
        );
    }

    #[test]
    fn a_higher_level_never_gives_a_lower_factor() {
        for full in [true, false] {
            for figure in [Figure::TensorPeak, Figure::Reserved, Figure::Device] {
                let c = class(full, figure);
                let mut last = 0.0;
                for level in [0.5, 0.8, 0.9, 0.95, 0.99] {
                    let f = upper_factor(&c, level);
                    assert!(f >= last, "{} at {level}: {f} < {last}", c.name());
                    last = f;
                }
            }
        }
    }

    #[test]
    fn learned_runs_narrow_the_bound_and_need_three_runs() {
        let runs = |pairs: &[(u64, u64)]| -> Vec<(Bytes, Bytes)> {
            pairs.iter().map(|&(e, m)| (Bytes(e), Bytes(m))).collect()
        };
        assert_eq!(learned_factor(&runs(&[(100, 90), (100, 92)])), None);
        let f = learned_factor(&runs(&[(100, 90), (100, 92), (100, 91)])).expect("three runs");
        assert!((f - 0.94).abs() < 1e-9, "{f}");
        let cfg = TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"));
        let total = Bytes::gib(40);
        let population = Bound::at(0.95, &[]).upper(&cfg, total, total);
        assert!(population > total);
        let learned = Bound::at(0.95, &runs(&[(100, 90), (100, 92), (100, 91)]));
        // The bound never falls below the calibrated point estimate.
        let point = Bytes::from_f64(total.as_f64() * 0.91);
        let narrowed = learned.upper(&cfg, total, point);
        assert!(narrowed < population && narrowed >= point);
        assert_eq!(Bound::POINT.upper(&cfg, total, point), point);
    }
}
